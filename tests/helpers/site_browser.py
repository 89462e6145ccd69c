"""The built site in a real browser: Debian's Chromium, driven by Playwright.

The browser tests (test_site_in_browser.py) and the screenshots (screenshots.py) share
this module: it builds the site, serves it on localhost, and starts Chromium with flags
that keep it off the network.
"""

import contextlib
import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
# Headless, and nothing that reaches out: no sandbox (root in a container has none to
# give), no GPU, no background updates or first-run pages.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
# A common laptop width, where code must fit without scrolling.
LAPTOP = {"width": 1366, "height": 900}


class BrowserUnavailable(RuntimeError):
    """Chromium is not installed and cannot be (not root, say)."""


def ensure_chromium() -> Path:
    """Debian's chromium, installed with apt when missing, as the Slurm lab does."""
    if CHROMIUM.exists():
        return CHROMIUM
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise BrowserUnavailable(f"{CHROMIUM} is missing: apt-get install chromium")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise BrowserUnavailable(f"{' '.join(command)} failed:\n{result.stderr}")
    return CHROMIUM


def build_site(out: Path) -> Path:
    """Builds the site into `out`, as `nox -s docs` does: warnings are errors."""
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html"]
        + [str(ROOT / "docs"), str(out)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"the site does not build:\n{result.stdout}{result.stderr}")
    return out


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


@contextlib.contextmanager
def serve(site: Path) -> Iterator[str]:
    """Serves `site` on a free localhost port; yields its base URL."""
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()


def launch(playwright):
    """Chromium from Debian, headless, off the network."""
    return playwright.chromium.launch(
        executable_path=str(ensure_chromium()), args=CHROMIUM_FLAGS
    )


def show_first_diff(page, base: str) -> None:
    """Opens the Mila page at its first diff: what the guide looks like."""
    page.goto(base + "clusters/mila.html")
    page.locator(".code-diff").first.scroll_into_view_if_needed()
