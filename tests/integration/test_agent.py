"""A machine's heartbeat agent (zworker --heartbeat-agent, worker/agent.c)
and the coordinator's HeartbeatBatch call.

Three zworkers of one machine (127.0.0.1) send their heartbeats through one
of them: the coordinator sees batches of three, and a job's commands
(RECONFIGURE, STOP) still reach every worker through them. Killing the
agent outright costs only its own worker: another becomes the agent and
nobody else is declared lost. A batch's entries are judged one by one:
a wrong credential is that entry's answer, not the call's, and a batch
longer than the limit is refused by name."""
import signal

import pytest

from test_grpc_python import stubs
from ztest import (byte_dataset, events, http_get, start_fleet, submit, tiny_spec, wait_job,
                   wait_until, workers_by_name)

HB_MS = 200


def counters(coord):
    """(single calls, batch calls, batch entries) from /metrics."""
    text = http_get(coord.http_port, "/metrics")[2]

    def value(prefix):
        return int(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(prefix)))
    return (value('ztrain_coordinator_heartbeat_calls_total{kind="single"}'),
            value('ztrain_coordinator_heartbeat_calls_total{kind="batch"}'),
            value("ztrain_coordinator_heartbeat_batch_entries_total "))


def settled(coord):
    """The counters after five more batches: the workers a new agent
    serves fall in step within a few rounds (agent.c)."""
    b = counters(coord)[1]
    wait_until(lambda: counters(coord)[1] - b >= 5, 20, "five batches")
    return counters(coord)


def agents(coord, names):
    return [n for n in names
            if "heartbeat agent of this machine" in coord.workers[n].output()]


def test_workers_of_a_machine_heartbeat_through_one_agent(procs, tmp_path):
    train, val = byte_dataset(str(tmp_path / "data"), limit=100_000)
    names = ["a0", "a1", "a2"]
    coord = start_fleet(procs, names=names, hb_ms=HB_MS, timeout_ms=3000,
                        extra=("--threads", "1", "--heartbeat-agent"))
    wait_until(lambda: len(agents(coord, names)) == 1, 20, "one agent among the workers")
    # In step after the first rounds: batches of all three, and no worker
    # calls by itself.
    s0, b0, e0 = settled(coord)
    wait_until(lambda: counters(coord)[1] - b0 >= 10, 20, "ten batches")
    s1, b1, e1 = counters(coord)
    assert s1 == s0, (s0, s1)
    assert (e1 - e0) / (b1 - b0) > 2.5, (b1 - b0, e1 - e0)
    # Commands arrive through the agent: a two-worker job trains.
    jid = submit(coord, tiny_spec(train, val, 30, stage=1, workers=2), tmp_path)
    wait_job(coord, jid, timeout=120)
    # The agent dies outright: only its worker is lost; another takes over.
    agent = agents(coord, names)[0]
    others = [n for n in names if n != agent]
    coord.workers[agent].p.send_signal(signal.SIGKILL)
    wait_until(lambda: workers_by_name(coord)[agent]["state"] == "lost", 20,
               f"the agent {agent} lost")
    wait_until(lambda: len(agents(coord, others)) == 1, 20, "a new agent")
    _, b2, e2 = settled(coord)
    wait_until(lambda: counters(coord)[1] - b2 >= 10, 20, "ten batches of the new agent")
    _, b3, e3 = counters(coord)
    assert (e3 - e2) / (b3 - b2) > 1.5, (b3 - b2, e3 - e2)
    ws = workers_by_name(coord)
    assert all(ws[n]["state"] == "alive" for n in others), ws
    lost = [e for e in events(coord) if e["kind"] == "lost"]
    assert len(lost) == 1, lost  # the agent's own worker only


def test_a_batch_is_judged_entry_by_entry(procs, tmp_path):
    pb, pbg = stubs(tmp_path)
    import grpc
    coord = procs.coord(hb_ms=HB_MS)
    with grpc.insecure_channel(coord.grpc) as ch:
        ctl = pbg.ControlStub(ch)
        regs = [ctl.RegisterWorker(pb.RegisterRequest(name=f"b{i}", host="m", device="cpu"),
                                   timeout=5) for i in range(2)]
        beats = [pb.HeartbeatRequest(worker_id=regs[0].worker_id, session=regs[0].session),
                 pb.HeartbeatRequest(worker_id=regs[1].worker_id, session="not-the-session"),
                 pb.HeartbeatRequest(worker_id=999999, session=regs[1].session),
                 pb.HeartbeatRequest(worker_id=regs[1].worker_id, session=regs[1].session)]
        r = ctl.HeartbeatBatch(pb.HeartbeatBatchRequest(beats=beats), timeout=5)
        st = [e.status for e in r.replies]
        assert len(st) == 4 and st[0] == 0 and st[3] == 0, r
        assert st[1] == grpc.StatusCode.UNAUTHENTICATED.value[0], r
        assert st[2] != 0 and r.replies[2].error, r
        assert r.replies[0].reply.heartbeat_ms == HB_MS and r.replies[3].reply.heartbeat_ms
        with pytest.raises(grpc.RpcError) as e:
            ctl.HeartbeatBatch(pb.HeartbeatBatchRequest(beats=[beats[0]] * 257), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 256" in e.value.details()
    assert coord.alive()


def test_workers_of_agents_are_paced_as_batches_from_registration(procs, tmp_path):
    """A coordinator that takes 10 heartbeat calls a second, at 200 ms
    heartbeats. 16 workers that register saying they will use their
    machine's agent (RegisterRequest.heartbeat_agent) count as two batches
    of 8 before any batch arrives (1.42 calls each), and 16 more that
    register without it as 16 calls: 19 calls an interval, 1.9 s, where
    32 single workers would stretch it to 3.2 s."""
    pb, pbg = stubs(tmp_path)
    import grpc
    coord = procs.coord(hb_ms=HB_MS, timeout_ms=60000, extra=("--heartbeat-capacity", "10"))

    def interval():
        text = http_get(coord.http_port, "/metrics")[2]
        return float(next(ln.split()[1] for ln in text.splitlines()
                          if ln.startswith("ztrain_coordinator_heartbeat_interval_seconds ")))
    with grpc.insecure_channel(coord.grpc) as ch:
        ctl = pbg.ControlStub(ch)
        for i in range(32):
            ctl.RegisterWorker(pb.RegisterRequest(name=f"a{i}", host=f"m{i // 8}", device="cpu",
                                                  heartbeat_agent=i < 16), timeout=5)
    got = wait_until(lambda: (lambda v: v if v >= 1.7 else None)(interval()), 20,
                     "the interval stretched for all 32 workers")
    assert 1.7 <= got <= 2.1, got
    assert coord.alive()
