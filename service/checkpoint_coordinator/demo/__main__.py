"""``python -m checkpoint_coordinator.demo``: the same as ``ckpt-coordinator demo``."""

from . import main

raise SystemExit(main())
