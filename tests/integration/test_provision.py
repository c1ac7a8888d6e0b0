"""The provisioner hook (zcoord --provisioner, coordinator/provision.c).

The provisioner here is a script that does what a site's does with its
scheduler, on this machine: `up N` starts N real zworker processes, `down
N NAME...` stops the named ones (SIGTERM: they leave). It logs every call,
so the tests see what zcoord asked for and when; a file next to it makes
it fail, hang, or close its output long before it exits.
"""
import glob
import os
import re
import signal
import stat
import time

import pytest

from ztest import (BIN, SRC, byte_dataset, events, http_get, job, job_members, start_fleet, submit,
                   tiny_spec, wait_job, wait_until, workers_by_name, zctl)

SCRIPT = r'''#!/usr/bin/env python3
import os, signal, subprocess, sys, time
here = os.path.dirname(os.path.abspath(__file__))
action, count, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
with open(os.path.join(here, "calls.log"), "a") as f:
    f.write(f"{time.time():.3f} {action} {count} {' '.join(names)} "
            f"env={os.environ['ZT_PROVISION_ACTION']},{os.environ['ZT_PROVISION_COUNT']},"
            f"{os.environ['ZT_PROVISION_WORKERS'] or '-'}\n")
if os.path.exists(os.path.join(here, "FAIL")):
    print("no capacity in the partition")
    sys.exit(3)
if os.path.exists(os.path.join(here, "HANG")):
    time.sleep(120)
if os.path.exists(os.path.join(here, "CLOSE")):
    # Its output ends well before it exits (a daemonizing helper does so).
    print("closing my output", flush=True)
    os.close(1), os.close(2)
    time.sleep(0.1)  # well inside the tests' 600 ms deadline with python's start
    sys.exit(0)
pids = os.path.join(here, "pids")
os.makedirs(pids, exist_ok=True)
if action == "up":
    for _ in range(count):
        n = len(os.listdir(pids))
        name = f"p{n}"
        wd = os.path.join(here, "work", name)
        os.makedirs(wd, exist_ok=True)
        log = open(os.path.join(here, f"{name}.log"), "ab")
        p = subprocess.Popen([os.environ["ZT_TEST_BIN"] + "/zworker", "--coordinator",
                              os.environ["ZT_COORDINATOR"], "--name", name, "--workdir", wd,
                              "--device", "cpu", "--threads", "1",
                              "--data-root", os.environ["ZT_TEST_ROOT"],
                              "--checkpoint-root", os.environ["ZT_TEST_ROOT"]],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             start_new_session=True)
        open(os.path.join(pids, name), "w").write(str(p.pid))
        print(f"started {name}")
elif action == "down":
    for name in names:
        try:
            os.kill(int(open(os.path.join(pids, name)).read()), signal.SIGTERM)
            print(f"stopped {name}")
        except (OSError, ValueError):
            print(f"no such worker {name}")
'''


@pytest.fixture
def prov(procs, tmp_path):
    d = tmp_path / "prov"
    d.mkdir()
    path = d / "provision"
    path.write_text(SCRIPT)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    os.environ["ZT_TEST_BIN"] = BIN
    os.environ["ZT_TEST_ROOT"] = procs.root
    yield d
    for f in glob.glob(str(d / "pids" / "*")):  # the workers the script started
        try:
            os.kill(int(open(f).read()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def calls(d):
    try:
        lines = (d / "calls.log").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [ln.split() for ln in lines]


def pid_of(d, name):
    return int((d / "pids" / name).read_text())


def coord_with(procs, prov, **kw):
    extra = ["--provisioner", str(prov / "provision")]
    for k, v in kw.items():
        extra += ["--provisioner-" + k.replace("_", "-"), str(v)]
    return procs.coord(hb_ms=300, timeout_ms=3000, extra=extra)


def test_provisioner_fills_a_job_replaces_a_lost_worker_and_gives_back_idle_ones(
        procs, prov, tmp_path):
    train, val = byte_dataset(str(tmp_path / "data"), limit=200_000)
    coord = start_fleet(procs, 1, coord=coord_with(procs, prov, interval_ms=300, grace_ms=20000,
                                                   timeout_ms=20000))
    # Long enough to outlast the test; canceled at the end.
    spec = tiny_spec(train, val, 10**6, stage=1, workers=1, max_workers=2,
                     checkpoint={"dir": str(tmp_path / "ck"), "every_steps": 50})
    jid = submit(coord, spec, tmp_path)
    # The job wants 2 and has 1: zcoord asks for one, which joins.
    wait_until(lambda: job(coord, jid)["world"] == 2 and "p0" in job_members(coord, jid), 60,
               "the provisioned worker p0 training")
    ups = [c for c in calls(prov) if c[1] == "up"]
    assert ups and ups[0][2] == "1" and ups[0][-1] == "env=up,1,-", calls(prov)
    assert any(e["kind"] == "provision" and e["detail"].startswith("up 1: done")
               for e in events(coord)), events(coord)
    # Asked once: the worker that came is not asked for again.
    time.sleep(1.5)  # several check ticks and provisioner intervals, to see no second call
    assert len([c for c in calls(prov) if c[1] == "up"]) == 1, calls(prov)
    # A node lost outright: zcoord asks for a replacement, which trains.
    t0 = time.monotonic()
    os.kill(pid_of(prov, "p0"), signal.SIGKILL)
    wait_until(lambda: job(coord, jid)["world"] == 2 and "p1" in job_members(coord, jid), 60,
               "a replacement worker p1 training")
    step = job(coord, jid)["step"]
    wait_until(lambda: job(coord, jid)["step"] > step, 30, "steps on the replacement")
    replaced_s = time.monotonic() - t0
    print(f"loss of a worker to its replacement training: {replaced_s:.1f} s "
          f"(heartbeat timeout 3 s)")
    assert len([c for c in calls(prov) if c[1] == "up"]) == 2, calls(prov)
    zctl(coord.grpc, "cancel", str(jid))
    wait_job(coord, jid, timeout=60, states=("canceled",))
    # Nothing wants the workers now: after an interval zcoord gives them back.
    wait_until(lambda: any(c[1] == "down" for c in calls(prov)), 30, "a down call")
    down = [c for c in calls(prov) if c[1] == "down"][0]
    assert down[2] == "2" and sorted(down[3:5]) == ["p1", "w0"], down
    wait_until(lambda: workers_by_name(coord)["p1"]["state"] == "left", 30, "p1 gone")
    # w0 was not the script's to stop, so it is still idle: not asked for
    # again within the grace (20 s), however many ticks pass.
    time.sleep(1.5)
    assert len([c for c in calls(prov) if c[1] == "down"]) == 1, calls(prov)


def test_a_failing_or_hanging_provisioner_is_backed_off_killed_and_reported(procs, prov, tmp_path):
    train, val = byte_dataset(str(tmp_path / "data"), limit=100_000)
    (prov / "FAIL").write_text("")
    # The deadline leaves a failing run (which exits at once on a quiet
    # machine) room on a busy one: only the hanging run may meet it.
    coord = start_fleet(procs, 1, coord=coord_with(procs, prov, interval_ms=200, timeout_ms=3000))
    t0 = time.time()
    # min_workers 2: the job waits, wanting one more worker than there is.
    jid = submit(coord, tiny_spec(train, val, 10, stage=0, workers=2), tmp_path)

    def failed():
        return [e for e in events(coord) if e["kind"] == "provision_failed"]
    wait_until(lambda: len(failed()) >= 3, 30, "three failed runs")
    e = failed()[0]["detail"]
    assert "exit status 3" in e and "no capacity in the partition" in e and "next try in" in e, e
    # Backed off: each failure says when the next try comes, doubling (400,
    # 800, 1600 ms ...), and the next run starts no sooner: never a storm.
    # (The gaps between run starts also hold each run's own time, which a
    # busy machine stretches by hundreds of ms: the failure's word is what
    # doubles.)
    waits = [int(re.search(r"next try in (\d+) ms", f["detail"]).group(1)) for f in failed()]
    assert all(b == 2 * a for a, b in zip(waits, waits[1:3])), waits
    times = [float(c[0]) for c in calls(prov) if float(c[0]) >= t0]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(g >= w / 1000 for g, w in zip(gaps, waits[:2])), (gaps, waits)
    # A run that hangs is killed at its deadline and reported.
    (prov / "FAIL").unlink()
    (prov / "HANG").write_text("")
    wait_until(lambda: any("killed after 3000 ms" in e["detail"] for e in failed()), 60,
               "a hung run killed")
    m = http_get(coord.http_port, "/metrics")[2]
    n = {r: int(next(ln.split()[-1] for ln in m.splitlines()
                     if ln.startswith(f'ztrain_provisioner_runs_total{{result="{r}"}}')))
         for r in ("ok", "failed", "timeout")}
    assert n["ok"] == 0 and n["failed"] >= 3 and n["timeout"] >= 1, n
    assert job(coord, jid)["state"] == "pending"
    # A run whose output ends before it exits: a run like any other.
    (prov / "HANG").unlink()
    (prov / "CLOSE").write_text("")
    wait_until(lambda: any(e["kind"] == "provision" and "closing my output" in e["detail"]
                           for e in events(coord)), 60, "a run that closed its output first")
    assert coord.alive()


def test_the_slurm_provisioner_submits_and_cancels_worker_jobs(tmp_path):
    """deploy/slurm/ztrain-provision against stand-ins for sbatch, squeue,
    scontrol and scancel that log their arguments (the real cluster is
    tests/multihost/test_slurm.py's): one-node jobs for the workers asked
    for, less the worker jobs already queued (so that a cluster with no
    free node is not asked again at every retry); a squeue that fails is a
    failure, not a guess; a Slurm worker's job is stopped with SIGTERM after
    marking it (so that zworker.sbatch does not requeue it); a name that is
    not a Slurm worker's is left alone."""
    import subprocess
    bindir = tmp_path / "bin"
    bindir.mkdir()
    queued = tmp_path / "queued"
    for tool, out in (("sbatch", "echo 4242"), ("scancel", "true"), ("scontrol", "true"),
                      ("squeue", f'[ -e "{queued}" ] || exit 1; cat "{queued}"')):
        p = bindir / tool
        p.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{tmp_path}/slurm.log"\n{out}\n')
        p.chmod(0o755)
    script = os.path.join(SRC, "deploy", "slurm", "ztrain-provision")
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "ZT_COORDINATOR": "10.0.0.1:7070",
           "ZTRAIN_SBATCH_ARGS": "--partition=gpu --gpus-per-node=8"}
    sb = os.path.join(os.path.dirname(script), "zworker.sbatch")
    submit = (f"sbatch --parsable -N 1 -J ztrain-workers --partition=gpu --gpus-per-node=8 "
              f"--export=ALL,ZTRAIN_COORDINATOR=10.0.0.1:7070 {sb}")
    import pwd
    squeue = f"squeue -h -u {pwd.getpwuid(os.getuid()).pw_name} -n ztrain-workers -t PENDING -o %i"

    def up(n, pending, **extra):
        queued.write_text("".join(f"{j}\n" for j in pending))
        (tmp_path / "slurm.log").write_text("")
        r = subprocess.run([script, "up", str(n)], env={**env, **extra}, capture_output=True,
                           text=True, timeout=30)
        return r, (tmp_path / "slurm.log").read_text().splitlines()

    r, log = up(2, [])
    assert r.returncode == 0 and r.stdout.split() == ["4242", "4242"], (r.stdout, r.stderr)
    assert log == [squeue, submit, submit], log
    r, log = up(2, [77])
    assert r.returncode == 0 and log == [squeue, submit], (r.stdout, log)
    r, log = up(1, [77, 78])
    assert r.returncode == 0 and log == [squeue], log
    assert "2 worker jobs queued already (77 78); none submitted" in r.stdout, r.stdout
    # Eight workers a job: nine workers are two jobs.
    r, log = up(9, [], ZTRAIN_WORKERS_PER_JOB="8")
    assert r.returncode == 0 and log == [squeue, submit, submit], log
    queued.unlink()
    (tmp_path / "slurm.log").write_text("")
    r = subprocess.run([script, "up", "1"], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "squeue failed" in r.stderr, (r.stdout, r.stderr)
    assert "sbatch" not in (tmp_path / "slurm.log").read_text()
    (tmp_path / "slurm.log").write_text("")
    r = subprocess.run([script, "down", "3", "slurm-123-0", "slurm-456-3", "w0"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "w0 is not a Slurm worker" in r.stdout, r.stdout
    log = (tmp_path / "slurm.log").read_text().splitlines()
    assert log == [
        "scontrol update JobId=123 Comment=ztrain-down", "scancel --signal=TERM 123",
        "scontrol update JobId=456 Comment=ztrain-down", "scancel --signal=TERM 456"], log
    r = subprocess.run([script, "sideways", "1"], env=env, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "usage" in r.stderr
