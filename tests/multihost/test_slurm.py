"""ztrain under a real Slurm cluster (Debian's slurm-wlm and munge).

slurmctld runs on its own host (network namespace), slurmd on three node
hosts, one munged serves them all (its socket is a file, which every
namespace sees); the munge key and slurm.conf are made here. zcoord runs on
its own host with deploy/slurm/ztrain-provision as its provisioner, and
every zworker is started by Slurm from deploy/slurm/zworker.sbatch, as
docs/deploy.md says. The coordinator's directory stands for the cluster's
shared file system: the data and the checkpoints are there (the job says
"checkpoint": {"shared": true}).

slurmd needs a cgroup file system where it looks (/sys/fs/cgroup): inside
its namespace's own mount namespace (ip netns exec makes one) it gets an
empty tmpfs there, with proctrack/linuxproc and task/none, so nothing is
mounted outside the test.
"""
import json
import os
import re
import shutil
import sqlite3
import signal
import subprocess
import time

import pytest

from mhfleet import SECRET, Fleet
from ztest import BIN, SLOW, SRC, Proc, byte_dataset, tiny_spec, wait_until

SBATCH = os.path.join(SRC, "deploy", "slurm", "zworker.sbatch")
PROVISION = os.path.join(SRC, "deploy", "slurm", "ztrain-provision")


class Cluster:
    def __init__(self, net, nodes):
        self.net, self.root = net, os.path.join(net.root, "slurm")
        os.makedirs(self.root)
        self.ctl = net.add_host("s")
        self.nodes = [net.add_host(n) for n in nodes]
        key = os.path.join(self.root, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.sock = os.path.join(self.root, "munge.sock")
        # munged in the test's own namespace: its socket is a file, which
        # every host's namespace sees.
        self.munged = Proc("munged", [
            "munged", "--foreground", "--force", "--key-file", key, "--socket", self.sock,
            "--pid-file", os.path.join(self.root, "munged.pid"),
            "--seed-file", os.path.join(self.root, "munge.seed")], net.root)
        net.procs.append(self.munged)
        wait_until(lambda: os.path.exists(self.sock), 10, "munged socket")
        self.conf = os.path.join(self.root, "slurm.conf")
        self.write_conf()
        self.env = {"SLURM_CONF": self.conf}
        self.slurmctld = self.ctl.run("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf],
                                      env=self.env)
        self.slurmd = {}
        for h in self.nodes:
            self.start_slurmd(h)
        try:
            wait_until(lambda: self.states().count("idle") == len(nodes), 60,
                       "slurm nodes idle")
        except AssertionError as e:
            why = "\n".join(f"{p.name}: {p.output()[-1500:]}"
                            for p in [self.slurmctld, *self.slurmd.values()])
            self.close()
            raise AssertionError(f"the Slurm cluster did not start ({e}):\n{why}") from None

    def write_conf(self):
        r = self.root
        for d in ("state", *(f"spool/{h.name}" for h in self.nodes)):
            os.makedirs(os.path.join(r, d), exist_ok=True)
        with open(os.path.join(r, "cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nCgroupAutomount=no\n")
        nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.addr} CPUs=1 RealMemory=1000"
                          for h in self.nodes)
        names = ",".join(h.name for h in self.nodes)
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=zt
SlurmctldHost={os.uname().nodename}({self.ctl.addr})
AuthType=auth/munge
AuthInfo=socket={self.sock},cred_expire=10
CryptoType=crypto/munge
SlurmUser=root
SlurmdUser=root
MailProg=/bin/true
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/linear
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
ReturnToService=2
SlurmdParameters=config_overrides
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldTimeout=10
SlurmdTimeout=5
KillWait=5
{nodes}
PartitionName=low Nodes={names} Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=30 MaxTime=INFINITE State=UP
PartitionName=high Nodes={names} PriorityTier=2 PreemptMode=OFF MaxTime=INFINITE State=UP
""")

    def start_slurmd(self, h):
        self.slurmd[h.name] = h.run("slurmd", [
            "sh", "-c", "mount -t tmpfs none /sys/fs/cgroup && exec slurmd -D -N $0 -f $1",
            h.name, self.conf], env=self.env)

    @staticmethod
    def kill_all(h):
        """Every process in the host's namespace at once."""
        out = subprocess.run(["ip", "netns", "pids", h.ns], capture_output=True, text=True)
        for pid in out.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass

    def kill_node(self, h):
        """A machine that vanished: its slurmd, the job's slurmstepd and
        zworkers, all at once."""
        self.kill_all(h)
        self.slurmd[h.name].kill()

    def close(self):
        """Slurm's jobs start processes this test did not (slurmstepd, the
        batch shells, the zworkers): whatever runs in the cluster's
        namespaces goes."""
        for h in self.nodes + [self.ctl]:
            self.kill_all(h)

    def cmd(self, *argv, env=None, check=True):
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=60,
                           env={**os.environ, **self.env, **(env or {})})
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: {r.stderr}")
        return r.stdout

    def states(self):
        """Each node's state (sinfo lists a node once per partition)."""
        out = self.cmd("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return list(dict(ln.split()[:2] for ln in out.splitlines() if len(ln.split()) >= 2)
                    .values())

    def jobs(self):
        """{job id: (state, nodes, partition)} of squeue."""
        out = self.cmd("squeue", "-h", "-o", "%i %T %N %P", check=False)
        return {ln.split()[0]: tuple(ln.split()[1:] + [""] * 3)[:3] for ln in out.splitlines()}


@pytest.fixture
def cluster(net):
    for tool in ("slurmctld", "slurmd", "munged", "sbatch"):
        if not shutil.which(tool):
            raise AssertionError(f"{tool} is not installed: deploy/install-deps.sh installs "
                                 "slurm-wlm and munge")
    c = Cluster(net, ["h1", "h2", "h3"])
    yield c
    c.close()


def committed(fleet, jid):
    return [c["step"] for c in json.loads(fleet.zctl("--json", "checkpoints", str(jid)).stdout)
            ["checkpoints"] if c["state"] == "committed"]


def launcher_losses(spec, d, steps):
    """The same job under ztrain, the local launcher, on one worker (results
    do not depend on the world size): its loss at every step."""
    path = os.path.join(d, "ref.json")
    with open(path, "w") as f:
        json.dump(dict(spec, steps=steps), f)
    r = subprocess.run([f"{BIN}/ztrain", path, "--workers", "1", "--threads", "1", "--dir",
                        os.path.join(d, "ref"), "--http-port", "0", "--quiet", "--data-root", d,
                        "--checkpoint-root", d],
                       capture_output=True, text=True, timeout=300 * SLOW, cwd=d)
    assert r.returncode == 0, r.stderr[-3000:]
    return db_losses(os.path.join(d, "ref", "zcoord.db"), 1)


def db_losses(path, jid):
    """Each step's loss as the coordinator stored it (as a double: the API's
    JSON prints fewer digits)."""
    with sqlite3.connect(path) as db:
        return dict(db.execute("SELECT step, loss FROM steps WHERE job_id = ?", (jid,)))


def test_slurm_workers_train_drain_on_preemption_and_are_replaced(net, cluster, tmp_path,
                                                                 monkeypatch):
    """zcoord's provisioner (deploy/slurm/ztrain-provision) asks Slurm for
    the job's two workers (zworker.sbatch). A higher-priority job preempts
    one (REQUEUE, GraceTime): it drains at a step boundary (0 steps lost),
    the job goes on, and the requeued Slurm job brings the same worker back
    into the job. A node lost outright (its slurmd and zworker killed)
    costs only the steps since the last checkpoint, and the provisioner
    replaces it through sbatch on the free node. The losses equal the same
    job's under ztrain's launcher, step for step."""
    byte_dataset(str(tmp_path / "data"), limit=200_000)
    # The cluster's settings, as a site's profile would have them: what
    # sbatch passes on to the workers (--export=ALL). The coordinator's
    # directory is the shared file system.
    shared = os.path.join(net.root, "c")
    wenv = {"SLURM_CONF": cluster.conf, "ZTRAIN_WORKER_SECRET": SECRET,
            "ZTRAIN_DEVICE": "cpu", "ZTRAIN_DATA_ROOT": shared, "ZTRAIN_CHECKPOINT_ROOT": shared,
            "ZTRAIN_WORKDIR": os.path.join(cluster.root, "work"),
            "ZTRAIN_ZWORKER_ARGS": "--threads 1",
            "ZTRAIN_DRAIN_TIMEOUT_MS": "20000", "ZWORKER": f"{BIN}/zworker",
            "ZTRAIN_SBATCH_ARGS": f"--chdir={cluster.root} -p low"}
    for k, v in wenv.items():
        monkeypatch.setenv(k, v)
    fleet = Fleet(net, str(tmp_path / "data"), coord_extra=[
        "--provisioner", PROVISION, "--provisioner-interval-ms", "2000",
        "--provisioner-grace-ms", "60000", "--provisioner-timeout-ms", "30000"])
    assert fleet.coord_host.dir == shared
    shutil.copytree(str(tmp_path / "data"), os.path.join(shared, "data"))
    every = 50
    spec = tiny_spec("data/train_*.bin", "data/val_*.bin", 10**6, stage=1, workers=1,
                     max_workers=2, checkpoint={"dir": "ckpt", "every_steps": every, "shared": True})
    spec["comm"] = {"timeout_ms": 5000}
    jid = fleet.submit(spec, str(tmp_path / "job.json"))

    def members(state="alive"):
        return {n: w for n, w in fleet.workers_by_name().items() if w["state"] == state}
    # Two "up" jobs from the provisioner, on two of the three nodes; the
    # job training on both (steps of the two-worker generation).
    j = wait_until(lambda: (lambda j: j if j["world"] == 2 else None)(fleet.job(jid)), 120,
                   "the job on two workers that Slurm started")
    wait_until(lambda: fleet.job(jid)["generation"] == j["generation"] and
               fleet.job(jid)["step"] >= j["step"] + 30, 60, "training on both")
    ws = members()
    assert len(ws) == 2 and all(n.startswith("slurm-") for n in ws), ws
    # Preemption: a high-priority job wants one worker's node. Slurm sends
    # SIGTERM (GraceTime): the worker leaves after a checkpoint at a step
    # boundary; zworker.sbatch requeues its job.
    vname, victim = sorted(ws.items())[0]
    cluster.cmd("sbatch", "-p", "high", "-N", "1", "-w", victim["host"], "--wrap", "sleep 3",
                f"--chdir={cluster.root}")
    wait_until(lambda: fleet.workers_by_name()[vname]["state"] == "left", 60,
               f"the preempted worker {vname} leaving")
    ev = fleet.events(jid)
    assert not any(e["kind"] == "worker_lost" for e in ev), [e["detail"] for e in ev]
    at = int([e["detail"] for e in ev if e["kind"] == "drained"][0].rsplit(" ", 1)[1])
    # 0 steps lost: the generation after the drain starts right after its
    # step (a step trained again is recorded with the later generation).
    wait_until(lambda: fleet.job(jid)["step"] > at + 1, 30, "training after the drain")
    gen_at = {s["step"]: s["generation"] for s in fleet.api(f"/v1/jobs/{jid}/metrics")["steps"]}
    assert gen_at[at + 1] > gen_at[at], (at, gen_at.get(at), gen_at.get(at + 1))
    # The requeued Slurm job runs again, and its worker rejoins under its
    # name. The provisioner asked for a replacement when the worker left
    # unless Slurm had requeued its job by then (ztrain-provision counts
    # queued worker jobs): with a replacement, the job has the two workers
    # it wants and the provisioner gives the idle one back (its Slurm job
    # ends for good: ztrain-down, no requeue); without, the job takes the
    # requeued worker back.
    vjob = vname.split("-")[1]
    wait_until(lambda: fleet.workers_by_name()[vname]["state"] in ("alive", "left") and
               any(e["kind"] == "rejoined" and f"name={vname} " in e["detail"]
                   for e in fleet.events(0)), 120, f"the requeued worker {vname} back")

    def settled():
        jobs = cluster.jobs()
        return (len(jobs) == 2 and all(st == "RUNNING" for st, _, _ in jobs.values()) and
                len(members()) == 2 and fleet.job(jid)["world"] == 2)
    wait_until(settled, 60, "two Slurm worker jobs, both training")
    downs = [e["detail"] for e in fleet.events(0)
             if e["kind"] == "provision" and e["detail"].startswith("down")]
    if vjob in cluster.jobs():
        assert not downs and vname in members(), (downs, members())
        path = "the requeued worker back in the job"
    else:
        assert downs and f"({vname})" in downs[0], downs
        path = "a replacement from sbatch; the requeued worker given back"
    # A node lost outright: its slurmd and zworker die at once. The
    # provisioner asks Slurm for a replacement (sbatch), which trains.
    ws = members()
    before = set(fleet.workers_by_name())
    lost_name, lost = sorted(ws.items())[-1]
    gen0 = fleet.job(jid)["generation"]
    ck = max(committed(fleet, jid))
    # The last step of the generation: the job's step until the next one
    # (which may have started before the first look after the kill).
    seen = [fleet.job(jid)["step"]]
    t0 = time.monotonic()
    cluster.kill_node([h for h in cluster.nodes if h.name == lost["host"]][0])

    def next_generation():
        j = fleet.job(jid)
        if j["generation"] == gen0:
            seen.append(j["step"])
        return j["generation"] != gen0
    wait_until(next_generation, 60, "the generation after the node's loss")
    at_kill = max(seen)

    def replacement():
        ws = members()
        return [n for n in ws if n not in before and ws[n].get("step_ms", 0) > 0 and
                fleet.job(jid)["world"] == 2]
    new = wait_until(replacement, 120, "a replacement worker from sbatch training")
    replaced_s = time.monotonic() - t0
    # Only the steps since the last committed checkpoint are lost: the next
    # generation starts from it (or from one committed after the read).
    start = [int(re.search(r"start step (\d+)", e["detail"]).group(1))
             for e in fleet.events(jid) if e["kind"] == "generation_started" and
             int(re.search(r"generation (\d+)", e["detail"]).group(1)) == gen0 + 1][0]
    print(f"preemption: 0 steps lost (drained at step {at}), {path}; node lost at step {at_kill}: "
          f"{max(0, at_kill - start)} steps trained again (checkpoint every {every}); "
          f"node lost -> replacement (provisioner, sbatch) training: {replaced_s:.1f} s")
    assert start >= ck, (ck, start, at_kill)
    ups = [e["detail"] for e in fleet.events(0) if e["kind"] == "provision"]
    assert any(re.search(rf"output: {new[0].split('-')[1]}\b", d) for d in ups), (new, ups)
    fleet.zctl("cancel", str(jid))
    got = db_losses(os.path.join(shared, "zcoord.db"), jid)
    n = max(got)
    want = launcher_losses(spec, str(tmp_path), n)
    bad = [i for i in range(1, n + 1) if got.get(i) != want.get(i)]
    assert not bad, (bad[:5], [(got.get(i), want.get(i)) for i in bad[:5]])
