"""Fleets of separate hosts: each zworker and zcoord in its own network
namespace with its own address and its own directory (mhnet.py).

What holds without shared storage today: training across hosts, the same
losses as a single rank, and a host that vanishes from the network (no FIN,
no RST) failing every survivor's collective within its deadline, after
which the job goes on without it.
"""
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
