"""Every fault test that used a ledger database ends with the conservation check
(tests/accounting_check.py): the crashes these tests stage lose no prompt group unrecorded."""

from ..accounting_check import conservation_after_the_test  # noqa: F401 (an autouse fixture)
