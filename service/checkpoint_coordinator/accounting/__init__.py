"""Accounting (docs/accounting.md): every prompt group and every rollout-second of a run, read
from the ledger and from what its restores recorded."""
