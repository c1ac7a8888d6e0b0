"""The HTTP/JSON API and /metrics, with curl, against a live zcoord that
runs a real job: every endpoint, content types, 400/401/404/405/413, and a
strict check of the Prometheus text exposition format."""
import json
import re
import subprocess

import pytest

from ztest import (byte_dataset, http_get, tiny_spec, wait_job, wait_until, workers_by_name)

TOKEN = "s3cr3t-token"


def curl(port, path, method="GET", data=None, token=None, headers=()):
    cmd = ["curl", "-s", "-S", "-X", method, "-o", "-", "-w", "\n%{http_code} %{content_type}",
           f"http://127.0.0.1:{port}{path}"]
    if token:
        cmd += ["-H", f"Authorization: Bearer {token}"]
    for h in headers:
        cmd += ["-H", h]
    if data is not None:
        cmd += ["--data-binary", "@-", "-H", "Content-Type: application/json"]
    r = subprocess.run(cmd, input=data.encode() if isinstance(data, str) else data,
                       capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    body, _, tail = r.stdout.rpartition(b"\n")
    code, _, ctype = tail.decode().partition(" ")
    return int(code), ctype, body


def js(port, path, **kw):
    code, ctype, body = curl(port, path, **kw)
    assert ctype.startswith("application/json"), (path, ctype)
    return code, json.loads(body)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from ztest import Procs
    tmp = tmp_path_factory.mktemp("http")
    procs = Procs(tmp)
    train, val = byte_dataset(str(tmp / "data"), 200_000)
    coord = procs.coord(hb_ms=300, extra=["--api-token", TOKEN])
    for i in range(2):
        procs.worker(coord.grpc, f"w{i}", extra=["--threads", "1"])
    wait_until(lambda: len(workers_by_name(coord)) == 2, 20, "workers")
    spec = tiny_spec(train, val, 60, stage=2, workers=2,
                     checkpoint={"dir": str(tmp / "ck"), "every_steps": 20})
    code, body = js(coord.http_port, "/v1/jobs", method="POST", data=json.dumps(spec),
                    token=TOKEN)
    assert code == 201, body
    jid = body["job_id"]
    wait_job(coord, jid)
    yield coord, jid, spec
    procs.close()


def test_read_endpoints(live):
    coord, jid, _ = live
    p = coord.http_port
    code, h = js(p, "/healthz")
    assert code == 200 and h["ok"] is True
    code, st = js(p, "/v1/status")
    assert code == 200 and st["workers"]["alive"] == 2
    code, w = js(p, "/v1/workers")
    assert code == 200 and {x["name"] for x in w["workers"]} == {"w0", "w1"}
    code, j = js(p, f"/v1/jobs/{jid}")
    assert code == 200 and j["state"] == "completed" and j["step"] == 60
    for k in ("generation", "world", "loss", "tokens_per_s", "restarts", "message"):
        assert k in j
    code, jobs = js(p, "/v1/jobs")
    assert code == 200 and [x["id"] for x in jobs["jobs"]] == [jid]
    code, m = js(p, f"/v1/jobs/{jid}/metrics?from=10&to=19")
    assert code == 200 and [s["step"] for s in m["steps"]] == list(range(10, 20))
    code, ev = js(p, f"/v1/jobs/{jid}/events")
    assert code == 200 and "job_completed" in [e["kind"] for e in ev["events"]]
    code, ck = js(p, f"/v1/jobs/{jid}/checkpoints")
    assert code == 200 and [c["step"] for c in ck["checkpoints"]] == [20, 40, 60]
    code, ev = js(p, "/v1/events?limit=2")
    assert code == 200 and len(ev["events"]) == 2
    # tail: the newest, oldest first (the dashboard's logbook starts there).
    code, every = js(p, "/v1/events?limit=100000")
    ids = [e["id"] for e in every["events"]]
    code, ev = js(p, "/v1/events?tail=3")
    assert code == 200 and [e["id"] for e in ev["events"]] == ids[-3:]
    code, ev = js(p, f"/v1/events?tail=2&after={ids[-2]}")
    assert [e["id"] for e in ev["events"]] == ids[-1:]
    code, every = js(p, f"/v1/jobs/{jid}/events")
    jids = [e["id"] for e in every["events"]]
    code, ev = js(p, f"/v1/jobs/{jid}/events?tail=2")
    assert code == 200 and [e["id"] for e in ev["events"]] == jids[-2:]
    code, ev = js(p, f"/v1/jobs/{jid}/events?after={jids[0]}&limit=1")
    assert [e["id"] for e in ev["events"]] == jids[1:2]
    assert js(p, "/v1/events?tail=-1")[0] == 400
    code, ctype, body = curl(p, "/")
    assert code == 200 and ctype.startswith("text/html") and b"<canvas" in body
    code, ctype, _ = curl(p, "/static/app.js")
    assert code == 200 and ctype.startswith("text/javascript")
    code, ctype, body = curl(p, "/static/chart.js")
    assert code == 200 and b"Chart.js" in body[:200]


def test_error_statuses(live):
    coord, jid, spec = live
    p = coord.http_port
    # 401: mutating calls need the token.
    code, b = js(p, "/v1/jobs", method="POST", data=json.dumps(spec))
    assert code == 401 and "Bearer" in b["error"]
    code, b = js(p, "/v1/jobs", method="POST", data=json.dumps(spec), token="wrong")
    assert code == 401
    code, b = js(p, f"/v1/jobs/{jid}/pause", method="POST")
    assert code == 401
    # 400: malformed JSON, with the reason; unknown key, naming it.
    code, b = js(p, "/v1/jobs", method="POST", data='{"steps": 5,', token=TOKEN)
    assert code == 400 and "malformed JSON" in b["error"]
    bad = dict(spec, optimizer={"type": "AdamW", "params": {"lrr": 1}})
    code, b = js(p, "/v1/jobs", method="POST", data=json.dumps(bad), token=TOKEN)
    assert code == 400 and "optimizer.params.lrr" in b["error"], b
    code, b = js(p, "/v1/events?limit=x")
    assert code == 400
    # 404: unknown paths, jobs, actions, workers.
    assert js(p, "/v1/nope")[0] == 404
    assert js(p, "/v1/jobs/999")[0] == 404
    assert js(p, "/v1/jobs/999/pause", method="POST", token=TOKEN)[0] == 404
    assert js(p, f"/v1/jobs/{jid}/explode", method="POST", token=TOKEN)[0] == 404
    assert js(p, "/v1/workers/nobody/drain", method="POST", token=TOKEN)[0] == 404
    assert curl(p, "/static/../zcoord.db")[0] == 404
    # 405 with Allow.
    r = subprocess.run(["curl", "-s", "-i", "-X", "DELETE", f"http://127.0.0.1:{p}/v1/jobs"],
                       capture_output=True, text=True, timeout=30)
    assert " 405 " in r.stdout.splitlines()[0] and "Allow: GET, POST" in r.stdout
    # 413: bodies over 1 MiB are refused without being buffered.
    code, b = js(p, "/v1/jobs", method="POST", data=b"{" + b" " * (2 << 20) + b"}", token=TOKEN)
    assert code == 413 and "larger than" in b["error"]
    # 409: an action that does not fit the job's state.
    code, b = js(p, f"/v1/jobs/{jid}/pause", method="POST", token=TOKEN)
    assert code == 409 and "completed" in b["error"]
    # Mutations with the token work: submit, pause, resume, cancel, drain.
    code, b = js(p, "/v1/jobs", method="POST", data=json.dumps(dict(spec, steps=100000)),
                 token=TOKEN)
    assert code == 201
    j2 = b["job_id"]
    wait_until(lambda: js(p, f"/v1/jobs/{j2}")[1]["state"] == "running", 30, "second job")
    assert js(p, f"/v1/jobs/{j2}/pause", method="POST", token=TOKEN)[0] == 200
    assert js(p, f"/v1/jobs/{j2}")[1]["state"] == "paused"
    assert js(p, f"/v1/jobs/{j2}/resume", method="POST", token=TOKEN)[0] == 200
    code, b = js(p, f"/v1/jobs/{j2}/rollback", method="POST", data='{"to_step": 0}',
                 token=TOKEN)
    assert code == 200, b
    code, b = js(p, "/v1/workers/w1/drain", method="POST", token=TOKEN)
    assert code == 200 and "w1" in b["message"]
    assert js(p, f"/v1/jobs/{j2}/cancel", method="POST", token=TOKEN)[0] == 200
    assert js(p, f"/v1/jobs/{j2}")[1]["state"] == "canceled"
    # A paused job can be canceled; a canceled one cannot be again.
    code, b = js(p, "/v1/jobs", method="POST", data=json.dumps(dict(spec, steps=100000)),
                 token=TOKEN)
    j3 = b["job_id"]
    assert js(p, f"/v1/jobs/{j3}/pause", method="POST", token=TOKEN)[0] == 200
    assert js(p, f"/v1/jobs/{j3}/cancel", method="POST", token=TOKEN)[0] == 200
    assert js(p, f"/v1/jobs/{j3}")[1]["state"] == "canceled"
    code, b = js(p, f"/v1/jobs/{j3}/cancel", method="POST", token=TOKEN)
    assert code == 409 and "canceled" in b["error"]


METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? (\S+)$")
LABEL = re.compile(r'^[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\["\\n])*"$')


def check_exposition(text):
    """Strict text-format 0.0.4 check; returns {family: type}."""
    assert text.endswith("\n")
    types, helps, seen = {}, set(), set()
    current = None
    for line in text.splitlines():
        assert line == line.strip() and line, repr(line)
        if line.startswith("# HELP "):
            name = line.split()[2]
            assert name not in helps, f"second HELP for {name}"
            helps.add(name)
            continue
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ", 3)
            assert typ in ("counter", "gauge", "histogram", "summary", "untyped")
            assert name not in types, f"second TYPE for {name}"
            types[name] = typ
            current = name
            continue
        assert not line.startswith("#"), line
        m = METRIC.match(line)
        assert m, f"bad sample line: {line!r}"
        name, labels, value = m.group(1), m.group(3), m.group(4)
        assert name == current, f"{name} outside its family block ({current})"
        float(value)  # parses, including NaN/+Inf
        if labels:
            for pair in labels.split(","):
                assert LABEL.match(pair), f"bad label {pair!r}"
        key = (name, labels)
        assert key not in seen, f"duplicate series {key}"
        seen.add(key)
    for name, typ in types.items():
        assert name.startswith("ztrain_"), name
        assert (typ == "counter") == name.endswith("_total"), name
        assert name in helps
    return types


def test_metrics_exposition(live):
    coord, jid, _ = live
    code, ctype, body = curl(coord.http_port, "/metrics")
    assert code == 200 and ctype.startswith("text/plain; version=0.0.4")
    text = body.decode()
    types = check_exposition(text)
    for fam in ("ztrain_workers", "ztrain_jobs", "ztrain_job_steps_total",
                "ztrain_job_restarts_total", "ztrain_job_loss", "ztrain_job_learning_rate",
                "ztrain_job_tokens_per_second", "ztrain_job_world_size",
                "ztrain_job_tokens_total", "ztrain_job_rollbacks_total",
                "ztrain_job_checkpoints_total"):
        assert fam in types, fam
    assert f'ztrain_job_steps_total{{job_id="{jid}"}} 60' in text
    assert f'ztrain_job_tokens_total{{job_id="{jid}"}} {60 * 24 * 32}' in text
    assert f'ztrain_job_checkpoints_total{{job_id="{jid}"}} 3' in text  # 20, 40, the final 60
    assert 'ztrain_workers{state="alive"} 2' in text


def raw_request(port, head, body=b"", timeout=10):
    """Sends a request's head (and the start of its body) on a socket and
    returns what the server answers before `timeout`, or b"" if nothing."""
    import socket
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + body)
        try:
            return s.recv(4096)
        except socket.timeout:
            return b""


def test_unauthenticated_body_is_not_read(live):
    """A mutating request without the token is refused as soon as its head
    is in: its body (here announced as 1,000,000 bytes, 10 sent) is never
    waited for or buffered. So is a body announced above the limit."""
    coord, _, _ = live
    p = coord.http_port
    head = (b"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000\r\n\r\n")
    answer = raw_request(p, head, b"{\"steps\": 1")
    assert answer.startswith(b"HTTP/1.1 401"), answer
    head = (b"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            + TOKEN.encode() + b"\r\nContent-Length: 5000000\r\n\r\n")
    answer = raw_request(p, head, b"{")
    assert answer.startswith(b"HTTP/1.1 413"), answer


def test_browser_requests_without_token(procs, tmp_path):
    """With no api_token (the loopback default) a web page the operator
    opens may not change state (a cross-site Origin is refused) nor read the
    API through a name of its own pointed at 127.0.0.1 (Host is checked);
    the dashboard itself, curl and zctl are unaffected."""
    train, val = byte_dataset(str(tmp_path / "data"), 20_000)
    coord = procs.coord(hb_ms=300)
    p = coord.http_port
    spec = json.dumps(tiny_spec(train, val, 5, workers=1))
    code, b = js(p, "/v1/jobs", method="POST", data=spec, headers=["Origin: http://evil.example"])
    assert code == 403 and "cross-site" in b["error"] and "evil.example" in b["error"], b
    code, b = js(p, "/v1/jobs", method="POST", data=spec, headers=["Origin: null"])
    assert code == 403, b
    assert js(p, "/v1/jobs")[1]["jobs"] == []
    code, b = js(p, "/v1/jobs", method="POST", data=spec, headers=[f"Origin: http://127.0.0.1:{p}"])
    assert code == 201, b
    jid = b["job_id"]
    code, b = js(p, f"/v1/jobs/{jid}/cancel", method="POST",
                 headers=["Origin: https://localhost.evil.example"])
    assert code == 403, b
    assert js(p, f"/v1/jobs/{jid}")[1]["state"] != "canceled"
    code, b = js(p, "/v1/jobs", headers=["Host: evil.example:7080"])
    assert code == 403 and "evil.example" in b["error"], b
    code, b = js(p, "/v1/jobs", headers=["Host: 127.0.0.1.evil.example"])
    assert code == 403, b
    for host in (f"localhost:{p}", f"127.0.0.1:{p}", "127.0.0.1", "[::1]:80"):
        code, b = js(p, "/v1/jobs", headers=[f"Host: {host}"])
        assert code == 200 and [j["id"] for j in b["jobs"]] == [jid], (host, b)
    code, b = js(p, f"/v1/jobs/{jid}/cancel", method="POST")
    assert code == 200, b


def test_half_closed_connections_do_not_lock_out(procs):
    """A client that half-closes its connection after each request
    (shutdown(SHUT_WR)) gets its answer and the connection closed at once,
    so 100 of them in a row leave no connection open and lock nobody out: a
    normal request right after is served. Connections an address holds
    without using them (64, the per-address limit; keep-alive after an
    answered request) are closed after 10 s idle, so they lock the address
    out for no longer than that."""
    import socket
    import time
    coord = procs.coord(hb_ms=300)
    p = coord.http_port
    req = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    for i in range(100):
        with socket.create_connection(("127.0.0.1", p), timeout=5) as s:
            s.sendall(req)
            s.shutdown(socket.SHUT_WR)
            answer = b""
            try:
                while True:  # the server's end of stream ends the answer
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    answer += chunk
            except socket.timeout:
                raise AssertionError(f"request {i}: the connection was still open 5 s after "
                                     f"its answer {answer!r}")
            assert answer.startswith(b"HTTP/1.1 200") and b'"ok":true' in answer, (i, answer)
    t0 = time.monotonic()
    code, _, h = http_get(p, "/healthz", timeout=2)
    assert code == 200 and h["ok"] is True and time.monotonic() - t0 < 2
    held = []
    try:
        for i in range(64):
            s = socket.create_connection(("127.0.0.1", p), timeout=5)
            held.append(s)
            s.sendall(req)
            answer = b""
            while b'"ok":true' not in answer:
                chunk = s.recv(65536)
                assert chunk, (i, answer)
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), (i, answer)

        def served():
            code, _, h = http_get(p, "/healthz", timeout=2)
            return code == 200 and h["ok"] is True
        wait_until(served, 12, "a request from the address that holds 64 idle connections",
                   interval=0.2)
        for s in held:  # the server closed them
            s.settimeout(1)
            assert s.recv(100) == b""
    finally:
        for s in held:
            s.close()
