"""``python -m ckpt_demo``: the same as ``ckpt-coordinator demo``."""

from . import main

raise SystemExit(main())
