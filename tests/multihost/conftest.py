"""pytest fixtures of the multi-host tests (see mhnet.py and mhfleet.py)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))

from mhnet import Net, available  # noqa: E402
from ztest import closing_with_logs, makereport_hook  # noqa: E402


@pytest.fixture
def net(tmp_path, request):
    why = available()
    if why:
        pytest.skip(f"multi-host tests need network namespaces: {why}")
    n = Net(str(tmp_path))
    yield n
    closing_with_logs(request, n)


pytest_runtest_makereport = makereport_hook()


def pytest_sessionfinish(session, exitstatus):
    """All skipped (no namespaces here): exit 77, which ctest reports as a
    skip rather than a pass."""
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = tr.stats if tr else {}
    if stats.get("skipped") and not stats.get("passed") and not stats.get("failed"):
        session.exitstatus = 77
