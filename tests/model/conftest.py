"""The model tier runs in-process, as the unit tier does (a test that starts a Python program
belongs in tests/system)."""

from tests.unit.conftest import _in_process_only  # noqa: F401  (the autouse fixture)
