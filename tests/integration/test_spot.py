"""Cloud preemption notices (zworker --spot-notice, worker/spot.c).

The clouds' metadata services cannot be reached from here, so each test
runs a local HTTP server on 127.0.0.1 that speaks one cloud's protocol as
its documentation gives it (AWS IMDSv2 with session tokens, GCP's
instance/preempted with Metadata-Flavor, Azure's Scheduled Events with
their acknowledgement), and real zcoord and zworker processes train a job
while it answers. A notice drains the worker at a checkpoint (no step is
trained twice) and the logbook names it; a service that is slow, down,
talks garbage or expires its tokens never stops training and is backed
off, not hammered.
"""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ztest import (byte_dataset, events, job, start_fleet, submit, tiny_spec, wait_job,
                   wait_until)

AZURE = "/metadata/scheduledevents?api-version=2020-07-01"


class Meta(ThreadingHTTPServer):
    """One cloud's metadata service. mode: "none" (no notice yet),
    "notice", "slow" (answers after 3 s), "garbage" (bytes that are no
    HTTP), "expired" (aws: a token lives 2 s, not the 6 hours asked for)."""
    daemon_threads = True

    def __init__(self, cloud, mode="none"):
        super().__init__(("127.0.0.1", 0), Handler)
        self.cloud, self.mode = cloud, mode
        self.requests, self.acks, self.tokens = [], [], {}
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self):
        return f"127.0.0.1:{self.server_address[1]}"

    def count(self, since=0.0):
        return sum(1 for t, _ in self.requests if t >= since)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def reply(self, status, body=b"", ctype="text/plain"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def handle_any(self, method):
        m = self.server
        m.requests.append((time.monotonic(), f"{method} {self.path}"))
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        if m.mode == "garbage":
            self.wfile.write(b"\x00\xff\x13 not http at all\r\n\r\n")
            self.close_connection = True
            return
        if m.mode == "slow":
            time.sleep(3)
        getattr(self, m.cloud)(method, body)

    def do_GET(self):
        self.handle_any("GET")

    def do_PUT(self):
        self.handle_any("PUT")

    def do_POST(self):
        self.handle_any("POST")

    def aws(self, method, body):
        m = self.server
        if method == "PUT" and self.path == "/latest/api/token":
            if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return self.reply(400)
            tok = f"AQAEA-token-{len(m.tokens)}"
            m.tokens[tok] = time.monotonic()
            return self.reply(200, tok.encode())
        tok = self.headers.get("X-aws-ec2-metadata-token")
        if tok not in m.tokens or (m.mode == "expired" and time.monotonic() - m.tokens[tok] > 2):
            return self.reply(401)
        if self.path == "/latest/meta-data/spot/instance-action":
            if m.mode == "notice":
                return self.reply(200, json.dumps(
                    {"action": "terminate", "time": "2026-11-27T17:00:00Z"}).encode(),
                    "application/json")
            return self.reply(404)
        if self.path == "/latest/meta-data/events/recommendations/rebalance":
            return self.reply(404)
        return self.reply(404)

    def gcp(self, method, body):
        if self.headers.get("Metadata-Flavor") != "Google":
            return self.reply(403)
        if self.path.startswith("/computeMetadata/v1/instance/preempted"):
            return self.reply(200, b"TRUE" if self.server.mode == "notice" else b"FALSE")
        return self.reply(404)

    def azure(self, method, body):
        m = self.server
        if self.headers.get("Metadata") != "true" or self.path != AZURE:
            return self.reply(400)
        if method == "POST":
            m.acks.append(json.loads(body))
            return self.reply(200)
        ev = [{"EventId": "602d9444-d2cd-49c7-8624-8643e7171297", "EventType": "Preempt",
               "ResourceType": "VirtualMachine", "Resources": ["vm1"],
               "EventStatus": "Scheduled", "NotBefore": "Fri, 27 Nov 2026 17:00:00 GMT",
               "EventSource": "Platform", "DurationInSeconds": -1}]
        doc = {"DocumentIncarnation": 2 if m.mode == "notice" else 1,
               "Events": ev if m.mode == "notice" else []}
        return self.reply(200, json.dumps(doc).encode(), "application/json")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return byte_dataset(str(tmp_path_factory.mktemp("data")), limit=200_000)


def spot_args(meta, kind=None):
    return ["--spot-notice", kind or meta.cloud, "--spot-endpoint", meta.endpoint,
            "--spot-poll-ms", "200"]


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_a_notice_drains_at_a_checkpoint(procs, tmp_path, data, cloud):
    """A notice mid-run: the worker drains at the next checkpoint and
    leaves (exit 0), the job goes on with the other worker from that very
    step, and the logbook says which notice it was. Azure's event is
    acknowledged once the worker has left."""
    train, val = data
    meta = Meta(cloud)
    kind = "auto" if cloud == "gcp" else cloud  # auto finds the protocol by itself
    coord = start_fleet(procs, names=["w0", "w1"], extra_by_name={"w1": spot_args(meta, kind)})
    spec = tiny_spec(train, val, 3000, stage=1, workers=1, max_workers=2,
                     checkpoint={"dir": str(tmp_path / "ck"), "every_steps": 25})
    jid = submit(coord, spec, tmp_path)
    wait_until(lambda: job(coord, jid)["world"] == 2 and job(coord, jid)["step"] >= 30, 60,
               "both workers training")
    meta.mode = "notice"
    w1 = coord.workers["w1"]
    assert w1.wait(30) == 0, w1.output()[-3000:]
    out = w1.output()
    assert f"spot notice ({cloud})" in out and "draining" in out, out[-3000:]
    wait_job(coord, jid, timeout=120)
    ev = events(coord, job=jid)
    drained = [e["detail"] for e in ev if e["kind"] == "drained"]
    assert len(drained) == 1, [(e["kind"], e["detail"]) for e in ev]
    left_at = int(drained[0].rsplit(" ", 1)[1])
    # (a row that collapsed repeats has its latest occurrence's detail too)
    starts = [e.get("last_detail") or e["detail"] for e in ev if e["kind"] == "generation_started"]
    assert f"start step {left_at}," in starts[-1], (drained, starts)
    reasons = [e["detail"] for e in events(coord) if f"spot notice ({cloud})" in e["detail"]]
    assert reasons, [(e["kind"], e["detail"]) for e in events(coord)][-10:]
    if cloud == "azure":
        assert meta.acks == [{"StartRequests": [
            {"EventId": "602d9444-d2cd-49c7-8624-8643e7171297"}]}], meta.acks


def test_broken_metadata_services_are_backed_off_and_training_goes_on(procs, tmp_path, data):
    """Four workers, each with a broken service: one answering after 3 s
    (the deadline is 1 s), one talking garbage, one down, one whose tokens
    expire early. The job trains to the end on all four; a failing service
    is asked a bounded number of times (backoff from 1 s up), an expired
    token is replaced, and each worker logs the failure with its reason."""
    train, val = data
    slow, garbage, expired = Meta("aws", "slow"), Meta("gcp", "garbage"), Meta("aws", "expired")
    down = Meta("azure")
    down_ep = down.endpoint
    down.shutdown()
    down.server_close()
    extra = {"w0": spot_args(slow), "w1": spot_args(garbage), "w3": spot_args(expired),
             "w2": ["--spot-notice", "azure", "--spot-endpoint", down_ep, "--spot-poll-ms",
                    "200"]}
    coord = start_fleet(procs, 4, extra_by_name=extra)
    t0 = time.monotonic()
    spec = tiny_spec(train, val, 2500, stage=2, workers=4,
                     checkpoint={"dir": str(tmp_path / "ck"), "every_steps": 100})
    jid = submit(coord, spec, tmp_path)
    wait_until(lambda: time.monotonic() - t0 > 8, 30, "eight seconds of training")
    span = time.monotonic() - t0
    j = wait_job(coord, jid, timeout=180)
    assert j["world"] == 4 and not [e for e in events(coord, job=jid)
                                    if e["kind"] in ("drained", "worker_lost")]
    # Backed off: 1, 2, 4, 8 s... after each failure; the slow one's
    # requests also wait out their 1 s deadline. A poll every 200 ms
    # without backoff would be 40 or more in 8 s.
    for meta in (slow, garbage):
        assert 1 <= meta.count(t0) <= 10, (meta.cloud, meta.mode, meta.requests, span)
    puts = [r for _, r in expired.requests if r.startswith("PUT")]
    assert len(puts) >= 3, expired.requests[-10:]  # a new token after each expiry
    logs = {n: p.output() for n, p in coord.workers.items()}
    assert "no answer within 1000 ms" in logs["w0"], logs["w0"][-2000:]
    assert "not an HTTP answer" in logs["w1"], logs["w1"][-2000:]
    assert "Connection refused" in logs["w2"], logs["w2"][-2000:]
    assert "token expired" in logs["w3"], logs["w3"][-2000:]
    assert all(p.alive() for p in coord.workers.values())
