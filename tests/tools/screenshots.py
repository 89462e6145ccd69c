"""Screenshots of the site: the Mila page's first diff, in light and in dark mode.

    nox -s screenshots      builds the site, writes docs/images/mila-diff-*.png
    python tests/tools/screenshots.py DIR --site SITE   the same into DIR, from SITE

The README shows the light one, so that a visitor sees what the guide looks like before
building it. Run it again after a change to how code looks, and commit the pictures.
"""

import argparse
import sys
import tempfile
from pathlib import Path

from playwright.sync_api import sync_playwright

# The helpers (smoke.py and the rest) sit in tests/helpers.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from site_browser import (  # noqa: E402
    LAPTOP,
    ROOT,
    build_site,
    launch,
    serve,
    show_first_diff,
)


def take(site: Path, out: Path) -> list[Path]:
    """Serves `site` and starts Chromium to take the pictures."""
    with serve(site) as base, sync_playwright() as playwright:
        browser = launch(playwright)
        written = shoot(browser, base, out)
        browser.close()
    return written


def shoot(browser, base: str, out: Path) -> list[Path]:
    """The pictures of the site at `base`, light then dark, written into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for scheme in ("light", "dark"):
        # furo follows the system's colour scheme until a reader picks one.
        page = browser.new_page(
            viewport=LAPTOP, color_scheme=scheme, device_scale_factor=1
        )
        show_first_diff(page, base)
        # The tab set: its labels, then the diff.
        path = out / f"mila-diff-{scheme}.png"
        page.locator(".sd-tab-set:has(.code-diff)").first.screenshot(path=path)
        written.append(path)
        page.close()
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", default=ROOT / "docs" / "images")
    parser.add_argument("--site", type=Path, help="a built site (default: build one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        site = args.site or build_site(Path(tmp) / "html")
        for path in take(site, args.out):
            print(path)


if __name__ == "__main__":
    main()
