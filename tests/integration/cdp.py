"""cdp.py: headless Chromium driven over the DevTools protocol, for tests
that watch one page over time (a dashboard refreshing itself).

Chromium speaks the protocol over a pipe (--remote-debugging-pipe: it
reads commands from fd 3 and writes replies to fd 4, each message JSON
ended by a NUL byte), so nothing beyond the standard library is needed.
Every wait has a deadline.
"""
import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import time

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, log, width=1280, height=1000, timeout=60):
        """log: a file for Chromium's own messages."""
        self.timeout = timeout
        self.log_path = log
        self.log = open(log, "ab")
        to_chrome_r, to_chrome_w = os.pipe()
        from_chrome_r, from_chrome_w = os.pipe()
        # High descriptors, so that moving them to 3 and 4 in the child
        # cannot overwrite one with the other.
        hi_r = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD_CLOEXEC, 20)
        hi_w = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD_CLOEXEC, 20)
        os.close(to_chrome_r)
        os.close(from_chrome_w)

        def fds_3_4():
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)
        self.p = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--remote-debugging-pipe",
             f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
            pass_fds=(3, 4), preexec_fn=fds_3_4)
        os.close(hi_r)
        os.close(hi_w)
        self.w, self.r = to_chrome_w, from_chrome_r
        self.buf = b""
        self.next_id = 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width,
                  height=height, deviceScaleFactor=1, mobile=False)

    def _read_message(self, deadline):
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.r], [], [], left)[0]:
                raise AssertionError("chromium did not answer in time")
            chunk = os.read(self.r, 1 << 16)
            if not chunk:
                with open(self.log_path, "rb") as f:
                    raise AssertionError("chromium closed the pipe: "
                                         + f.read().decode(errors="replace")[-2000:])
            self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method, session=False, **params):
        """Sends one command and returns its result (events are dropped)."""
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") != self.next_id:
                continue
            if "error" in reply:
                raise AssertionError(f"{method}: {reply['error']}")
            return reply["result"]

    def navigate(self, url):
        self.call("Page.navigate", session=True, url=url)

    def eval(self, expression):
        """The value of a JavaScript expression in the page (JSON-able)."""
        r = self.call("Runtime.evaluate", session=True, expression=expression,
                      returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise AssertionError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def dom(self):
        """The page's DOM as HTML, as --dump-dom writes it."""
        return self.eval("document.documentElement.outerHTML")

    def screenshot(self, path):
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self):
        try:
            self.call("Browser.close")
        except AssertionError:
            pass
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        os.close(self.w)
        os.close(self.r)
        self.log.close()
