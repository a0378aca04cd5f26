"""Every e2e test that used a ledger database ends with the conservation check
(tests/accounting_check.py): the crashes these tests stage lose no prompt group unrecorded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..accounting_check import assert_conserved


@pytest.fixture(autouse=True)
def _conservation_after_the_test(request: pytest.FixtureRequest) -> Iterator[None]:
    url = request.getfixturevalue("database_url") if "database_url" in request.fixturenames else None
    yield
    if url is not None:
        assert_conserved(url)
