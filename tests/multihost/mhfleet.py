"""mhfleet: a zcoord host and worker hosts on a Net (mhnet.py).

The coordinator listens on its host's address, so it runs secure by
default: the fleet has an API token and a worker secret. Each worker host
gets its own copy of the training data under its own directory, and its
roots are that directory: specs name data and checkpoints relative to the
roots ("data/train_*.bin", "ckpt"), and every host resolves them under its
own. The exact commands are the ones docs/deploy.md shows for machines.
"""
import json
import os
import shutil
import subprocess

from ztest import BIN, SLOW, http_get, wait_until

TOKEN = "mh-token-0123456789abcdef"
SECRET = "mh-secret-0123456789abcdef"
GRPC, HTTP = 7070, 8080


class Fleet:
    def __init__(self, net, data_dir, hb_ms=300, timeout_ms=3000, coord_extra=()):
        self.net, self.data_dir, self.hb_ms, self.timeout_ms = net, data_dir, hb_ms, timeout_ms
        self.coord_extra = tuple(coord_extra)
        self.coord_host = net.add_host("c")
        self.workers = {}  # name -> (host, Proc)
        self.coord = None
        self.start_coord()

    @property
    def grpc(self):
        return f"{self.coord_host.addr}:{GRPC}"

    def start_coord(self, name="zcoord"):
        h = self.coord_host
        ready = os.path.join(h.dir, "ready")
        if os.path.exists(ready):
            os.unlink(ready)
        self.coord = h.run(name, [
            f"{BIN}/zcoord", "--grpc", self.grpc, "--http", f"{h.addr}:{HTTP}",
            "--db", os.path.join(h.dir, "zcoord.db"), "--api-token", TOKEN,
            "--worker-secret", SECRET, "--data-root", h.dir, "--checkpoint-root", h.dir,
            "--heartbeat-ms", str(self.hb_ms), "--heartbeat-timeout-ms", str(self.timeout_ms),
            "--ready-file", ready, "--allow-test-knobs", *self.coord_extra])
        wait_until(lambda: os.path.exists(ready) or not self.coord.alive(), 10, "zcoord ready")
        assert self.coord.alive(), self.coord.output()
        return self.coord

    def add_worker(self, host_name, name=None, extra=()):
        h = self.net.hosts.get(host_name) or self.net.add_host(host_name)
        name = name or f"w{host_name}"
        data = os.path.join(h.dir, "data")
        if not os.path.isdir(data):
            shutil.copytree(self.data_dir, data)
        p = h.run(name, [
            f"{BIN}/zworker", "--coordinator", self.grpc, "--name", name, "--host", host_name,
            "--comm-host", h.addr, "--secret", SECRET, "--workdir", os.path.join(h.dir, "work"),
            "--data-root", h.dir, "--checkpoint-root", h.dir, "--threads", "1", *extra])
        self.workers[name] = (h, p)
        return p

    def api(self, path):
        return http_get(HTTP, path, host=self.coord_host.addr, timeout=5 * SLOW)[2]

    def workers_by_name(self):
        return {w["name"]: w for w in self.api("/v1/workers")["workers"]}

    def wait_alive(self, names, timeout=20):
        wait_until(lambda: all(self.workers_by_name().get(n, {}).get("state") == "alive"
                               for n in names), timeout, f"workers {names} alive")

    def zctl(self, *args, check=True):
        r = subprocess.run([f"{BIN}/zctl", "--coordinator", self.grpc, "--token", TOKEN, *args],
                           capture_output=True, text=True, timeout=30 * SLOW)
        if check and r.returncode != 0:
            raise AssertionError(f"zctl {' '.join(args)}: {r.stderr}")
        return r

    def submit(self, spec, path):
        with open(path, "w") as f:
            json.dump(spec, f)
        return int(json.loads(self.zctl("--json", "submit", path).stdout)["job_id"])

    def job(self, jid):
        return self.api(f"/v1/jobs/{jid}")

    def wait_job(self, jid, timeout=180, states=("completed",)):
        def done():
            j = self.job(jid)
            assert j["state"] not in ("failed", "canceled") or j["state"] in states, j
            return j if j["state"] in states else None
        return wait_until(done, timeout, f"job {jid} to reach {states}", interval=0.1)

    def losses(self, jid):
        return {s["step"]: s["loss"] for s in self.api(f"/v1/jobs/{jid}/metrics")["steps"]}

    def events(self, jid):
        return self.api(f"/v1/events?job={jid}&limit=100000")["events"]
