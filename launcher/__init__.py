"""``ckpt-coordinator``, the console script: the service's commands and the tools shipped beside it.

``serve``, ``migrate`` and ``import-ledger`` are the service's (``checkpoint_coordinator.cli``);
``demo`` (``ckpt_demo``) and ``gymsim`` are packages of their own that the service must not import
(docs/architecture.md#layering), and the operator commands ``restore-plan``, ``snapshots``,
``accounting`` and ``effects`` are HTTP clients of a running coordinator (``ckpt_client.ops``,
``ckpt_client.ops_effects``). This module is the one place that knows all of them: it hands the
tools to the service's command line, which lists and dispatches them.
"""

from __future__ import annotations

from checkpoint_coordinator.cli import Delegated
from checkpoint_coordinator.cli import main as _service_main

__all__ = ["main", "TOOLS"]


# Imported on use: `ckpt-coordinator serve` loads neither the demo nor gymsim.
def _demo(argv: list[str]) -> int:
    from ckpt_demo import main

    return main(argv)


def _gymsim(argv: list[str]) -> int:
    from gymsim.cli import main

    return main(argv)


def _restore_plan(argv: list[str]) -> int:
    from ckpt_client.ops import restore_plan_main

    return restore_plan_main(argv)


def _snapshots(argv: list[str]) -> int:
    from ckpt_client.ops import snapshots_main

    return snapshots_main(argv)


def _accounting(argv: list[str]) -> int:
    from ckpt_client.ops import accounting_main

    return accounting_main(argv)


def _effects(argv: list[str]) -> int:
    from ckpt_client.ops_effects import effects_main

    return effects_main(argv)


TOOLS: dict[str, Delegated] = {
    "demo": Delegated("end-to-end demo: trainer + coordinator + gymsim, crash and restore", _demo),
    "gymsim": Delegated(
        "run a reference Gym deployment instance (gymsim)",
        _gymsim,
        description="Run gymsim, the reference NeMo Gym checkpoint participant deployment; the arguments "
        "after 'gymsim' are gymsim's own (try 'ckpt-coordinator gymsim --help').",
    ),
    "restore-plan": Delegated("print a run's restore plan without applying it (a running coordinator, token in $CKPTC_RUN_TOKEN)", _restore_plan),
    "snapshots": Delegated("print a run's snapshot history with phase timings and Gym figures (token in $CKPTC_RUN_TOKEN)", _snapshots),
    "accounting": Delegated(
        "print a run's accounting: prompt groups per bucket and whether they are conserved, rollout-seconds by fate, "
        "what each restore kept (token in $CKPTC_RUN_TOKEN)",
        _accounting,
    ),
    "effects": Delegated(
        "print a run's effect journal: by default its orphans (effects of discarded timelines), by reason (token in $CKPTC_RUN_TOKEN)",
        _effects,
    ),
}


def main(argv: list[str] | None = None) -> int:
    return _service_main(argv, commands=TOOLS)
