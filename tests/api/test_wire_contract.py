"""The wire contract, typed once: the client's result models against the served OpenAPI document.

The client (clients/ckpt_client/models.py) restates the coordinator's answers by hand. Each
result model is mapped below, explicitly, to the answers it parses (operation, status, and where
in the answer). The rule, per mapped answer:

* every field of the client model (``raw`` aside) is a member of the answer's schema, under its
  own name, or under the member it is derived from (``DERIVED``, e.g. ``BarrierResult.delta`` from
  ``staging_keys_delta``), unless the mapping says the answer lacks it (``absent``, e.g. a run's
  ``run_token`` outside its creation answer);
* every member of the schema is modelled by the client, or listed in ``UNMODELLED`` (members the
  client deliberately leaves to ``raw``), and every ``UNMODELLED`` entry is a member somewhere;
* every key the client requires (``_req(d, key, ...)`` in its ``parse``) is required and never
  null in the schema.

So a field renamed on either side fails: on the client, the new name is no member; on the
server, the client's field (or the stale ``UNMODELLED`` entry) names a member that is gone, and
the new member is neither modelled nor listed.

The document itself: every operation declares a closed schema (``additionalProperties: false``)
for each 2xx answer with a body, and every ``/v1`` operation lists its problem answers (the
common ones, ``run_not_found`` under a run, and every code its handler raises itself).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import ckpt_client.accounting as ca
import ckpt_client.effects as ce
import ckpt_client.models as cm
import pytest
from checkpoint_coordinator.errors import CoordinatorError

from .openapi_check import operations, resolve, served_openapi

DOC = served_openapi()


class Answer(NamedTuple):
    operation: str
    status: int
    where: str = ""  # "" the answer; "a[].b" the member b of each item of its member a
    absent: frozenset[str] = frozenset()  # client fields this answer does not carry


def A(operation: str, status: int = 200, where: str = "", absent: tuple[str, ...] = ()) -> Answer:
    return Answer(operation, status, where, frozenset(absent))


# Client result model -> the answers it parses.
PARSES: dict[type, list[Answer]] = {
    cm.AdmitResult: [A("admit_groups")],
    cm.AdmittedGroup: [A("admit_groups", where="groups[]")],
    cm.SendRow: [
        A("admit_groups", where="groups[].rows[]"),
        A("dispatch_attempts", where="rows[]"),
        A("report_refused", where="rows[]"),
        A("report_failed", where="groups[].rows_to_send[]"),
        A("report_stream_ended", where="groups[].rows_to_send[]"),
    ],
    cm.DispatchResult: [A("dispatch_attempts")],
    cm.RefusedResult: [A("report_refused")],
    cm.RowResult: [A("report_sealed", where="rows[]"), A("report_failed", where="rows[]")],
    cm.SealResult: [A("report_sealed")],
    cm.GroupNext: [
        A("report_failed", where="groups[]"), A("report_stream_ended", where="groups[]"), A("pending_attempts", where="stragglers[].group"),
    ],
    cm.Straggler: [A("pending_attempts", where="stragglers[]")],
    cm.PendingResult: [A("pending_attempts")],
    cm.FailResult: [A("report_failed")],
    cm.StreamEndedResult: [A("report_stream_ended")],
    cm.GroupOutcome: [A("finalize_groups", where="groups[]"), A("abandon_groups", where="groups[]")],
    cm.GroupsResult: [A("finalize_groups"), A("abandon_groups")],
    cm.LiveCounts: [A("live_counts")],
    cm.GroupDetail: [A("get_group")],
    cm.SiblingInfo: [A("get_group", where="siblings[]")],
    cm.AttemptInfo: [A("get_group", where="siblings[].attempts[]")],
    cm.OutboxPage: [A("list_outbox")],
    cm.Run: [
        A("create_run", 201),
        *(A(op, absent=("run_token", "warnings")) for op in ("get_run", "close_run", "reopen_run")),
    ],
    cm.Snapshot: [
        A("request_snapshot", 202),
        A("request_snapshot", 200),
        A("get_snapshot"),
        A("list_snapshots", where="snapshots[]"),
        A("abort_snapshot"),
        A("snapshot_data_plane_captured"),
    ],
    cm.SnapshotBlockers: [A("get_snapshot", where="blockers"), A("list_snapshots", where="snapshots[].blockers")],
    cm.DataPlaneRef: [A("get_snapshot", where="data_plane_ref"), A("get_restore_plan", where="data_plane_ref"), A("create_restore", where="data_plane_ref")],
    cm.BarrierResult: [A("snapshot_barrier_held")],
    cm.CutKeys: [A("snapshot_staging_keys")],
    cm.TrainStep: [A("announce_train_step")],
    cm.PlanRow: [A("get_restore_plan", where="rows[]"), A("create_restore", where="rows[]"), A("get_restore_rows", where="rows[]")],
    cm.RestorePlan: [A("get_restore_plan")],
    cm.RestoreResult: [A("create_restore")],
    cm.GymRegistration: [A("register_gym_instances")],
    ce.BeginAnswer: [A("begin_effect")],
    ce.EffectRecord: [
        A("complete_effect"), A("abandon_effect"), A("list_effects", where="effects[]"),
        A("begin_effect", where="record"), A("begin_effect", where="orphaned"),
    ],
    ce.EffectPage: [A("list_effects")],
    ca.Accounting: [A("get_accounting")],
    ca.PromptAccounting: [A("get_accounting", where="prompts")],
    ca.WorkAccounting: [A("get_accounting", where="work")],
    ca.RestoreAccounting: [
        A("get_accounting", where="restores[]"),
        *(A(op, where="accounting", absent=("restore_id", "snapshot_id", "applied_at", "recorded")) for op in ("get_restore_plan", "create_restore")),
    ],
    ca.WorkSplit: [
        A("get_accounting", where="restores[].by_instance[]", absent=("restore_level",)),
        A("get_accounting", where="restores[].by_level[]", absent=("instance_id",)),
        A("create_restore", where="accounting.by_instance[]", absent=("restore_level",)),
    ],
}

# Client fields read from another member of the answer than their name.
DERIVED: dict[type, dict[str, str]] = {
    cm.Snapshot: {"warnings": "detail"},
    cm.BarrierResult: {"delta": "staging_keys_delta", "added": "staging_keys_delta", "removed": "staging_keys_delta"},
}

# The snapshot record's members: the barrier answers the record too, which the client reads as
# a ``Snapshot`` (from the status reads) and not again in ``BarrierResult``.
SNAPSHOT_RECORD = "<the members of SnapshotOut>"

# Members of an answer the client does not model as fields (reachable through ``raw``).
UNMODELLED: dict[type, set[str]] = {
    cm.GroupDetail: {"data_attempts_used", "prompt_ref", "task_digest", "task_source", "agent_name", "target_step", "weight_version"},
    cm.AttemptInfo: {"attempt_id", "gym_owned", "policy_version", "created_at", "dispatched_at", "ended_at"},
    cm.Run: {"consecutive_snapshot_losses", "consecutive_snapshot_failures", "created_at", "closed_at"},
    cm.Snapshot: {
        "stop", "deadline_at", "gym_checkpoint_id", "snapshot_dir", "gym_restarted_episodes", "resume_failure", "cut_at",
        "created_at", "published_at", "ended_at", "gym_manifest",
    },
    cm.BarrierResult: {SNAPSHOT_RECORD},
    cm.CutKeys: {"snapshot_id"},
    cm.TrainStep: {"announced_at"},
    cm.RestorePlan: {
        "run_id", "gym_checkpoint_id", "snapshot_dir", "with_gym_state", "gym_state", "epoch", "total", "reasons", "instance_map",
        "cohort_reruns", "skipped_groups", "retires", "continued_by_instance", "next_cursor", "accounting",
    },
    cm.RestoreResult: {
        "run_id", "gym_checkpoint_id", "snapshot_dir", "with_gym_state", "gym", "total", "reasons", "instance_map", "cohort_reruns",
        "dispatched_after_cut", "retires_queued", "groups_removed", "train_steps_retired", "aborted_snapshots", "rows_total", "next_cursor",
        "accounting", "effects",
    },
    cm.GymRegistration: {"run_id"},
}


def schema_at(answer: Answer) -> dict[str, Any]:
    """The schema of the part of ``answer`` a client model parses."""
    _, _, op = operations(DOC)[answer.operation]
    schema = resolve(DOC, op["responses"][str(answer.status)]["content"]["application/json"]["schema"])
    for step in filter(None, answer.where.split(".")):
        name, items = step.removesuffix("[]"), step.endswith("[]")
        schema = resolve(DOC, schema["properties"][name])
        if items:
            schema = resolve(DOC, schema["items"])
    return schema


def client_fields(model: type) -> set[str]:
    return {f.name for f in dataclasses.fields(model)} - {"raw"}


def required_keys(model: type) -> set[str]:
    """The keys ``model.parse`` requires of the document it parses (``_req(d, "key", ...)``)."""
    source = textwrap.dedent(inspect.getsource(model))
    keys = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_req" and getattr(node.args[0], "id", None) == "d":
            keys.add(node.args[1].value)  # type: ignore[attr-defined]
    return keys


def _cases() -> Iterator[Any]:
    for model, answers in PARSES.items():
        for answer in answers:
            yield pytest.param(model, answer, id=f"{model.__name__}<-{answer.operation}:{answer.status}{'/' + answer.where if answer.where else ''}")


@pytest.mark.parametrize(("model", "answer"), list(_cases()))
def test_client_model_matches_the_answer_schema(model: type, answer: Answer) -> None:
    schema = schema_at(answer)
    members = set(schema["properties"])
    derived = DERIVED.get(model, {})
    for name in sorted(client_fields(model)):
        member = derived.get(name, name)
        if name in answer.absent:
            assert member not in members, f"{model.__name__}.{name}: said to be absent from {answer.operation}, but it is a member"
        else:
            assert member in members, f"{model.__name__}.{name} reads {member!r}, which {answer.operation} does not answer: {sorted(members)}"
    modelled = {derived.get(n, n) for n in client_fields(model)}
    allowed = UNMODELLED.get(model, set())
    if SNAPSHOT_RECORD in allowed:
        allowed = (allowed - {SNAPSHOT_RECORD}) | set(DOC["components"]["schemas"]["SnapshotOut"]["properties"])
    left = members - modelled - allowed
    assert not left, f"{answer.operation} answers {sorted(left)}, which {model.__name__} neither models nor lists in UNMODELLED"
    for key in sorted(required_keys(model)):
        assert key in schema.get("required", ()), f"{model.__name__} requires {key!r}; {answer.operation} does not"
        assert resolve(DOC, schema["properties"][key]) == schema["properties"][key], f"{key!r} may be null in {answer.operation}"


def test_every_unmodelled_member_is_answered() -> None:
    """A stale ``UNMODELLED`` entry (a member renamed or removed by the server) fails here."""
    for model, names in UNMODELLED.items():
        members = set().union(*(schema_at(a)["properties"] for a in PARSES[model]))
        stale = names - members - {SNAPSHOT_RECORD}
        assert not stale, f"UNMODELLED[{model.__name__}] names {sorted(stale)}, which none of its answers has"


def test_every_client_result_model_is_mapped() -> None:
    """A result model added to the client without its answers here fails."""
    results = {
        obj for obj in vars(cm).values()
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == cm.__name__ and "parse" in vars(obj)
    }
    assert results - set(PARSES) == set(), "map these client models to the answers they parse"


# ------------------------------------------------------------------------------- the document


def test_every_operation_declares_a_closed_schema_for_each_success() -> None:
    for op_id, (method, path, op) in operations(DOC).items():
        successes = {s: r for s, r in op["responses"].items() if s.startswith("2")}
        assert successes, f"{op_id}: no 2xx answer"
        for status, response in successes.items():
            if status == "204":
                assert not response.get("content"), f"{op_id}: 204 with a body"
                continue
            content = response.get("content", {})
            assert list(content) == ["application/json"], f"{op_id} {status}: {list(content)}"
            schema = resolve(DOC, content["application/json"]["schema"])
            assert schema.get("properties"), f"{op_id} {status}: the answer's members are not described: {schema}"
            assert schema.get("additionalProperties") is False, f"{op_id} {status}: undescribed members allowed"


COMMON_STATUSES = {"401", "403", "408", "413", "422", "429", "503"}


def test_every_v1_operation_lists_its_problem_answers() -> None:
    for op_id, (method, path, op) in operations(DOC).items():
        if not path.startswith("/v1/"):
            continue
        responses = op["responses"]
        assert COMMON_STATUSES <= set(responses), f"{op_id}: lacks {sorted(COMMON_STATUSES - set(responses))}"
        for status, response in responses.items():
            if status.startswith("2"):
                continue
            assert list(response["content"]) == ["application/problem+json"], f"{op_id} {status}"
            assert response["content"]["application/problem+json"]["schema"]["properties"]["code"]["type"] == "string"
            codes = response["x-problem-codes"]
            assert codes and all(f"`{c}`" in response["description"] for c in codes), f"{op_id} {status}"
        if "{run_id}" in path:
            assert "run_not_found" in responses["404"]["x-problem-codes"], f"{op_id}: an admin may name a run that does not exist"


def _listed_codes(op: dict[str, Any]) -> set[str]:
    return {c for r in op["responses"].values() for c in r.get("x-problem-codes", ())}


def _raised_codes(endpoint: Any) -> Iterator[str]:
    """The codes of the coordinator errors ``endpoint`` raises itself (``raise X(..., code=...)``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(endpoint)))
    scope = vars(inspect.getmodule(endpoint))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name)):
            continue
        cls = scope.get(node.exc.func.id)
        if not (isinstance(cls, type) and issubclass(cls, CoordinatorError)):
            continue
        given = [k.value.value for k in node.exc.keywords if k.arg == "code" and isinstance(k.value, ast.Constant)]
        yield given[0] if given else cls.code


def test_every_code_a_handler_raises_is_listed() -> None:
    from checkpoint_coordinator.api import health, routers, runs

    ops = operations(DOC)
    checked = 0
    for router in (health.router, runs.router, *routers.ROUTERS):
        for route in router.routes:
            op_id = route.operation_id
            if op_id not in ops or not ops[op_id][1].startswith("/v1/"):
                continue
            for code in _raised_codes(route.endpoint):
                checked += 1
                assert code in _listed_codes(ops[op_id][2]), f"{op_id} raises {code!r} but does not list it"
    assert checked >= 5  # the scan finds the raises (replica_draining, forbidden, invalid_request...)


def test_the_client_models_module_is_the_one_checked() -> None:
    assert Path(cm.__file__).name == "models.py" and len(PARSES) >= 25
