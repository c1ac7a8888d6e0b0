"""systemd integration: sd_notify over a real datagram socket, and the unit
files under deploy/ pass `systemd-analyze verify`."""
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

from ztest import BIN, SLOW, SRC


def recv_until(sock, want, timeout):
    """Collects datagrams until one contains `want`; returns all of them."""
    got = []
    deadline = time.monotonic() + timeout * SLOW
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            msg = sock.recv(4096).decode()
        except socket.timeout:
            break
        got.append(msg)
        if want in msg:
            return got
    raise AssertionError(f"no {want!r} in {got}")


def test_sd_notify_ready_watchdog_stopping(procs, tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    try:
        coord = procs.coord(hb_ms=200, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})
        msgs = recv_until(sock, "READY=1", 10)
        ready = [m for m in msgs if "READY=1" in m][0]
        assert f"MAINPID={coord.pid}" in ready and "STATUS=serving gRPC" in ready
        # WATCHDOG=1 at half the 200 ms period: several within a second.
        t0 = time.monotonic()
        for _ in range(3):
            recv_until(sock, "WATCHDOG=1", 2)
        if SLOW == 1:
            assert time.monotonic() - t0 < 1.0
        coord.signal(signal.SIGTERM)
        recv_until(sock, "STOPPING=1", 5)
        assert coord.wait(10) == 0
    finally:
        sock.close()


def test_no_notify_socket_is_fine(procs):
    coord = procs.coord(hb_ms=200, env={"NOTIFY_SOCKET": ""})
    coord.signal(signal.SIGINT)
    assert coord.wait(10) == 0
    assert "stopped" in coord.output()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_units_verify(tmp_path):
    # The units name /usr/local/bin binaries; verify wants them to exist, so
    # point copies at the build tree.
    for unit in ("zcoord.service", "zworker@.service"):
        text = open(os.path.join(SRC, "deploy", unit)).read()
        text = text.replace("/usr/local/bin/", BIN + "/")
        (tmp_path / unit).write_text(text)
    inst = tmp_path / "zworker@0.service"
    os.symlink(tmp_path / "zworker@.service", inst)
    r = subprocess.run(["systemd-analyze", "verify", "--man=no",
                        str(tmp_path / "zcoord.service"), str(inst)],
                       capture_output=True, text=True, timeout=60)
    problems = [l for l in (r.stdout + r.stderr).splitlines()
                if "zcoord" in l or "zworker" in l]
    assert r.returncode == 0 and not problems, r.stdout + r.stderr
