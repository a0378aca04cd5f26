"""``python -m ckpt_launcher``: the same as the ``ckpt-coordinator`` console script."""

from . import main

raise SystemExit(main())
