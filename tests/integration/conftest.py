"""pytest fixtures shared by the integration tests (see ztest.py)."""
import pytest

from ztest import Procs, closing_with_logs, makereport_hook


@pytest.fixture
def procs(tmp_path, request):
    ps = Procs(tmp_path)
    yield ps
    closing_with_logs(request, ps)


pytest_runtest_makereport = makereport_hook()
