"""pytest fixtures shared by the integration tests (see ztest.py)."""
import pytest

from ztest import Procs


@pytest.fixture
def procs(tmp_path, request):
    ps = Procs(tmp_path)
    yield ps
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        print(ps.dump())
    ps.close()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
