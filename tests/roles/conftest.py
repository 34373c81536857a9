"""tests/roles: no run a test started outlives the test."""
import pytest

from tests.roles import fault_runs


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test():
    """However a test ends (a failed assertion, its timeout), the runs it started through fault_runs.Logged end with
    it (fault_runs.end_started_runs)."""
    yield
    fault_runs.end_started_runs()
