"""A real headless browser for tests: Debian's Chromium driven by its ChromeDriver over the W3C
WebDriver protocol (plain HTTP, so no client library). The console's tests use it.

    with browser() as b:
        b.open(url); b.script("return document.title"); b.type("input[name=key]", "..."); b.png()

Chromium starts with the flags this machine kind needs (no sandbox as root, no background
networking: the network is closed) and a profile of its own; everything it starts is stopped
at exit.
"""

from __future__ import annotations

import base64
import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx

from loadgen.harness.processes import free_port

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
START_TIMEOUT_S = 30.0
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"
"""The W3C key of an element reference in a WebDriver answer."""
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,1100",
)


class BrowserMissing(RuntimeError):
    """Chromium or ChromeDriver is not installed (Debian: apt-get install chromium chromium-driver;
    .ci/run installs them)."""


class Browser:
    def __init__(self, driver_url: str, session: str) -> None:
        self._url = f"{driver_url}/session/{session}"
        self._http = httpx.Client(timeout=60.0)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        r = self._http.request(method, self._url + path, json=body)
        answer = r.json()
        if r.status_code != 200:
            raise RuntimeError(f"webdriver {method} {path}: {r.status_code} {answer}")
        return answer["value"]

    def open(self, url: str) -> None:
        self._call("POST", "/url", {"url": url})

    def script(self, source: str, *args: Any) -> Any:
        return self._call("POST", "/execute/sync", {"script": source, "args": list(args)})

    def source(self) -> str:
        return str(self._call("GET", "/source"))

    def _element(self, css: str) -> str:
        found = self._call("POST", "/element", {"using": "css selector", "value": css})
        return str(found[ELEMENT])

    def type(self, css: str, text: str) -> None:
        self._call("POST", f"/element/{self._element(css)}/value", {"text": text})

    def click(self, css: str) -> None:
        self._call("POST", f"/element/{self._element(css)}/click", {})

    def png(self) -> bytes:
        return base64.b64decode(self._call("GET", "/screenshot"))

    def wait_for(self, source: str, timeout_s: float = 20.0, what: str = "") -> Any:
        """Run `source` (a script returning a value) until it returns something truthy."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.script(source)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never showed {what or source}")
            time.sleep(0.1)

    def close(self) -> None:
        with contextlib.suppress(httpx.HTTPError):
            self._http.delete(self._url)
        self._http.close()


@contextlib.contextmanager
def browser() -> Iterator[Browser]:
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        raise BrowserMissing(f"{CHROMIUM} and {CHROMEDRIVER} are needed: {BrowserMissing.__doc__}")
    port = free_port()
    driver = subprocess.Popen(
        [CHROMEDRIVER, f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    profile = tempfile.mkdtemp(prefix="kvgate-chromium-")
    url = f"http://127.0.0.1:{port}"
    session: Browser | None = None
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/status", timeout=1.0).json()["value"]["ready"]:
                    break
            if time.monotonic() > deadline or driver.poll() is not None:
                raise RuntimeError("chromedriver did not start")
            time.sleep(0.05)
        options = {"binary": CHROMIUM, "args": [*FLAGS, f"--user-data-dir={profile}"]}
        capabilities = {"alwaysMatch": {"goog:chromeOptions": options}}
        r = httpx.post(url + "/session", json={"capabilities": capabilities}, timeout=60.0)
        r.raise_for_status()
        session = Browser(url, r.json()["value"]["sessionId"])
        yield session
    finally:
        if session is not None:
            session.close()
        driver.terminate()
        try:
            driver.wait(timeout=10)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()
        shutil.rmtree(profile, ignore_errors=True)
