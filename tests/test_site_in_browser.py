"""The site as a reader sees it, in Debian's Chromium: pages, links, tabs, copy buttons,
downloads, search, code width and dark mode.

The site is built once per session, served on localhost, and visited page by page. In
CI the session installs chromium with apt, as the Slurm tests install Slurm; only a
developer without root and without chromium skips these tests.
"""

import base64
import io
import os
import runpy
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urldefrag, urlparse

import pytest
from site_browser import LAPTOP, ROOT, BrowserUnavailable, launch, serve

playwright_api = pytest.importorskip("playwright.sync_api")

DOC_PAGES = [
    p
    for p in (ROOT / "docs").glob("**/*.*")
    if p.suffix in {".md", ".rst"} and "_build" not in p.parts
]
# Words a reader would type, and the page that must answer each.
SEARCHES = {
    "MASTER_PORT": "concepts.html",
    "set_epoch": "concepts.html",
    "requeue": "clusters/generic.html",
    "NCCL_SOCKET_IFNAME": "troubleshooting.html",
    "torchrun": "launchers.html",
}
# WCAG AA: 4.5 for text; 3 for the syntax colours, as for large text and UI parts.
TEXT_CONTRAST = 4.5
TOKEN_CONTRAST = 3.0


@dataclass
class Visit:
    """What one page did on load, and what it holds."""

    errors: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    # What the page loads: stylesheets, scripts, images and the favicon.
    resources: list[str] = field(default_factory=list)
    icons: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def base(site):
    with serve(site) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    try:
        with playwright_api.sync_playwright() as playwright:
            browser = launch(playwright)
            yield browser
            browser.close()
    except BrowserUnavailable as error:
        if os.geteuid() != 0 and not os.environ.get("CI"):
            pytest.skip(str(error))
        pytest.fail(str(error))


@pytest.fixture(scope="module")
def context(browser):
    context = browser.new_context(
        viewport=LAPTOP, permissions=["clipboard-read", "clipboard-write"]
    )
    yield context
    context.close()


def pages(site: Path) -> list[str]:
    return sorted(
        str(p.relative_to(site))
        for p in site.glob("**/*.html")
        if not p.relative_to(site).parts[0].startswith("_")
    )


@pytest.fixture(scope="module")
def visits(site, base, context) -> dict[str, Visit]:
    """Every page, loaded once: its console errors, failed requests, links and ids."""
    found = {}
    page = context.new_page()
    for name in pages(site):
        visit = found[name] = Visit()
        page.on(
            "console", lambda m, v=visit: m.type == "error" and v.errors.append(m.text)
        )
        page.on("pageerror", lambda e, v=visit: v.errors.append(str(e)))
        page.on("requestfailed", lambda r, v=visit: v.errors.append(f"failed: {r.url}"))
        page.on(
            "response",
            lambda r, v=visit: (
                r.status >= 400 and v.errors.append(f"{r.status}: {r.url}")
            ),
        )
        page.goto(base + name, wait_until="networkidle")
        visit.links = page.eval_on_selector_all("a[href]", "as => as.map(a => a.href)")
        visit.ids = set(page.eval_on_selector_all("[id]", "es => es.map(e => e.id)"))
        visit.resources = page.eval_on_selector_all(
            "link[href]:not([rel=canonical]), script[src], img[src]",
            "es => es.map(e => e.href || e.src)",
        )
        visit.icons = page.eval_on_selector_all(
            "link[rel~=icon]", "es => es.map(e => e.href)"
        )
        page.close()
        page = context.new_page()
    page.close()
    return found


def test_every_page_loads_with_no_console_error_or_failed_request(visits):
    assert len(visits) >= 12
    failures = {name: visit.errors for name, visit in visits.items() if visit.errors}
    assert not failures


def test_every_internal_link_and_anchor_resolves(site, base, visits):
    checked = 0
    for name, visit in visits.items():
        for link in visit.links:
            if not link.startswith(base):
                continue  # another site: not fetched in tests
            url, anchor = urldefrag(link)
            target = urlparse(url).path.lstrip("/") or "index.html"
            if target.endswith("/"):
                target += "index.html"
            assert (site / target).is_file(), f"{name}: {link} has no page"
            if anchor and target.endswith(".html"):
                assert anchor in visits[target].ids, f"{name}: no #{anchor} in {target}"
            checked += 1
    print(f"{checked} internal links checked")
    assert checked > 100


def test_every_page_has_a_favicon_and_what_it_loads_is_served(base, context, visits):
    # A browser may or may not ask for the favicon while a test watches: fetch it, and
    # every stylesheet, script and image, whatever the browser did.
    assert all(visit.icons for visit in visits.values())
    served = {url for visit in visits.values() for url in visit.resources}
    for url in sorted(served):
        if url.startswith(base):
            assert context.request.get(url).ok, url
    print(f"{len(served)} resources checked")
    assert any(url.endswith("favicon.svg") for url in served)


def code_blocks(page, kind: str):
    return page.locator(f"div.{kind}")


def open_tab_of(block) -> None:
    """Clicks the tab label of the tab that holds `block`, if it is in one."""
    block.evaluate(
        """b => {
            const content = b.closest('.sd-tab-content');
            if (content) content.previousElementSibling.click();  // its label
        }"""
    )


def test_each_full_file_shows_its_file_and_copies_its_exact_bytes(site, base, context):
    page = context.new_page()
    copied = 0
    for name in pages(site):
        page.goto(base + name)
        # furo scrolls smoothly, and Playwright waits for each scroll to end before it
        # hovers or clicks: most of this test's time, until scrolls are instant.
        page.add_style_tag(content="* { scroll-behavior: auto !important; }")
        blocks = code_blocks(page, "code-file")
        for index in range(blocks.count()):
            block = blocks.nth(index)
            wrapper = block.locator("xpath=..")
            path = wrapper.locator(".caption-text").inner_text()
            expected = (ROOT / path).read_bytes().decode()
            open_tab_of(block)
            assert block.is_visible(), f"{name}: the tab of {path} does not show it"
            shown = block.locator("pre").inner_text()
            assert shown.rstrip("\n") == expected.rstrip("\n"), f"{name}: {path}"
            page.evaluate("navigator.clipboard.writeText('')")
            block.hover()
            block.locator("button.copybtn").click()
            # sphinx-copybutton copies the file less its last newline; guide.js then
            # writes the whole file, which takes a moment.
            for _ in range(50):
                clipboard = page.evaluate("navigator.clipboard.readText()")
                if clipboard == expected:
                    break
                page.wait_for_timeout(20)
            assert clipboard == expected, f"{name}: the copy of {path} differs"
            copied += 1
    page.close()
    print(f"{copied} copy buttons checked")
    assert copied >= 30


@pytest.mark.parametrize("page_name", ["clusters/generic.html", "clusters/mila.html"])
def test_the_modules_show_whole_where_they_first_appear(base, context, page_name):
    # Step 1 shows main.py and devices.py whole, each in a tab; step 2, ranks.py. A tab
    # opens on a click and shows the file, byte for byte.
    page = context.new_page()
    page.goto(base + page_name)
    cluster = page_name.split("/")[1].removesuffix(".html")
    for step, module in [("single_gpu", "devices.py"), ("multi_gpu", "ranks.py")]:
        path = f"examples/{cluster}/{step}/{module}"
        caption = page.locator(".caption-text", has_text=path)
        assert caption.count() == 1, f"{page_name}: {path} is not shown"
        block = caption.locator("xpath=../..")
        assert "code-file" in block.locator("div.highlight").first.evaluate(
            "e => e.parentElement.className"
        )
        tab = page.locator(".sd-tab-label", has_text=module).first
        tab.click()
        assert block.is_visible(), f"{page_name}: the {module} tab did not open"
        shown = block.locator("pre").inner_text().rstrip()
        assert shown == (ROOT / path).read_text().rstrip(), path
    page.close()


def test_one_line_commands_copy_as_one_line(site, base, context):
    # Long commands wrap on screen; the copy must still be the single line.
    page = context.new_page()
    page.goto(base + "index.html")
    block = page.locator("div.highlight-bash:not(.code-file) pre").first
    text = block.inner_text().strip()
    white_space, rows = block.evaluate(
        """p => {
            const style = getComputedStyle(p);
            const height = p.clientHeight - parseFloat(style.paddingTop)
                - parseFloat(style.paddingBottom);
            return [style.whiteSpace, height / parseFloat(style.lineHeight)];
        }"""
    )
    assert white_space == "pre-wrap" and rows > 1.5, f"no wrap: {white_space}, {rows}"
    page.evaluate("navigator.clipboard.writeText('')")
    block.hover()
    block.locator("xpath=..").locator("button.copybtn").click()
    assert page.evaluate("navigator.clipboard.readText()") == text
    page.close()


def test_diffs_have_no_copy_button_and_name_both_files(site, base, context):
    page = context.new_page()
    diffs = 0
    for name in pages(site):
        page.goto(base + name)
        blocks = code_blocks(page, "code-diff")
        for index in range(blocks.count()):
            block = blocks.nth(index)
            assert block.locator("button.copybtn").count() == 0, name
            head = block.locator("pre").inner_text().splitlines()[:2]
            assert head[0].startswith("--- examples/"), f"{name}: {head}"
            assert head[1].startswith("+++ examples/"), f"{name}: {head}"
            diffs += 1
    page.close()
    assert diffs == sum(page.read_text().count(":diff:") for page in DOC_PAGES)


def test_every_download_link_serves_the_file_shown_next_to_it(site, base, context):
    # Each step's download links come before its blocks: each link serves the file of
    # its name in the folder of the next job.sh or main.py shown, and the .zip holds
    # every file of that folder.
    page = context.new_page()
    served, archives = 0, set()
    for name in pages(site):
        page.goto(base + name)
        links = page.eval_on_selector_all(
            "a.download, .literal-block-wrapper:has(> .code-file) .caption-text",
            """es => es.map(e => e.matches('a') ? ['link', e.href, e.textContent.trim()]
                                            : ['file', e.textContent.trim()])""",
        )
        for position, item in enumerate(links):
            if item[0] != "link":
                continue
            _, href, label = item
            shown = next(
                (
                    i[1]
                    for i in links[position:]
                    if i[0] == "file" and i[1].endswith(("/job.sh", "/main.py", label))
                ),
                None,
            )
            assert shown, f"{name}: no file shown after the link {label}"
            response = page.request.get(href)
            assert response.ok, f"{name}: {href}"
            folder = (ROOT / shown).parent
            if href.endswith(".zip"):
                # Unpacked, a folder named after the example: generic-multi_node/.
                with zipfile.ZipFile(io.BytesIO(response.body())) as archive:
                    held = {
                        Path(entry).name: archive.read(entry)
                        for entry in archive.namelist()
                    }
                    prefixes = {Path(entry).parent.name for entry in archive.namelist()}
                files = {
                    p.name: p.read_bytes()
                    for p in folder.iterdir()
                    if p.suffix in {".py", ".sh", ".def"}
                }
                assert {"job.sh", "main.py"} <= held.keys(), f"{name}: {href}"
                expected = f"{folder.parent.name}-{folder.name}"
                assert held == files and prefixes == {expected}, f"{name}: {href}"
                archives.add(folder)
                continue
            assert response.body() == (folder / label).read_bytes(), f"{name}: {href}"
            served += 1
    page.close()
    print(f"{served} download links and {len(archives)} folders checked")
    folders = {path.parent for path in (ROOT / "examples").glob("*/*/main.py")}
    assert served >= 30 and archives == folders


@pytest.mark.parametrize(("term", "expected"), SEARCHES.items())
def test_search_finds_the_page_a_reader_wants(base, context, term, expected):
    page = context.new_page()
    page.goto(f"{base}search.html?q={term}")
    # Results appear one by one; the summary says when the search has finished.
    page.locator("p.search-summary", has_text="Search finished").wait_for(
        timeout=15_000
    )
    results = page.locator("#search-results ul.search li a")
    found = [
        urlparse(h).path.lstrip("/")
        for h in results.evaluate_all("as => as.map(a => a.href)")
    ]
    page.close()
    assert expected in found[:5], f"{term}: {found}"


def overflowing_code(page) -> list[str]:
    """The code blocks of the page that scroll sideways, all tabs shown."""
    page.add_style_tag(content=".sd-tab-content { display: block !important; }")
    return page.eval_on_selector_all(
        "div.highlight pre",
        """ps => ps.filter(p => p.scrollWidth > p.clientWidth).map(p =>
            `${p.scrollWidth - p.clientWidth}px: ` +
            p.innerText.split('\\n').sort((a, b) => b.length - a.length)[0])""",
    )


@pytest.mark.parametrize("width", [1366, 1440])
def test_no_code_scrolls_sideways_at_laptop_width(site, base, browser, width):
    page = browser.new_page(viewport={"width": width, "height": 900})
    wide = {}
    for name in pages(site):
        page.goto(base + name)
        if over := overflowing_code(page):
            wide[name] = over
        # Files never wrap to fit: they are short enough.
        wrapped = page.eval_on_selector_all(
            ".code-file pre, .code-diff pre, .code-excerpt pre",
            "ps => ps.filter(p => getComputedStyle(p).whiteSpace !== 'pre').length",
        )
        assert wrapped == 0, name
    page.close()
    assert not wide


def test_no_page_overflows_a_phone(site, base, browser):
    # Below 768 px furo lets the article scroll sideways inside the page, so the
    # document's width alone would not show a line of text that is too wide. Code
    # blocks and tables may scroll inside themselves: 88 columns do not fit a phone.
    page = browser.new_page(viewport={"width": 400, "height": 800})
    wide = {}
    for name in pages(site):
        page.goto(base + name)
        found = page.evaluate(
            """() => {
                const content = document.querySelector('.content');
                const beyond = [...document.querySelectorAll('article *')]
                    .filter(e => !e.closest('div.highlight, .table-wrapper'))
                    .filter(e => e.getBoundingClientRect().right > innerWidth + 0.5)
                    .map(e => `${e.tagName}: ${e.textContent.slice(0, 40)}`);
                return [document.documentElement.scrollWidth,
                        content.scrollWidth - content.clientWidth, ...beyond];
            }"""
        )
        if found[0] > 400 or found[1] > 0 or found[2:]:
            wide[name] = found
    page.close()
    assert not wide


def luminance(rgb):
    def channel(c):
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(c) for c in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast(a, b):
    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def rgb(css: str) -> tuple[int, int, int]:
    values = css[css.index("(") + 1 : css.index(")")].split(",")
    assert len(values) == 3 or float(values[3]) == 1, f"not opaque: {css}"
    return tuple(int(float(v)) for v in values[:3])


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_diff_lines_are_green_and_red_and_their_code_stays_readable(
    site, base, browser, scheme
):
    page = browser.new_page(viewport=LAPTOP, color_scheme=scheme)
    weakest, checked = {}, 0
    for name in pages(site):
        page.goto(base + name)
        lines = page.eval_on_selector_all(
            ".code-diff .hll",
            """hs => hs.map(h => ({
                marker: h.firstElementChild.className,
                markerColour: getComputedStyle(h.firstElementChild).color,
                background: getComputedStyle(h).backgroundColor,
                block: getComputedStyle(h.closest('.highlight')).backgroundColor,
                colours: [...h.querySelectorAll('span')]
                    .filter(s => s.textContent.trim())
                    .map(s => [s.className, getComputedStyle(s).color]),
                text: getComputedStyle(h.closest('pre')).color,
            }))""",
        )
        if not lines:
            continue
        # The marker colours that conf.py sets for this theme, resolved.
        configured = page.evaluate(
            """() => Object.fromEntries(['gi', 'gd'].map(kind => {
                const probe = document.createElement('span');
                const name = kind === 'gi' ? 'added' : 'removed';
                probe.style.color = `var(--color-diff-${name}-marker)`;
                document.body.appendChild(probe);
                const colour = getComputedStyle(probe).color;
                probe.remove();
                return [kind, colour];
            }))"""
        )
        assert {line["marker"] for line in lines} == {"gi", "gd"}, name
        for line in lines:
            background, block = rgb(line["background"]), rgb(line["block"])
            red, green, _ = background
            assert background != block
            # Added lines green, removed lines red, as GitHub and GitLab show them.
            assert (green > red) if line["marker"] == "gi" else (red > green), line
            assert line["markerColour"] == configured[line["marker"]], (name, line)
            assert contrast(rgb(line["text"]), background) >= TEXT_CONTRAST, line
            for token, colour in line["colours"]:
                ratio = contrast(rgb(colour), background)
                weakest[token] = min(weakest.get(token, 99), ratio)
            checked += 1
    page.close()
    assert checked > 300
    assert min(weakest.values()) >= TOKEN_CONTRAST, weakest


def pixels(page, png: Path) -> dict:
    """The size of a PNG, its mean luminance, and how many pixels have each colour."""
    data = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    return page.evaluate(
        """async data => {
            const image = new Image();
            image.src = data;
            await image.decode();
            const canvas = document.createElement('canvas');
            [canvas.width, canvas.height] = [image.width, image.height];
            const context = canvas.getContext('2d');
            context.drawImage(image, 0, 0);
            const rgba = context.getImageData(0, 0, image.width, image.height).data;
            const counts = {};
            let sum = 0;
            for (let i = 0; i < rgba.length; i += 4) {
                const hex = '#' + [0, 1, 2].map(
                    c => rgba[i + c].toString(16).padStart(2, '0')).join('');
                counts[hex] = (counts[hex] || 0) + 1;
                sum += (0.2126 * rgba[i] + 0.7152 * rgba[i + 1]
                        + 0.0722 * rgba[i + 2]) / 255;
            }
            return {width: image.width, height: image.height,
                    mean: sum / (rgba.length / 4), counts};
        }""",
        data,
    )


def test_screenshots_show_the_first_diff_in_each_theme(base, browser, tmp_path):
    import screenshots

    options = runpy.run_path(str(ROOT / "docs" / "conf.py"))["html_theme_options"]
    shots = screenshots.shoot(browser, base, tmp_path)
    assert [shot.name for shot in shots] == [
        "mila-diff-light.png",
        "mila-diff-dark.png",
    ]
    page = browser.new_page()
    light, dark = (pixels(page, shot) for shot in shots)
    page.close()
    assert light["mean"] > 0.8 and dark["mean"] < 0.2, (light["mean"], dark["mean"])
    for picture, scheme in [(light, "light"), (dark, "dark")]:
        colours = options[f"{scheme}_css_variables"]
        # The picture holds the diff: some lines on each of its backgrounds.
        for kind in ("added", "removed"):
            background = colours[f"color-diff-{kind}"]
            assert picture["counts"].get(background, 0) >= 5 * picture["width"], (
                scheme,
                kind,
            )
        assert picture["width"] <= LAPTOP["width"] and picture["height"] > 300
