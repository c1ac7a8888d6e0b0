"""A rollback's arguments from the network and the command line: to_step
and skip are integers in 0..the job's steps. Every other value (a
fraction, 1e-300, 1e300, a negative number, past the last step, a string)
is refused on each front end, naming the field and the allowed range:
HTTP 400, gRPC INVALID_ARGUMENT, zctl exit status 1 before anything is
sent. The job is untouched: same state, no rollback in its logbook. A
valid rollback afterwards is accepted, so the refusals were the
arguments', not the job state's."""
import json
import urllib.request

import grpc
import pytest

from test_grpc_python import stubs
from ztest import byte_dataset, events, http_get, submit, tiny_spec, zctl

STEPS = 5


def post(port, path, raw):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=raw, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def snapshot(coord, jid):
    j = http_get(coord.http_port, f"/v1/jobs/{jid}")[2]
    kinds = [e["kind"] for e in events(coord, job=jid)]
    return ({k: j[k] for k in ("state", "step", "generation", "restarts", "message")},
            [k for k in kinds if k.startswith("rollback")])


@pytest.fixture
def pending(procs, tmp_path):
    """A zcoord with a job and no workers: the job stays pending, a state
    that takes a rollback."""
    train, val = byte_dataset(str(tmp_path / "data"), limit=60_000)
    coord = procs.coord(hb_ms=200)
    jid = submit(coord, tiny_spec(train, val, STEPS), tmp_path)
    assert http_get(coord.http_port, f"/v1/jobs/{jid}")[2]["state"] == "pending"
    return coord, jid


RANGE = f"0..{STEPS}"


def test_http_rollback_arguments(pending):
    coord, jid = pending
    before = snapshot(coord, jid)
    path = f"/v1/jobs/{jid}/rollback"
    cases = [
        ('{"to_step": 1e-300}', "to_step", "1e-300"),
        ('{"to_step": 1e300}', "to_step", "1e+300"),
        ('{"to_step": -1}', "to_step", "-1"),
        ('{"to_step": 2.5}', "to_step", "2.5"),
        (f'{{"to_step": {STEPS + 1}}}', "to_step", str(STEPS + 1)),
        ('{"to_step": 9223372036854775807}', "to_step", None),
        ('{"to_step": "3"}', "to_step", "a string"),
        ('{"to_step": true}', "to_step", "a boolean"),
        ('{"to_step": null}', "to_step", "null"),
        ('{"to_step": 0, "skip": -1}', "skip", "-1"),
        ('{"to_step": 0, "skip": 1e-300}', "skip", "1e-300"),
        ('{"to_step": 0, "skip": 1e300}', "skip", "1e+300"),
        ('{"to_step": 0, "skip": 0.5}', "skip", "0.5"),
        (f'{{"to_step": 0, "skip": {STEPS + 1}}}', "skip", str(STEPS + 1)),
    ]
    for body, field, got in cases:
        code, reply = post(coord.http_port, path, body.encode())
        err = reply.get("error", "")
        assert code == 400, (body, code, reply)
        assert f"{field} must be an integer in {RANGE}" in err, (body, err)
        assert got is None or err.endswith(f"got {got}"), (body, err)
        assert "--to-step" not in err and "--skip" not in err, (body, err)
    for body, why in ((b"", "rollback needs a JSON body"),
                      (b"{\"to_step\": ", "malformed JSON"),
                      (b"[1]", "JSON object"),
                      (b"{}", f"needs to_step, an integer in {RANGE}"),
                      (b'{"to_step": 1, "skp": 1}', 'unknown field "skp"'),
                      (b'{"to_step": 1, "to_step": 2}', '"to_step" given twice')):
        code, reply = post(coord.http_port, path, body)
        assert code == 400 and why in reply["error"], (body, code, reply)
    assert snapshot(coord, jid) == before
    # An integral value in range is taken, written either way.
    code, reply = post(coord.http_port, path, b'{"to_step": 0.0, "skip": 2}')
    assert code == 200, reply
    assert "rollback_requested" in snapshot(coord, jid)[1]


def test_grpc_rollback_arguments(pending, tmp_path):
    coord, jid = pending
    pb, pbg = stubs(tmp_path)
    before = snapshot(coord, jid)
    big = 2**63 - 1
    with grpc.insecure_channel(coord.grpc) as ch:
        status = pbg.StatusStub(ch)
        for to, skip, field, got in ((-1, 0, "to_step", -1), (STEPS + 1, 0, "to_step", STEPS + 1),
                                     (big, 0, "to_step", big), (-big - 1, 0, "to_step", -big - 1),
                                     (0, -1, "skip_steps", -1), (0, STEPS + 1, "skip_steps", STEPS + 1),
                                     (0, big, "skip_steps", big)):
            with pytest.raises(grpc.RpcError) as e:
                status.JobAction(pb.JobActionRequest(job_id=jid, action="rollback", to_step=to,
                                                     skip_steps=skip), timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (to, skip, e.value)
            d = e.value.details()
            assert f"{field} must be an integer in {RANGE}" in d and d.endswith(f"got {got}"), \
                (to, skip, d)
        assert snapshot(coord, jid) == before
        r = status.JobAction(pb.JobActionRequest(job_id=jid, action="rollback", to_step=STEPS,
                                                 skip_steps=STEPS), timeout=5)
        assert "rolling back" in r.message, r.message
    assert "rollback_requested" in snapshot(coord, jid)[1]


def test_zctl_rollback_flags(pending):
    coord, jid = pending
    before = snapshot(coord, jid)
    for args, flag in ((["--to-step", "-1"], "--to-step"), (["--to-step", "1e300"], "--to-step"),
                       (["--to-step", "1e-300"], "--to-step"), (["--to-step", "2.5"], "--to-step"),
                       (["--to-step", str(STEPS + 1)], "--to-step"),
                       (["--to-step", "99999999999999999999"], "--to-step"),
                       (["--to-step", "1", "--skip", "-1"], "--skip"),
                       (["--to-step", "1", "--skip", str(STEPS + 1)], "--skip")):
        r = zctl(coord.grpc, "rollback", str(jid), *args, check=False)
        assert r.returncode == 1 and r.stdout == "", (args, r.returncode, r.stdout, r.stderr)
        assert f"rollback: {flag}: expected an integer in {RANGE} (job {jid} has {STEPS} steps)" \
            in r.stderr, (args, r.stderr)
    r = zctl(coord.grpc, "pause", str(jid), "--to-step", "1", check=False)
    assert r.returncode == 1 and "pause: unknown option --to-step" in r.stderr, r.stderr
    assert snapshot(coord, jid) == before
    assert "rolling back" in zctl(coord.grpc, "rollback", str(jid), "--to-step", "1",
                                  "--skip", "0").stdout
    assert "rollback_requested" in snapshot(coord, jid)[1]
