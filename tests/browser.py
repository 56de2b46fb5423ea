"""A headless Chromium driven through the DevTools protocol over a pipe (tests only).

``chromium --remote-debugging-pipe`` reads protocol commands from file descriptor 3 and
writes answers and events to descriptor 4, each message a JSON object ending in a NUL byte;
no websocket library or browser download is needed, only Debian's ``chromium`` package.
Every read has a deadline; closing kills the browser and removes its profile.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    """The path of an installed Chromium, or None."""
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def chromium_or_skip() -> str:
    """The path of an installed Chromium; skips the calling test when there is none."""
    import pytest  # only the tests that drive a browser need it

    path = find_chromium()
    if path is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return path


class Browser:
    """One headless Chromium; :meth:`open` a page, :meth:`evaluate` JavaScript in it."""

    def __init__(self, executable: str, timeout: float = 30.0, stderr: Any = None) -> None:
        self.timeout = timeout
        self._profile = tempfile.mkdtemp(prefix="sa-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire_fds() -> None:  # in the child: the protocol's fds 3 and 4
            # Copies first: a pipe end may already be fd 3 or 4, and dup2 onto itself
            # would neither move the other end out of the way nor clear close-on-exec.
            read_end, write_end = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(read_end, 3)
            os.dup2(write_end, 4)

        flags = [
            "--headless",
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--remote-debugging-pipe",
            f"--user-data-dir={self._profile}",
        ]
        if os.geteuid() == 0:
            flags.append("--no-sandbox")  # Chromium refuses to run its sandbox as root
        self.proc = subprocess.Popen(
            [executable, *flags, "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr if stderr is not None else subprocess.DEVNULL,
            preexec_fn=wire_fds,
            # close_fds would close 3 and 4 again after preexec_fn; Python's own fds are
            # not inheritable, so nothing else leaks into the browser.
            close_fds=False,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self._session: str | None = None

    def command(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        """Send one protocol command and return its result (events in between are dropped).

        Raises:
            TimeoutError: no answer within the browser's timeout.
            RuntimeError: the browser answered with an error.
        """
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            answer = self._read(deadline)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return dict(answer.get("result", {}))

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the browser did not answer in time")
            ready, _, _ = select.select([self._from_browser], [], [], left)
            if ready:
                chunk = os.read(self._from_browser, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"the browser exited (code {self.proc.poll()})")
                self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        return dict(json.loads(raw))

    def open(self, url: str) -> None:
        """Open ``url`` in a new tab, which :meth:`evaluate` then talks to."""
        target = self.command("Target.createTarget", url=url)["targetId"]
        self._session = self.command("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the open page (JSON-able values)."""
        result = self.command(
            "Runtime.evaluate", self._session, expression=expression, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    def set_viewport(self, width: int, height: int) -> None:
        """Size the open page's window in CSS pixels (a screenshot shows this much)."""
        self.command(
            "Emulation.setDeviceMetricsOverride",
            self._session,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def screenshot(self, path: str | os.PathLike[str]) -> None:
        """Save the open page's window as a PNG."""
        shot = self.command("Page.captureScreenshot", self._session, format="png")
        with open(path, "wb") as f:
            f.write(base64.b64decode(shot["data"]))

    def close(self) -> None:
        for fd in (self._to_browser, self._from_browser):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        shutil.rmtree(self._profile, ignore_errors=True)
