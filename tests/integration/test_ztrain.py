"""ztrain, the local launcher: the dashboard URL it prints, its progress on
a terminal (one line rewritten in place, with an ETA; through a pty) and
elsewhere (one plain line per step seen), --serve (the coordinator and the
dashboard stay up after the job until SIGINT; the workers stop), an HTTP
port already in use (one line naming the port, nothing left running), a
fork() that fails (one line, only what ztrain started is stopped) and a
zcoord or the workers exiting while the job runs (one line, exit 1), and
a spec, data and checkpoints outside the working directory (the roots come
from the spec's paths, or --data-root and --checkpoint-root)."""
import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from ztest import (BIN, SLOW, TINY_LLAMA, byte_dataset, http_get, tiny_spec, wait_until,
                   write_hf_llama)

import pytest


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("ztrain")
    train, val = byte_dataset(str(d / "data"), 150_000)
    return d, train, val


def write_spec(d, name, spec):
    path = os.path.join(str(d), name)
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


def ztrain_argv(spec, run_dir, *extra):
    return [f"{BIN}/ztrain", spec, "--dir", str(run_dir), "--threads", "1", *extra]


def running_under(path):
    """Processes whose command line names path (what a launch left)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in cmd and int(pid) != os.getpid():
            found.append(f"{pid}: {cmd}")
    return found


def read_until(fd, pred, timeout, buf=b""):
    """Reads fd until pred(bytes so far) or its end; fails at the deadline."""
    deadline = time.monotonic() + timeout * SLOW
    while not pred(buf):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"timed out; output so far: {buf[-3000:]!r}")
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # a pty's reader gets EIO once the writer is gone
            chunk = b""
        if not chunk:
            return buf
        buf += chunk
    return buf


def test_progress_on_a_terminal_is_one_line(data):
    d, train, val = data
    spec = write_spec(d, "tty.json", tiny_spec(train, val, 300, workers=1))
    master, slave = pty.openpty()
    p = subprocess.Popen(ztrain_argv(spec, d / "run-tty", "--workers", "1", "--http-port", "0"),
                         cwd=str(d), stdin=subprocess.DEVNULL, stdout=slave,
                         stderr=subprocess.STDOUT)
    os.close(slave)
    try:
        out = read_until(master, lambda b: False, 120).decode(errors="replace")
        assert p.wait(timeout=30 * SLOW) == 0, out
    finally:
        os.close(master)
        if p.poll() is None:
            p.kill()
            p.wait()
    assert re.search(r"ztrain: dashboard at http://127\.0\.0\.1:\d+/\r\n", out), out
    # The progress: carriage return, the line, clear to the end of the line;
    # no newline until the job ends.
    first = out.index("\rstep ")
    end = out.index("ztrain: job 1 completed")
    progress = out[first:end]
    assert "\n" not in progress.rstrip("\r\n"), repr(progress[-500:])
    updates = re.findall(r"\rstep (\d+)/300  loss [\d.]+  \d+ tok/s  ETA (\S+)  gen 1  world 1"
                         r"\x1b\[K", progress)
    assert updates and int(updates[-1][0]) == 300, repr(progress[-500:])
    assert any(re.fullmatch(r"\d+s|\d+m\d\ds", eta) for _, eta in updates), updates
    assert not re.search(r"step +\d+/300  loss [\d.]+  lr", out)  # not the plain format


def test_plain_lines_and_serve_until_interrupted(data):
    d, train, val = data
    run = d / "run-serve"
    spec = write_spec(d, "serve.json", tiny_spec(train, val, 40, workers=2))
    p = subprocess.Popen(ztrain_argv(spec, run, "--workers", "2", "--http-port", "0", "--serve"),
                         cwd=str(d), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        out = read_until(p.stdout.fileno(), lambda b: b"until Ctrl-C\n" in b, 120)
        out = out.decode()
        url = re.search(r"ztrain: dashboard at (http://127\.0\.0\.1:(\d+)/)\n", out)
        assert url, out
        port = int(url.group(2))
        # Not a terminal: one plain line per step seen, as scripts parse them.
        assert "\r" not in out and "\x1b" not in out
        steps = re.findall(r"^step +(\d+)/40  loss [\d.]+  lr \S+ +\d+ tok/s  gen 1  world 2$",
                           out, re.M)
        assert steps and steps[-1] == "40", out
        assert "ztrain: job 1 completed" in out
        assert f"serving the dashboard at {url.group(1)} until Ctrl-C" in out
        # The job is over, the workers have left; the dashboard still answers.
        code, _, jobs = http_get(port, "/v1/jobs")
        assert code == 200 and [j["state"] for j in jobs["jobs"]] == ["completed"]
        assert {w["state"] for w in http_get(port, "/v1/workers")[2]["workers"]} == {"left"}
        code, ctype, page = http_get(port, "/")
        assert code == 200 and ctype.startswith("text/html") and "job-picker" in page
        assert p.poll() is None
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=30 * SLOW) == 0, p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert not running_under(run)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)


def test_http_port_in_use_is_one_line_and_starts_nothing(data):
    d, train, val = data
    run = d / "run-busy"
    spec = write_spec(d, "busy.json", tiny_spec(train, val, 10, workers=1))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = subprocess.run(ztrain_argv(spec, run, "--http-port", str(port), "--serve"),
                           cwd=str(d), capture_output=True, text=True, timeout=30 * SLOW)
        assert r.returncode == 1, (r.stdout, r.stderr)
        err = r.stderr.strip()
        assert "\n" not in err and f"HTTP port {port} is already in use" in err, err
        assert "--http-port" in err and r.stdout == ""
        assert not running_under(run) and not os.path.exists(run / "zcoord.log")
        # zcoord itself, given the port, fails at once and says which port.
        r = subprocess.run([f"{BIN}/zcoord", "--grpc", "127.0.0.1:0", "--http",
                            f"127.0.0.1:{port}", "--db", str(d / "busy.db")],
                           cwd=str(d), capture_output=True, text=True, timeout=30 * SLOW)
        assert r.returncode == 1
        assert f"cannot start: HTTP port {port} is already in use" in r.stderr, r.stderr


def test_zcoord_failure_is_relayed(procs, data):
    """zcoord refuses to start (its database is held by another zcoord):
    ztrain says why in one line and leaves nothing running."""
    d, train, val = data
    run = d / "run-locked"
    os.makedirs(run, exist_ok=True)
    holder = procs.coord(db=str(run / "zcoord.db"))
    spec = write_spec(d, "locked.json", tiny_spec(train, val, 10, workers=1))
    r = subprocess.run(ztrain_argv(spec, run, "--http-port", "0"), cwd=str(d),
                       capture_output=True, text=True, timeout=30 * SLOW)
    assert r.returncode == 1, (r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "\n" not in err, err
    assert "zcoord did not start: zcoord: cannot start:" in err, err
    assert f"in use by another zcoord (pid {holder.pid}" in err, err
    assert [x for x in running_under(run) if str(holder.pid) != x.split(":")[0]] == []


def test_numeric_options_are_checked(data):
    """--workers and --threads take a whole decimal number in range; a value
    with trailing text ("1x") is a usage error naming the option, and
    nothing starts."""
    d, train, val = data
    run = d / "run-usage"
    spec = write_spec(d, "usage.json", tiny_spec(train, val, 5, workers=1))
    for args, opt in ((["--workers", "1x"], "--workers"), (["--workers", "0"], "--workers"),
                      (["--workers", "65"], "--workers"), (["--threads", "1x"], "--threads"),
                      (["--threads", "-1"], "--threads"), (["--http-port", "0x"], "--http-port")):
        r = subprocess.run([f"{BIN}/ztrain", spec, "--dir", str(run), "--http-port", "0", *args],
                           cwd=str(d), capture_output=True, text=True, timeout=60 * SLOW)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert f"ztrain: {opt}: expected an integer in" in r.stderr, (args, r.stderr)
        assert r.stdout == "" and not os.path.exists(run), (args, r.stdout)


def children_of(pid):
    """The live child processes of pid: {pid: command line}."""
    found = {}
    for c in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{c}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{c}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found[int(c)] = cmd
    return found


@pytest.mark.parametrize("victim", ["zcoord", "zworker"])
def test_zcoord_or_workers_exiting_ends_the_launch(data, victim):
    """zcoord (or the only worker) is killed while the job runs: ztrain
    says so in one line and exits 1, instead of polling a dead coordinator
    or waiting for workers that will never come back."""
    d, train, val = data
    run = d / f"run-{victim}-dies"
    spec = write_spec(d, f"{victim}-dies.json", tiny_spec(train, val, 100_000, workers=1))
    p = subprocess.Popen(ztrain_argv(spec, run, "--workers", "1", "--http-port", "0"),
                         cwd=str(d), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    kids = {}
    try:
        out = read_until(p.stdout.fileno(), lambda b: re.search(rb"^step +\d+/", b, re.M), 60)
        assert p.poll() is None, (out, p.stderr.read())
        kids = children_of(p.pid)
        names = {pid: os.path.basename(cmd.split()[0]) for pid, cmd in kids.items()}
        assert sorted(names.values()) == ["zcoord", "zworker"], kids
        os.kill(next(pid for pid, n in names.items() if n == victim), signal.SIGKILL)
        rc = p.wait(timeout=30 * SLOW)
        err = p.stderr.read().strip()
    finally:
        for pid in [p.pid, *kids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        p.wait()
    assert rc == 1, err
    assert "\n" not in err, err
    if victim == "zcoord":
        assert "job 1: zcoord exited (killed by signal 9) while the job ran: see " in err, err
        assert str(run / "zcoord.log") in err, err
    else:
        assert ("job 1: all 1 workers exited while the job ran (the last, local-0: killed by "
                "signal 9); see ") in err, err
    assert not running_under(run)


# An LD_PRELOAD library whose fork() fails with EAGAIN from call N on
# (ZT_FORK_FAIL_FROM); it takes itself out of the environment, so that the
# children ztrain starts run without it.
FORK_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

static int calls, fail_from;

__attribute__((constructor)) static void init(void) {
  const char *s = getenv("ZT_FORK_FAIL_FROM");
  fail_from = s ? atoi(s) : 0;
  unsetenv("LD_PRELOAD");
  unsetenv("ZT_FORK_FAIL_FROM");
}

pid_t fork(void) {
  static pid_t (*real)(void);
  if (!real) real = (pid_t(*)(void))dlsym(RTLD_NEXT, "fork");
  if (fail_from && ++calls >= fail_from) {
    errno = EAGAIN;
    return -1;
  }
  return real();
}
"""

# Runs inside a new PID namespace as its process 1: starts a sentinel
# process, then ztrain under the shim, and reports what became of both. A
# kill(-1, ...) from ztrain reaches only this namespace (and not process 1):
# the sentinel, never the test's own processes.
IN_NAMESPACE = r"""
import json, os, subprocess, sys
shim, fail_from, run, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
sentinel = subprocess.Popen(["sleep", "300"])
env = dict(os.environ, LD_PRELOAD=shim, ZT_FORK_FAIL_FROM=fail_from)
# A sanitizer build's runtime would refuse to come after the shim.
asan = env.get("ASAN_OPTIONS")
env["ASAN_OPTIONS"] = (asan + ":" if asan else "") + "verify_asan_link_order=0"
r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
left = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        continue
    if run in cmd and int(pid) != os.getpid():
        left.append(cmd)
print(json.dumps({"rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr,
                  "sentinel_alive": sentinel.poll() is None, "left": left}))
"""


def pid_namespace_or_skip():
    unshare = shutil.which("unshare")
    if not unshare:
        pytest.skip("no unshare(1): a fork failure is only tested inside a PID namespace")
    r = subprocess.run([unshare, "--pid", "--fork", "--kill-child", "--mount-proc", "true"],
                       capture_output=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {r.stderr.decode(errors='replace')}")
    return unshare


@pytest.mark.parametrize("fail_from,reason", [
    (1, "cannot start zcoord: Resource temporarily unavailable"),
    (3, "cannot start worker 1: Resource temporarily unavailable"),
])
def test_fork_failure_stops_only_what_was_started(data, tmp_path, fail_from, reason):
    """fork() fails for zcoord (call 1) or for the second worker (call 3):
    ztrain names the process it could not start and exits 1, having
    stopped the processes it did start, and signals nothing else (a failed
    fork's -1 taken for a pid would make kill() reach every process)."""
    unshare = pid_namespace_or_skip()
    d, train, val = data
    run = d / f"run-fork-{fail_from}"
    spec = write_spec(d, f"fork-{fail_from}.json", tiny_spec(train, val, 10, workers=1))
    (tmp_path / "shim.c").write_text(FORK_SHIM)
    shim = tmp_path / "shim.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "shim.c"), "-ldl"],
                   check=True, timeout=60)
    r = subprocess.run([unshare, "--pid", "--fork", "--kill-child", "--mount-proc",
                        sys.executable, "-c", IN_NAMESPACE, str(shim), str(fail_from), str(run),
                        *ztrain_argv(spec, run, "--workers", "2", "--http-port", "0")],
                       cwd=str(d), capture_output=True, text=True, timeout=150 * SLOW)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["sentinel_alive"], out
    assert out["rc"] == 1, out
    err = out["stderr"].strip()
    assert "\n" not in err and reason in err, out
    assert "submitted" not in out["stdout"], out
    assert out["left"] == [], out


def test_spec_and_data_outside_the_working_directory(tmp_path):
    """The launcher runs the user's own spec: data, checkpoints and the spec
    itself may lie outside the working directory (here: an empty one). The
    roots come from the spec's paths, relative ones (with "..") taken from
    the working directory and a shard that is a symbolic link into another
    directory included; the job trains to completion and its checkpoints
    land where the spec says. --data-root and --checkpoint-root override the
    roots, and zcoord still confines the paths to them."""
    base = tmp_path.resolve()
    train, val = byte_dataset(str(base / "elsewhere" / "data"), 60_000)
    other = base / "other"
    other.mkdir()
    shard = base / "elsewhere" / "data" / "train_000001.bin"
    shutil.move(str(shard), str(other / "moved.bin"))
    os.symlink(other / "moved.bin", shard)
    work = base / "work"
    work.mkdir()
    (base / "runs").mkdir()
    spec = tiny_spec(train, "../elsewhere/data/val_*.bin", 12, workers=1,
                     checkpoint={"dir": str(base / "ckpts" / "my-run"), "every_steps": 6})
    path = write_spec(base / "runs", "my.json", spec)
    r = subprocess.run([f"{BIN}/ztrain", path, "--workers", "1", "--threads", "1",
                        "--http-port", "0"], cwd=str(work), capture_output=True, text=True,
                       timeout=120 * SLOW)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "ztrain: job 1 completed" in r.stdout, r.stdout
    assert sorted(os.listdir(base / "ckpts" / "my-run" / "job_1")) == \
        ["step_00000006-g1", "step_00000012-g1"]
    assert os.listdir(work) == ["ztrain-run"]  # only the launcher's own directory
    # A root given on the command line is used as given: the data are
    # outside this one, and zcoord says so.
    r = subprocess.run([f"{BIN}/ztrain", path, "--workers", "1", "--http-port", "0",
                        "--data-root", str(work), "--dir", str(base / "run-2")], cwd=str(work),
                       capture_output=True, text=True, timeout=60 * SLOW)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"data.train: {train} is outside the allowed root {work}" in r.stderr, r.stderr
    r = subprocess.run([f"{BIN}/ztrain", path, "--checkpoint-root", str(base / "nowhere")],
                       cwd=str(work), capture_output=True, text=True, timeout=60 * SLOW)
    assert r.returncode == 2 and f"--checkpoint-root {base / 'nowhere'}" in r.stderr, r.stderr


def test_pretrained_path_workers_and_pauses(tmp_path):
    """The launcher as a new user meets it: a spec whose init.from_pretrained
    is relative to the working directory (the data elsewhere) trains, since
    the model directory is under the daemons' data root like any data path;
    a spec without an elastic section runs on all --workers (and says so),
    with the usable cores shared among them; and a job that pauses for a
    cause only an operator can fix (a training shard that is not one) is
    printed at once with its reason and ends ztrain with status 1 (a model
    directory that is not there is refused at submit)."""
    base = tmp_path.resolve()
    train, val = byte_dataset(str(base / "data"), 60_000)
    work = base / "work"
    write_hf_llama(str(work / "models" / "tiny"))
    spec = tiny_spec(train, val, 6, workers=2)
    spec["model"] = {"seq_len": TINY_LLAMA["seq_len"]}  # the rest from config.json
    del spec["elastic"]
    spec["init"] = {"from_pretrained": "models/tiny"}
    path = write_spec(base, "p.json", spec)
    r = subprocess.run([f"{BIN}/ztrain", path, "--workers", "2", "--http-port", "0",
                        "--dir", str(base / "run")], cwd=str(work), capture_output=True,
                       text=True, timeout=120 * SLOW)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "has no elastic section: the job runs on the 2 workers" in r.stdout, r.stdout
    steps = [ln for ln in r.stdout.splitlines() if ln.startswith("step")]
    assert steps and all(ln.endswith("world 2") for ln in steps), r.stdout
    m = re.search(r"with 2 workers, (\d+) compute threads? each \((\d+) usable cores", r.stdout)
    assert m, r.stdout
    threads, cores = int(m.group(1)), int(m.group(2))
    assert threads == max(1, cores // 2) and cores <= len(os.sched_getaffinity(0)), m.group(0)
    # A model directory that is not there is refused at submit, naming it.
    spec["init"] = {"from_pretrained": "models/missing"}
    path = write_spec(base, "m.json", spec)
    r = subprocess.run([f"{BIN}/ztrain", path, "--workers", "1", "--http-port", "0",
                        "--dir", str(base / "run-m")], cwd=str(work), capture_output=True,
                       text=True, timeout=60 * SLOW)
    assert r.returncode == 1 and "models/missing/config.json" in r.stderr, (r.stdout, r.stderr)
    # A training shard that is not one: each rank fails the same way at
    # the same step, twice, and the job pauses for an operator.
    (base / "bad" / "train_000000.bin").mkdir(parents=True)
    spec["data"]["train"] = str(base / "bad" / "train_*.bin")
    spec["init"] = {"from_pretrained": "models/tiny"}
    path = write_spec(base, "q.json", spec)
    t0 = time.monotonic()
    r = subprocess.run([f"{BIN}/ztrain", path, "--workers", "2", "--http-port", "0",
                        "--dir", str(base / "run-2")], cwd=str(work), capture_output=True,
                       text=True, timeout=120 * SLOW)
    assert r.returncode == 1, (r.stdout, r.stderr)
    paused = [ln for ln in r.stdout.splitlines() if ln.startswith("ztrain: job 1 paused: ")]
    assert len(paused) == 1 and "train_000000.bin" in paused[0], r.stdout
    assert "cannot go on without an operator" in r.stdout, r.stdout
    assert time.monotonic() - t0 < 90 * SLOW


def test_workers_warn_when_their_threads_exceed_the_cores(procs, tmp_path):
    """Two CPU workers held to one core (affinity: taskset; and, where this
    machine lets a test make a cgroup, a CPU quota of one core) with a
    compute thread each: one of them warns that the machine's workers run
    more compute threads than it may use. Workers of other tests on this
    machine add to the count, never take from it."""
    coord = procs.coord()
    holds = [("affinity", ["taskset", "-c", str(min(os.sched_getaffinity(0)))])]
    cg = None
    for mount in ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"):
        d = os.path.join(mount, f"zt-test-{os.getpid()}")
        try:
            os.mkdir(d)
            with open(os.path.join(d, "cpu.cfs_quota_us"), "w") as f:
                f.write("100000")
            with open(os.path.join(d, "cpu.cfs_period_us"), "w") as f:
                f.write("100000")
        except OSError:
            if os.path.isdir(d):
                os.rmdir(d)
            continue
        cg = d
        holds.append(("quota", ["sh", "-c", f'echo $$ > {d}/cgroup.procs && exec "$0" "$@"']))
        break
    try:
        for kind, wrap in holds:
            ws = []
            for i in range(2):
                wd = str(tmp_path / f"{kind}{i}")
                argv = wrap + [f"{BIN}/zworker", "--coordinator", coord.grpc, "--name",
                               f"{kind}{i}", "--workdir", wd, "--device", "cpu",
                               "--threads", "1", "--data-root", procs.root,
                               "--checkpoint-root", procs.root]
                ws.append(procs.start(f"{kind}{i}", argv))
            pat = re.compile(r"the (\d+) CPU workers on this machine run (\d+) compute threads "
                             r"on 1 usable cores")
            found = wait_until(lambda: [m for w in ws for m in pat.findall(w.output())], 20 * SLOW,
                               f"the warning under {kind}")
            assert all(int(n) >= 2 and int(t) >= 2 for n, t in found), (kind, found)
            for w in ws:
                w.kill()
    finally:
        if cg:
            wait_until(lambda: not open(os.path.join(cg, "cgroup.procs")).read().strip(), 10,
                       "the cgroup emptied")
            os.rmdir(cg)
