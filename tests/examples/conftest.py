"""The examples run against a live coordinator on a loopback port (the client suite's)."""

from tests.client.conftest import coordinator  # noqa: F401  (a fixture)
