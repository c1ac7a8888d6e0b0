"""Fleets of separate hosts: each zworker and zcoord in its own network
namespace with its own address and its own directory (mhnet.py).

What holds without shared storage today: training across hosts, the same
losses as a single rank; a host that vanishes from the network (no FIN,
no RST) failing every survivor's collective within its deadline, after
which the job goes on without it; a host lost with its disk, the job going
on from the copies of its files; and both copies of a file lost, the job
pausing with the reason instead of starting over.
"""
import json
import os
import re
import shutil
import time

import pytest

from mhfleet import Fleet
from ztest import byte_dataset, tiny_spec, wait_until


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("data"))
    byte_dataset(d, limit=200_000)
    return d


def spec(steps, workers, **kw):
    s = tiny_spec("data/train_*.bin", "data/val_*.bin", steps, stage=2, workers=workers, **kw)
    s["comm"] = {"timeout_ms": 3000}
    return s


def test_training_across_hosts_equals_one_rank(net, data, tmp_path):
    fleet = Fleet(net, data)
    for h in ("h1", "h2", "h3"):
        fleet.add_worker(h)
    fleet.wait_alive(["wh1", "wh2", "wh3"])
    hosts = {w["name"]: w["host"] for w in fleet.workers_by_name().values()}
    assert hosts == {"wh1": "h1", "wh2": "h2", "wh3": "h3"}
    j3 = fleet.submit(spec(40, 3), str(tmp_path / "a.json"))
    fleet.wait_job(j3)
    j1 = fleet.submit(spec(40, 1), str(tmp_path / "b.json"))
    fleet.wait_job(j1)
    assert fleet.losses(j3) == fleet.losses(j1)
    started = [e for e in fleet.events(j3) if e["kind"] == "rendezvous_complete"]
    assert started and "3 ranks connected" in started[0]["detail"]


def test_diloco_groups_are_one_host_each(net, data, tmp_path):
    """sync.group_size 2 on two hosts of two workers that registered in
    turn (h1, h2, h1, h2): the coordinator lists each host's workers
    together, so each group trains under ZeRO on one machine and only the
    outer all-reduce crosses between the hosts."""
    fleet = Fleet(net, data)
    names = ["a1", "b1", "a2", "b2"]
    for n in names:  # one at a time: the registrations, and so the ids, alternate hosts
        h = {"a": "h1", "b": "h2"}[n[0]]
        fleet.add_worker(h, name=n, extra=["--workdir", os.path.join(net.root, h, f"work-{n}")])
        fleet.wait_alive([n])
    s = spec(16, 4)
    s["sync"] = {"mode": "diloco", "inner_steps": 4, "group_size": 2}
    j = fleet.submit(s, str(tmp_path / "g.json"))
    fleet.wait_job(j)
    started = [e["detail"] for e in fleet.events(j) if e["kind"] == "generation_started"]
    assert started and "workers [a1,a2,b1,b2]" in started[0], started
    assert sorted(fleet.losses(j)) == list(range(1, 17))


def test_heartbeat_agents_one_per_host(net, data, tmp_path):
    """zworker --heartbeat-agent, two hosts of two workers: each host (its
    own network namespace, so its own abstract socket) has its own agent,
    the coordinator gets batches of two and no single calls, and a job
    trains across the four workers."""
    fleet = Fleet(net, data)
    names = [f"w{h}{i}" for h in ("h1", "h2") for i in range(2)]
    for n in names:
        h = n[1:3]
        fleet.add_worker(h, name=n, extra=["--heartbeat-agent",
                                           "--workdir", os.path.join(net.root, h, f"work-{n}")])
    fleet.wait_alive(names)

    def agents():
        return [n for n in names
                if "heartbeat agent of this machine" in fleet.workers[n][1].output()]
    wait_until(lambda: len(agents()) == 2, 20, "one agent per host")
    assert sorted(fleet.workers[n][0].name for n in agents()) == ["h1", "h2"], agents()

    def counts():
        text = fleet.api("/metrics")
        v = {ln.split()[0]: int(ln.split()[1]) for ln in text.splitlines()
             if ln.startswith(("ztrain_coordinator_heartbeat_calls_total",
                               "ztrain_coordinator_heartbeat_batch_entries_total"))}
        return (v['ztrain_coordinator_heartbeat_calls_total{kind="single"}'],
                v['ztrain_coordinator_heartbeat_calls_total{kind="batch"}'],
                v["ztrain_coordinator_heartbeat_batch_entries_total"])
    s0, b0, e0 = counts()
    wait_until(lambda: counts()[1] - b0 >= 10, 30, "ten batches")
    s1, b1, e1 = counts()
    assert s1 == s0 and (e1 - e0) / (b1 - b0) > 1.5, (s0, s1, b1 - b0, e1 - e0)
    j = fleet.submit(spec(30, 4), str(tmp_path / "a.json"))
    fleet.wait_job(j)


def test_host_vanishing_fails_collectives_within_deadline(net, data, tmp_path):
    """Link down mid-collective: nothing tells the survivors (no FIN, no
    RST); each must give up within the collective timeout (3 s) and the job
    goes on with the two hosts left. The heartbeat timeout is long (20 s), so
    the survivors' reports, not the liveness check, end the generation."""
    fleet = Fleet(net, data, timeout_ms=20000)
    for h in ("h1", "h2", "h3"):
        fleet.add_worker(h)
    fleet.wait_alive(["wh1", "wh2", "wh3"])
    s = spec(100000, 3)
    s["elastic"] = {"min_workers": 2, "max_workers": 3}
    s["train_batch_size"] = 12
    jid = fleet.submit(s, str(tmp_path / "a.json"))
    wait_until(lambda: fleet.job(jid)["step"] >= 20, 60, "training under way")
    t_down = time.time()
    net.link_down(net.hosts["h3"])
    # The survivors report the broken ring; a generation of two runs.
    wait_until(lambda: fleet.job(jid)["generation"] >= 2 and fleet.job(jid)["world"] == 2
               and fleet.job(jid)["state"] == "running", 15, "a generation without h3")
    assert "lost" not in [e["kind"] for e in fleet.events(jid)]
    failed = [e for e in fleet.events(jid) if e["kind"] == "rank_failed"]
    assert failed, fleet.events(jid)
    first = failed[0]["t_ms"] / 1000
    print(f"first failure report {first - t_down:.2f} s after the link went down")
    assert first - t_down <= 3 + 2, (first - t_down, failed[0])
    step = fleet.job(jid)["step"]
    wait_until(lambda: fleet.job(jid)["step"] >= step + 10, 60, "steps without h3")


def test_late_rank_report_still_commits_every_epoch(net, data, tmp_path):
    """Rank 0 reports each epoch 60 ms after its peers and after the
    copies pushed to its store (fault_injection.delay_checkpoint_report_ms),
    so reports of two epochs interleave and copies come before the report of
    the rank that wrote them. Every epoch still commits with its copies, and
    a drain's checkpoint-now epoch commits and re-forms the job."""
    fleet = Fleet(net, data)
    for h in ("h1", "h2", "h3"):
        fleet.add_worker(h)
    fleet.wait_alive(["wh1", "wh2", "wh3"])
    # Long enough that both remaining ranks write six periodic epochs even
    # on a loaded machine (each skips an epoch while its previous one is
    # still being copied or reported).
    s = spec(400, 2, max_workers=3, checkpoint={"dir": "ckpt", "every_steps": 10, "replicas": 2})
    s["fault_injection"] = {"delay_checkpoint_report_ms": 60}
    jid = fleet.submit(s, str(tmp_path / "a.json"))
    wait_until(lambda: fleet.job(jid)["step"] >= 60 and fleet.job(jid)["world"] == 3, 90,
               "three ranks past step 60")
    fleet.zctl("drain", "wh3")
    wait_until(lambda: fleet.job(jid)["world"] == 2 and fleet.job(jid)["state"] == "running"
               or fleet.job(jid)["state"] == "completed", 60, "the drain's re-form")
    fleet.wait_job(jid, timeout=180)
    ev = fleet.events(jid)
    steps = sorted(int(os.path.basename(e["detail"])[5:13])
                   for e in ev if e["kind"] == "checkpoint_committed")
    # Every periodic epoch both remaining ranks wrote (an epoch is skipped
    # while the previous one is still being reported) committed; the last
    # ones may still have been in flight when the job completed. (The
    # drain's checkpoint-now epoch is not among them: when a periodic epoch
    # commits first, the job re-forms from that one.)
    written = [set(int(m) for m in re.findall(r"checkpoint step (\d+) written",
                                                fleet.workers[n][1].output()))
               for n in ("wh1", "wh2")]
    both = sorted(st for st in written[0] & written[1] if st < 380 and st % 10 == 0)
    assert len(both) >= 6, written
    assert [st for st in both if st not in steps] == [], (both, steps)
    drained = [e for e in ev if e["kind"] == "generation_started" and "drain of worker wh3" in
               e["detail"] + e.get("last_detail", "")]
    assert drained, [e["detail"] for e in ev if e["kind"] == "generation_started"]


def epoch_files(net, hosts, rel):
    """file name -> the hosts whose directory holds it, for one epoch."""
    where = {}
    for h in hosts:
        d = os.path.join(net.hosts[h].dir, rel)
        for f in os.listdir(d) if os.path.isdir(d) else []:
            if not f.endswith((".tmp", ".part")):
                where.setdefault(f, set()).add(h)
    return where


def committed_dirs(fleet, jid):
    """step -> epoch directory relative to the checkpoint root."""
    out = {}
    for c in json.loads(fleet.zctl("--json", "checkpoints", str(jid)).stdout)["checkpoints"]:
        if c["state"] == "committed":
            out[c["step"]] = os.path.relpath(c["dir"], fleet.coord_host.dir)
    return out


def epochs_on(net, host, jid):
    d = os.path.join(net.hosts[host].dir, "ckpt", f"job_{jid}")
    return {e for e in os.listdir(d) if e.startswith("step_")} if os.path.isdir(d) else set()


def test_retention_on_every_host_and_stale_copies_reconciled(net, data, tmp_path):
    """keep_last 2, replicas 2: the epochs retention deletes go from every
    host that holds a copy. A host away while retention moved on comes back
    with stale copies: what is no longer committed is deleted there, the
    copies of epochs still committed stay."""
    fleet = Fleet(net, data)
    for h in ("h1", "h2", "h3"):
        fleet.add_worker(h)
    fleet.wait_alive(["wh1", "wh2", "wh3"])
    s = spec(100_000, 2, max_workers=3,
             checkpoint={"dir": "ckpt", "every_steps": 10, "keep_last": 2, "replicas": 2})
    jid = fleet.submit(s, str(tmp_path / "a.json"))
    wait_until(lambda: fleet.job(jid)["step"] >= 60 and fleet.job(jid)["world"] == 3, 90,
               "three ranks past step 60")
    # h3 stops (its disk stays) while it holds copies.
    h3, p3 = fleet.workers["wh3"]
    wait_until(lambda: epochs_on(net, "h3", jid), 30, "epochs on h3")
    p3.kill()
    stale = epochs_on(net, "h3", jid)
    wait_until(lambda: fleet.job(jid)["world"] == 2 and fleet.job(jid)["state"] == "running",
               30, "a generation without h3")
    # Retention moves past everything h3 holds.
    wait_until(lambda: min(committed_dirs(fleet, jid), default=0) >
               max(int(e[5:13]) for e in stale), 90, "retention past h3's epochs")

    # Paused, the set of committed epochs stands still (while training, an
    # epoch retention just dropped is always on its way off the disks).
    fleet.zctl("pause", str(jid))
    wait_until(lambda: fleet.job(jid)["state"] == "paused", 30, "the job paused")
    live = {os.path.basename(d) for d in committed_dirs(fleet, jid).values()}
    assert len(live) == 2, live
    newest = max(int(e[5:13]) for e in live)

    def only_committed(hosts):
        # An epoch written as the job paused never commits; it stays until
        # the job re-forms. Every older epoch but the kept two must go.
        on = {h: epochs_on(net, h, jid) for h in hosts}
        old = [e for es in on.values() for e in es - live if int(e[5:13]) <= newest]
        return on if not old else None
    wait_until(lambda: only_committed(("h1", "h2")), 30, "old epochs deleted on h1 and h2")
    assert epochs_on(net, "h3", jid) == stale  # nobody touched the stopped host's disk
    # h3 comes back: its stale copies are deleted once it registers.
    fleet.add_worker("h3")
    wait_until(lambda: not (epochs_on(net, "h3", jid) & stale), 30,
               "h3's stale copies reconciled")


@pytest.mark.parametrize("when", ["mid-step", "mid-replication"])
def test_host_loss_with_replicated_checkpoints(net, data, tmp_path, when):
    """replicas 2: every file of an epoch is on two machines before it
    commits. A worker machine vanishes with its disk mid-run; the job goes
    on from the newest epoch (fetching the lost machine's files from their
    copies) and its losses equal a failure-free run's."""
    fleet = Fleet(net, data)
    for h in ("h1", "h2", "h3"):
        fleet.add_worker(h)
    fleet.wait_alive(["wh1", "wh2", "wh3"])
    s = spec(1500, 3, checkpoint={"dir": "ckpt", "every_steps": 10, "keep_last": 3,
                                  "replicas": 2})
    s["elastic"] = {"min_workers": 2, "max_workers": 3}
    s["train_batch_size"] = 12
    ref = fleet.submit(dict(s, checkpoint={"dir": "ref", "every_steps": 1000}),
                       str(tmp_path / "ref.json"))
    fleet.wait_job(ref)
    jid = fleet.submit(s, str(tmp_path / "a.json"))
    wait_until(lambda: max(committed_dirs(fleet, jid), default=0) >= 20, 90, "two epochs")
    dirs = committed_dirs(fleet, jid)
    newest = dirs[max(dirs)]
    where = epoch_files(net, ("h1", "h2", "h3"), newest)
    assert len(where) == 7 and all(len(hs) >= 2 for hs in where.values()), where
    # h3 vanishes, disk and all: at some point of a step, or right after
    # it wrote an epoch, while its copies are being pushed (that epoch then
    # never commits; the job goes on from the one before).
    if when == "mid-replication":
        log = fleet.workers["wh3"][1]
        n0 = len(re.findall(r"checkpoint step \d+ written", log.output()))
        wait_until(lambda: len(re.findall(r"checkpoint step \d+ written", log.output())) > n0,
                   30, "an epoch written on h3", interval=0.002)
    gen0, s0 = fleet.job(jid)["generation"], fleet.job(jid)["step"]
    net.hosts["h3"].kill_all()
    shutil.rmtree(net.hosts["h3"].dir)
    t_lost = time.time()
    wait_until(lambda: fleet.job(jid)["generation"] > gen0 and any(
        s["generation"] > gen0
        for s in fleet.api(f"/v1/jobs/{jid}/metrics?from={max(s0 - 30, 0)}")["steps"]),
        60, "a step of the next generation", interval=0.05)
    print(f"{when}: first step of the next generation {time.time() - t_lost:.1f} s after "
          f"the host was lost")
    j = fleet.wait_job(jid, timeout=180)
    assert j["world"] == 2 and j["generation"] >= 2, j
    assert fleet.losses(jid) == fleet.losses(ref)
    kinds = [e["kind"] for e in fleet.events(jid)]
    assert "checkpoint_corrupt" not in kinds, kinds
    print(f"job completed {time.time() - t_lost:.1f} s after the host was lost")


def test_fetch_failing_on_the_fetcher_keeps_the_epoch(net, data, tmp_path):
    """A worker that cannot store the copies it fetches (here a file stands
    where its epoch directory must go, which stops root as well) fails as
    itself: the epoch it was loading is neither called corrupt nor
    retired, and stays committed for the workers that can load it."""
    fleet = Fleet(net, data)
    for h in ("h1", "h2"):
        fleet.add_worker(h)
    fleet.wait_alive(["wh1", "wh2"])
    s = spec(3000, 2, checkpoint={"dir": "ckpt", "every_steps": 10, "replicas": 2})
    s["elastic"] = {"min_workers": 2, "max_workers": 2}
    jid = fleet.submit(s, str(tmp_path / "a.json"))
    wait_until(lambda: committed_dirs(fleet, jid), 90, "a committed epoch")
    h3 = net.add_host("h3")
    os.makedirs(os.path.join(h3.dir, "ckpt"))
    with open(os.path.join(h3.dir, "ckpt", f"job_{jid}"), "w") as f:
        f.write("not a directory\n")
    fleet.add_worker("h3")
    fleet.wait_alive(["wh3"])
    net.hosts["h2"].kill_all()
    shutil.rmtree(net.hosts["h2"].dir)

    def fetch_failed():
        ev = fleet.events(jid)
        return [e for e in ev if e["kind"] in ("checkpoint_corrupt", "checkpoint_retired")
                or (e["kind"] == "rank_failed" and "copy" in e["detail"])] or None

    ev = wait_until(fetch_failed, 60, "the fetch on h3 to fail")
    kinds = [e["kind"] for e in fleet.events(jid)]
    assert "checkpoint_corrupt" not in kinds and "checkpoint_retired" not in kinds, ev
    assert "cannot store a copy on this worker" in ev[0]["detail"], ev
    assert committed_dirs(fleet, jid), "the epoch is still committed"


@pytest.mark.parametrize("how", ["killed", "cut"])
def test_both_copies_lost_pauses_instead_of_loading_partial_state(net, data, tmp_path, how):
    """replicas 2 and the two machines holding both copies of a rank's files
    vanish at once: no committed epoch can be loaded, so the job pauses with
    the reason instead of starting over or loading part of an epoch.
    killed: the machines are gone with their disks, and the job stays
    paused. cut: their links go down, and when they come back with their
    files the pause's cause is gone: the job resumes by itself and
    completes."""
    fleet = Fleet(net, data)
    for h in ("h1", "h2", "h3", "h4"):
        fleet.add_worker(h)
    fleet.wait_alive(["wh1", "wh2", "wh3", "wh4"])
    s = spec(3000, 4, checkpoint={"dir": "ckpt", "every_steps": 10, "replicas": 2})
    s["elastic"] = {"min_workers": 2, "max_workers": 4}
    s["train_batch_size"] = 16
    jid = fleet.submit(s, str(tmp_path / "a.json"))

    def four_rank_epoch():
        """The newest epoch, when the generation that wrote it still runs
        with all four ranks: its files are where the kill below loses them.
        (On a loaded machine a generation may re-form before the kill; the
        check then waits for the next four-rank epoch.)"""
        j = fleet.job(jid)
        dirs = committed_dirs(fleet, jid)
        if j["state"] != "running" or j["world"] != 4 or len(dirs) < 2:
            return None
        newest = dirs[max(dirs)]
        if not newest.endswith(f"-g{j['generation']}"):
            return None
        where = epoch_files(net, ("h1", "h2", "h3", "h4"), newest)
        lost = [f for f, hs in where.items() if hs <= {"h3", "h4"}]
        return (j["generation"], where) if lost and fleet.job(jid)["generation"] == j["generation"] else None

    gen, where = wait_until(four_rank_epoch, 90, "a committed epoch of a four-rank generation")
    # Both machines at once: a survivor that notices the first one gone
    # (within milliseconds, from its sockets) would otherwise copy the files
    # from the second before that one is killed too.
    if how == "killed":
        net.kill_hosts(net.hosts["h3"], net.hosts["h4"])
        for h in ("h3", "h4"):
            shutil.rmtree(net.hosts[h].dir)
    else:
        net.link_down(net.hosts["h3"])
        net.link_down(net.hosts["h4"])
    try:
        j = fleet.wait_job(jid, timeout=60, states=("paused",))
    except AssertionError as e:
        raise AssertionError(f"{e}; generation at the kill {gen}, files {where}; events "
                             f"{[(x['kind'], x['detail']) for x in fleet.events(jid)]}") from None
    assert "no committed checkpoint can be loaded" in j["message"], j
    kinds = [e["kind"] for e in fleet.events(jid)]
    assert "checkpoint_unavailable" in kinds
    # A generation formed before the coordinator knew the machines were gone
    # could not fetch the lost files and failed before any step; nothing was
    # retired as corrupt, and nothing trained from a partial or fresh state.
    assert "checkpoint_corrupt" not in kinds and "checkpoint_retired" not in kinds, kinds
    steps = sorted(fleet.losses(jid))
    assert steps == list(range(1, steps[-1] + 1)), "the stored steps run from 1 without a gap"
    starts = [d for e in fleet.events(jid) if e["kind"] == "generation_started"
              for d in (e["detail"], e.get("last_detail")) if d]
    assert not any("start step 0" in d for d in starts[1:]), starts
    if how == "killed":
        return
    net.link_up(net.hosts["h3"])
    net.link_up(net.hosts["h4"])
    j = fleet.wait_job(jid, timeout=120)
    resumed = [e["detail"] for e in fleet.events(jid) if e["kind"] == "job_resumed"]
    assert resumed and "can be loaded again" in resumed[0], resumed
    assert sorted(fleet.losses(jid)) == list(range(1, 3001))
