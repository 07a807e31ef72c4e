"""Screenshots of the MLflow UI as a new user sees it, from headless Chromium (Debian's ``chromium`` package), to
check what the UI shows of maxout's runs (names, descriptions, the model-training view) and to keep one in the
README.

    python benchmarks/ui_screenshot.py URL OUT.png [--click TEXT ...] [--size 1400x900]

``URL`` is any page of a running ``mlflow ui`` (``make ui`` prints the runs table's; ``maxout audit`` its run's).
``--click`` clicks, in order, the first element whose text or aria-label is TEXT (e.g. "Show more" to unfold a
run's description, or "Close" for MLflow's assistant panel) before the screenshot. Chromium is driven through its
DevTools protocol over a pipe (``--remote-debugging-pipe``): the standard library is enough, no browser driver.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--remote-debugging-pipe"]
CLICK = """(() => {
  const want = %s;
  const all = [...document.querySelectorAll('button, a, [role=button], span, div')];
  const hit = all.find(e => e.getAttribute('aria-label') === want)
    || all.find(e => e.children.length === 0 && e.textContent.trim() === want)
    || all.find(e => e.textContent.trim() === want);
  if (!hit) return false;
  hit.click();
  return true;
})()"""


class Browser:
    """Chromium with the DevTools protocol on fds 3 (commands in) and 4 (replies out), NUL-separated JSON."""

    def __init__(self) -> None:
        self.profile = tempfile.mkdtemp(prefix="maxout-chromium-")
        to_chrome, self._send_fd = os.pipe()
        self._recv_fd, from_chrome = os.pipe()

        def fds() -> None:  # in the child: the protocol pipes where Chromium expects them
            os.dup2(to_chrome, 3)
            os.dup2(from_chrome, 4)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        binary = shutil.which("chromium") or shutil.which("chromium-browser") or "chromium"
        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     close_fds=False, preexec_fn=fds,  # close_fds would close 3 and 4 after fds()
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "TMPDIR": self.profile})  # its scratch goes with the profile
        os.close(to_chrome)
        os.close(from_chrome)
        self._buffer, self._next = b"", 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def call(self, method: str, session: bool = False, **params: object) -> dict:
        self._next += 1
        message = {"id": self._next, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._send_fd, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._recv_fd, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed its DevTools pipe")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def page(self, method: str, **params: object) -> dict:
        return self.call(method, session=True, **params)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.profile, ignore_errors=True)


def wait_for(browser: Browser, expression: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if browser.page("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value"):
            return True
        time.sleep(0.5)
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--click", action="append", default=[], metavar="TEXT")
    parser.add_argument("--size", default="1400x900")
    parser.add_argument("--wait-for", default=None, metavar="TEXT",
                        help="wait until the page shows this text (default: MLflow's run or runs page heading)")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    browser = Browser()
    try:
        browser.page("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                     mobile=False)
        browser.page("Page.enable")
        browser.page("Page.navigate", url=args.url)
        shown = json.dumps(args.wait_for or "")
        if not wait_for(browser, f"document.body && document.body.innerText.includes({shown})", 60):
            raise SystemExit(f"the page never showed {args.wait_for!r}: is `mlflow ui` up at {args.url}?")
        time.sleep(3)  # tables and charts fill in after the heading
        for text in args.click:
            if not browser.page("Runtime.evaluate", expression=CLICK % json.dumps(text),
                                returnByValue=True)["result"].get("value"):
                raise SystemExit(f"nothing to click with the text or label {text!r}")
            time.sleep(1.5)
        png = base64.b64decode(browser.page("Page.captureScreenshot", format="png")["data"])
        Path(args.out).write_bytes(png)
        print(f"{args.out}: {len(png)} bytes")
    finally:
        browser.close()


if __name__ == "__main__":
    main()
