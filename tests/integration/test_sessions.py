"""Worker session credentials: every Control call after RegisterWorker must
carry the session the registration handed out. Worker ids, job ids and
generation numbers are public (/v1/workers, /v1/jobs), so without this any
client reaching the gRPC port could mark a job completed with a made-up
loss, fail it, commit a made-up checkpoint or make a worker leave.

The forger is a raw grpcio client (hand-encoded messages, see
test_rpc_robustness.py); the workers and the job are real."""
import grpc
import pytest

from test_rpc_robustness import call, cred, decode, field_bytes, field_varint, register_session
from ztest import (byte_dataset, events, job, losses, start_fleet, submit, tiny_spec, wait_job,
                   wait_until, workers_by_name)

STEPS = 300


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return byte_dataset(str(tmp_path_factory.mktemp("data")), limit=200_000)


def double(v):
    import struct
    return struct.pack("<d", v)


def field_double(num, v):
    from test_rpc_robustness import varint
    return varint((num << 3) | 1) + double(v)


def test_forged_worker_calls_change_nothing(procs, tmp_path, data):
    train, val = data
    coord = start_fleet(procs, 2)
    spec = tiny_spec(train, val, STEPS, stage=1, workers=2,
                     checkpoint={"dir": str(tmp_path / "ckpt"), "every_steps": 50})
    jid = submit(coord, spec, tmp_path)
    wait_until(lambda: job(coord, jid)["step"] >= 5, 60, "training under way")
    j = job(coord, jid)
    ids = {n: w["id"] for n, w in workers_by_name(coord).items()}
    ch = grpc.insecure_channel(coord.grpc)
    head = field_varint(2, jid) + field_varint(3, j["generation"])
    forged = {
        # rank 0's report of the last step, with a made-up loss
        "/ztrain.Control/ReportStep": head + field_varint(4, STEPS) + field_double(5, 0.125),
        # a fatal failure
        "/ztrain.Control/ReportFailure": head + field_bytes(4, b"forged") + field_varint(5, 1),
        # a made-up checkpoint
        "/ztrain.Control/ReportCheckpoint": head + field_varint(4, 10)
        + field_bytes(5, str(tmp_path / "ckpt" / f"job_{jid}" / "step_00000010-g1").encode()),
        # a worker leaving
        "/ztrain.Control/Leave": field_bytes(2, b"forged leave"),
    }
    for wid in ids.values():
        for method, body in forged.items():
            for session in (b"", b"0" * 64, b"x"):  # none, a guess, garbage
                code, _, det = call(ch, method, cred(wid, session) + body)
                assert code == grpc.StatusCode.UNAUTHENTICATED, (method, session, code, det)
                assert "session" in det
    ch.close()
    # Nothing changed: both workers alive, the job completes on its own with
    # real losses, no forged checkpoint was registered.
    assert all(workers_by_name(coord)[n]["state"] == "alive" for n in ids)
    done = wait_job(coord, jid, timeout=300)
    assert done["state"] == "completed" and done["loss"] != 0.125
    assert 0.125 not in losses(coord, jid).values()
    kinds = [e["kind"] for e in events(coord, job=jid)]
    assert "job_failed" not in kinds and "rank_failed" not in kinds


def test_session_rotates_on_registration(procs):
    coord = procs.coord(hb_ms=200, timeout_ms=1000)
    ch = grpc.insecure_channel(coord.grpc)
    wid, s1 = register_session(ch, "rotor")
    hb = "/ztrain.Control/Heartbeat"
    assert call(ch, hb, cred(wid, s1))[0] == grpc.StatusCode.OK
    # The holder takes its own name again (it presents s1): a new session.
    wid2, s2 = register_session(ch, "rotor", session=s1)
    assert wid2 == wid and s2 != s1
    code, _, det = call(ch, hb, cred(wid, s1))
    assert code == grpc.StatusCode.UNAUTHENTICATED, det
    assert call(ch, hb, cred(wid, s2))[0] == grpc.StatusCode.OK
    # The reply of a heartbeat does not leak it either.
    _, reply, _ = call(ch, hb, cred(wid, s2))
    assert s2 not in reply
    ch.close()


def test_live_name_cannot_be_taken(procs):
    coord = procs.coord(hb_ms=200, timeout_ms=1000)
    first = procs.worker(coord.grpc, "same-name")
    wait_until(lambda: workers_by_name(coord).get("same-name", {}).get("state") == "alive", 10,
               "first registered")
    pid1 = workers_by_name(coord)["same-name"]["pid"]
    # A raw impostor without the session is refused, naming the holder.
    ch = grpc.insecure_channel(coord.grpc)
    code, _, det = call(ch, "/ztrain.Control/RegisterWorker",
                        field_bytes(1, b"same-name") + field_bytes(3, b"cpu"))
    assert code == grpc.StatusCode.ALREADY_EXISTS and f"pid {pid1}" in det, (code, det)
    ch.close()
    # A second zworker with the same name waits (it retries) instead of
    # taking over the identity; the first keeps it.
    second = procs.worker(coord.grpc, "same-name", proc_name="second")
    wait_until(lambda: "in use by a live worker" in second.output(), 10, "second refused")
    assert second.alive() and workers_by_name(coord)["same-name"]["pid"] == pid1
    # Once the first is gone (killed, then declared lost), the second gets in.
    first.kill()
    wait_until(lambda: workers_by_name(coord)["same-name"]["pid"] == second.pid
               and workers_by_name(coord)["same-name"]["state"] == "alive", 15, "second in")
    kinds = [e["kind"] for e in events(coord) if e["worker_id"]]
    assert kinds.index("lost") < kinds.index("rejoined"), kinds


def test_a_lost_first_registration_reply_is_retried_at_once(procs):
    """A first registration may present a credential the worker made up
    (zworker does): when its reply is lost, the retry presents it again and
    takes the name back at once, with a new session and no lost worker;
    a retry with another made-up credential is still refused, and a short
    one does not count."""
    coord = procs.coord(hb_ms=200, timeout_ms=60000)
    ch = grpc.insecure_channel(coord.grpc)
    token = b"ab" * 32
    wid, s1 = register_session(ch, "unlucky", session=token)  # its reply "lost"
    wid2, s2 = register_session(ch, "unlucky", session=token)
    assert wid2 == wid and s2 != s1
    code, _, det = call(ch, "/ztrain.Control/RegisterWorker", field_bytes(1, b"unlucky")
                        + field_bytes(3, b"cpu") + field_bytes(7, ("cd" * 32).encode()))
    assert code == grpc.StatusCode.ALREADY_EXISTS, (code, det)
    register_session(ch, "short", session=b"x" * 8)
    code, _, det = call(ch, "/ztrain.Control/RegisterWorker", field_bytes(1, b"short")
                        + field_bytes(3, b"cpu") + field_bytes(7, b"x" * 8))
    assert code == grpc.StatusCode.ALREADY_EXISTS, (code, det)
    assert "lost" not in [e["kind"] for e in events(coord)]
    ch.close()
