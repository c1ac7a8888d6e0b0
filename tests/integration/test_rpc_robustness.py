"""Bad input over gRPC: malformed, truncated and oversized payloads, unknown
methods and unknown workers must get an error status, never a crash, and
must not disturb what the coordinator already stores.

The client is Python grpcio with identity (de)serializers, so the test can
put any bytes on the wire. Valid messages are encoded by hand (tiny protobuf
writer below) to keep this test independent of our own C encoder.
"""
import random

import grpc
import pytest

from ztest import events, wait_until, workers_by_name


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field_varint(num, v):
    return varint(num << 3) + varint(v)


def field_bytes(num, b):
    return varint((num << 3) | 2) + varint(len(b)) + b


def call(channel, method, payload, timeout=5):
    stub = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    try:
        return grpc.StatusCode.OK, stub(payload, timeout=timeout), ""
    except grpc.RpcError as e:
        return e.code(), None, e.details()


@pytest.fixture
def coord_and_channel(procs):
    coord = procs.coord(hb_ms=200, timeout_ms=1000)
    ch = grpc.insecure_channel(coord.grpc, options=[("grpc.max_send_message_length", 64 << 20)])
    yield coord, ch
    ch.close()


def read_varint(buf, i):
    v, shift = 0, 0
    while True:
        b = buf[i]
        v |= (b & 0x7F) << shift
        shift += 7
        i += 1
        if not b & 0x80:
            return v, i


def decode(buf):
    """{field number: value} of a message's fields (fixed-size ones as raw bytes)."""
    out, i = {}, 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        if key & 7 == 0:
            out[key >> 3], i = read_varint(buf, i)
        elif key & 7 == 2:
            n, i = read_varint(buf, i)
            out[key >> 3], i = buf[i:i + n], i + n
        elif key & 7 in (1, 5):  # fixed64 (double), fixed32: raw bytes
            n = 8 if key & 7 == 1 else 4
            out[key >> 3], i = buf[i:i + n], i + n
        else:
            raise ValueError(f"wire type {key & 7}")
    return out


def register_session(ch, name, session=b""):
    """RegisterWorker: (worker_id, session) from RegisterReply fields 1 and 5."""
    code, reply, det = call(ch, "/ztrain.Control/RegisterWorker",
                            field_bytes(1, name.encode()) + field_bytes(3, b"cpu")
                            + (field_bytes(7, session) if session else b""))
    assert code == grpc.StatusCode.OK, det
    f = decode(reply)
    assert len(f[5]) == 64, f  # 32 random bytes in hex
    return f[1], f[5]


def register(ch, name):
    return register_session(ch, name)[0]


def cred(wid, session):
    """The worker_id and session fields every worker call carries."""
    return field_varint(1, wid) + field_bytes(20, session)


def test_malformed_truncated_unknown(coord_and_channel, procs):
    coord, ch = coord_and_channel
    wid, session = register_session(ch, "raw-client")
    n_events = len(events(coord))
    hb = "/ztrain.Control/Heartbeat"

    cases = {
        "truncated varint": b"\x08",
        "truncated long varint": b"\x08\xff\xff\xff",
        "bad wire type": b"\x0f\x01",
        "length past end": b"\x12\x10abc",
        "field number zero": b"\x00\x01",
        "truncated fixed64": b"\x09\x01\x02",
        "group wire type": b"\x0b",
    }
    for what, payload in cases.items():
        code, _, det = call(ch, hb, payload)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, det)
        assert "HeartbeatRequest" in det, det

    # A registration truncated in the middle of its name string.
    full = field_bytes(1, b"truncated-name") + field_bytes(3, b"cpu")
    code, _, det = call(ch, "/ztrain.Control/RegisterWorker", full[:8])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "RegisterRequest" in det

    # Unknown worker ids and unknown methods.
    code, _, det = call(ch, hb, field_varint(1, 987654321))
    assert code == grpc.StatusCode.NOT_FOUND and "987654321" in det
    code, _, det = call(ch, "/ztrain.Control/Leave", field_varint(1, 424242))
    assert code == grpc.StatusCode.NOT_FOUND
    code, _, det = call(ch, "/ztrain.Control/Explode", b"")
    assert code == grpc.StatusCode.UNIMPLEMENTED and "Explode" in det
    code, _, det = call(ch, "/ztrain.Nope/Heartbeat", b"")
    assert code == grpc.StatusCode.UNIMPLEMENTED

    # Invalid names are refused with a reason, not stored.
    code, _, det = call(ch, "/ztrain.Control/RegisterWorker", field_bytes(1, b"bad name/../x"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "invalid worker name" in det
    code, _, det = call(ch, "/ztrain.Control/RegisterWorker", field_bytes(1, b""))
    assert code == grpc.StatusCode.INVALID_ARGUMENT

    # Host and device names are served as they are (JSON, Prometheus
    # labels): they must be UTF-8 text. One bad byte once made /v1/workers
    # invalid JSON and every /metrics scrape fail.
    for field, value in ((2, b"h\xff"), (2, b"h\xed\xa0\x80"), (3, b"cuda:\xc0\xb0"),
                         (2, b"tab\there")):
        code, _, det = call(ch, "/ztrain.Control/RegisterWorker",
                            field_bytes(1, b"bad-text") + field_bytes(field, value))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not UTF-8 text" in det, (value, det)
    assert "bad-text" not in workers_by_name(coord)

    # A heartbeat reports at most 64 deleted epochs, each a database write:
    # a longer list is refused before any work.
    code, _, det = call(ch, hb, cred(wid, session) + field_bytes(6, b"x") * 100000)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "deleted_epochs: 100000" in det, det
    code, _, det = call(ch, hb, cred(wid, session) + field_bytes(6, b"job_1/step_00000001-g1") * 64)
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION), det

    # Oversized: above the 4 MiB request limit.
    code, _, det = call(ch, hb, field_bytes(15, b"x" * (5 << 20)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, det)

    # Random garbage: whatever the status, the coordinator survives.
    rng = random.Random(1234)
    for i in range(300):
        payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        method = rng.choice([hb, "/ztrain.Control/RegisterWorker", "/ztrain.Control/Leave",
                             "/ztrain.Status/ListEvents", "/ztrain.Status/ListWorkers"])
        code, _, _ = call(ch, method, payload)
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                        grpc.StatusCode.UNAUTHENTICATED), code
        assert coord.alive(), f"zcoord died on case {i}: {payload!r}"

    # Still serving, and what it stored is intact.
    assert coord.alive()
    code, _, det = call(ch, hb, cred(wid, session))
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION), det
    ws = workers_by_name(coord)
    assert ws["raw-client"]["id"] == wid
    evs = events(coord)
    assert len(evs) >= n_events and evs[0]["kind"] == "coordinator_started"


def test_stale_worker_told_to_register_again(coord_and_channel):
    coord, ch = coord_and_channel
    wid, session = register_session(ch, "short-lived")
    code, _, det = call(ch, "/ztrain.Control/Leave", cred(wid, session) + field_bytes(2, b"bye"))
    assert code == grpc.StatusCode.OK, det
    code, _, det = call(ch, "/ztrain.Control/Heartbeat", cred(wid, session))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "register again" in det
    assert register(ch, "short-lived") == wid  # same name, same identity
    kinds = [e["kind"] for e in events(coord) if e["worker_id"] == wid]
    assert kinds == ["registered", "left", "rejoined"]


def test_lost_register_reply(coord_and_channel):
    """A re-registration whose reply is lost (its deadline passed after the
    coordinator stored the new credential) leaves the worker with the old
    one: asking again with it is let in, however many replies were lost,
    until the new credential has been used. Before, the name stayed taken
    until the worker was declared lost."""
    _, ch = coord_and_channel
    reg = "/ztrain.Control/RegisterWorker"
    wid, s1 = register_session(ch, "unlucky")
    wid2, s2 = register_session(ch, "unlucky", s1)  # this reply is "lost"
    assert wid2 == wid and s2 != s1
    wid3, _ = register_session(ch, "unlucky", s1)   # and this one
    wid4, s4 = register_session(ch, "unlucky", s1)
    assert wid3 == wid4 == wid
    code, _, det = call(ch, "/ztrain.Control/Heartbeat", cred(wid, s4))
    assert code == grpc.StatusCode.OK, det
    # Once the new credential is used, the old ones are worthless.
    for old in (s1, s2):
        code, _, det = call(ch, reg, field_bytes(1, b"unlucky") + field_bytes(7, old))
        assert code == grpc.StatusCode.ALREADY_EXISTS and "in use" in det, det
    code, _, det = call(ch, "/ztrain.Control/Heartbeat", cred(wid, s1))
    assert code == grpc.StatusCode.UNAUTHENTICATED, det
    assert register_session(ch, "unlucky", s4)[0] == wid


def test_rendezvous_relays_nccl_id(procs, tmp_path):
    """An all-GPU generation: the coordinator tells its rank 0 (nccl_root in
    the heartbeat reply), takes the NCCL unique id from rank 0's Rendezvous
    call only, refuses a malformed one or one from another rank, and hands
    rank 0's to every rank. Two raw clients play GPU workers."""
    from ztest import byte_dataset, submit, tiny_spec
    coord = procs.coord(hb_ms=200, timeout_ms=30000)
    ch = grpc.insecure_channel(coord.grpc)
    ws = {}
    for i in range(2):
        code, reply, det = call(ch, "/ztrain.Control/RegisterWorker",
                                field_bytes(1, f"gpu{i}".encode()) + field_bytes(3, f"cuda:{i}".encode())
                                + field_varint(8, 16 << 30) + field_varint(9, 16 << 30)
                                + field_varint(12, 1))  # NCCL loads
        assert code == grpc.StatusCode.OK, det
        f = decode(reply)
        ws[i] = (f[1], f[5])
    train, val = byte_dataset(str(tmp_path / "data"), limit=50_000)
    jid = submit(coord, tiny_spec(train, val, 10, 2, 2), tmp_path)
    hb = {}

    def assigned():
        for i, (wid, s) in ws.items():
            code, reply, det = call(ch, "/ztrain.Control/Heartbeat", cred(wid, s))
            assert code == grpc.StatusCode.OK, det
            hb[i] = decode(reply)
        return all(h.get(2) == jid for h in hb.values())
    wait_until(assigned, 30, "both raw workers assigned to the job")
    roots = [i for i in ws if hb[i].get(8) == 1]
    assert len(roots) == 1, hb
    r0, r1 = roots[0], 1 - roots[0]
    gen = hb[r0][3]

    def rdv(i, nccl_id=b"", timeout=5):
        wid, s = ws[i]
        body = (cred(wid, s) + field_varint(2, jid) + field_varint(3, gen)
                + field_bytes(4, f"127.0.0.1:{9000 + i}".encode())
                + (field_bytes(5, nccl_id) if nccl_id else b""))
        return call(ch, "/ztrain.Control/Rendezvous", body, timeout=timeout)
    rng = random.Random(3)
    good = bytes(rng.choice(b"0123456789abcdef") for _ in range(256))
    assert good != good.upper()
    code, _, det = rdv(r1, good)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "only rank 0" in det, (code, det)
    for bad in (b"zz" * 128, good[:100], good.upper()):
        code, _, det = rdv(r0, bad)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "256 lowercase hex" in det, (bad, code, det)
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(2) as ex:
        a = ex.submit(rdv, r0, good, 20)
        b = ex.submit(rdv, r1, b"", 20)
        replies = {r0: a.result(), r1: b.result()}
    keys = set()
    for i, (code, reply, det) in replies.items():
        assert code == grpc.StatusCode.OK, det
        f = decode(reply)
        assert f.get(20) == good and f.get(3, 0) == (0 if i == r0 else 1), f
        keys.add(f.get(21))
    # One ring key for the generation's ranks: 64 random hex characters.
    (key,) = keys
    assert isinstance(key, bytes) and len(key) == 64 and all(c in b"0123456789abcdef" for c in key)
    # A rendezvous again (the ranks retry after a failed set-up): a new key.
    with cf.ThreadPoolExecutor(2) as ex:
        a = ex.submit(rdv, r0, good, 20)
        b = ex.submit(rdv, r1, b"", 20)
        again = [a.result(), b.result()]
    keys2 = set()
    for code, reply, det in again:
        assert code == grpc.StatusCode.OK, det
        keys2.add(decode(reply).get(21))
    assert len(keys2) == 1 and keys2 != keys, (keys, keys2)
    ch.close()
