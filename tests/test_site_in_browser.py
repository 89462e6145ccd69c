"""The site as a reader sees it, in Debian's Chromium: pages, links, tabs, copy buttons,
downloads, search, code width and dark mode.

The site is built once per session, served on localhost, and visited page by page. In
CI the session installs chromium with apt, as the Slurm tests install Slurm; only a
developer without root and without chromium skips these tests.
"""

import os
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
        blocks = code_blocks(page, "code-file")
        for index in range(blocks.count()):
            block = blocks.nth(index)
            wrapper = block.locator("xpath=..")
            path = wrapper.locator(".caption-text").inner_text()
            expected = (ROOT / path).read_text()
            open_tab_of(block)
            assert block.is_visible(), f"{name}: the tab of {path} does not show it"
            shown = block.locator("pre").inner_text()
            assert shown.rstrip("\n") == expected.rstrip("\n"), f"{name}: {path}"
            page.evaluate("navigator.clipboard.writeText('')")
            block.hover()
            block.locator("button.copybtn").click()
            clipboard = page.evaluate("navigator.clipboard.readText()")
            # sphinx-copybutton drops the last newline on purpose, so that a pasted
            # command does not run before the reader presses Enter.
            assert clipboard + "\n" == expected, f"{name}: the copy of {path} differs"
            copied += 1
    page.close()
    print(f"{copied} copy buttons checked")
    assert copied >= 30


def test_one_line_commands_copy_as_one_line(site, base, context):
    # Long commands wrap on screen; the copy must still be the single line.
    page = context.new_page()
    page.goto(base + "index.html")
    block = page.locator("div.highlight-bash:not(.code-file) pre").first
    text = block.inner_text().strip()
    style = block.evaluate(
        "p => [getComputedStyle(p).whiteSpace, p.clientHeight,"
        " parseFloat(getComputedStyle(p).lineHeight)]"
    )
    assert style[0] == "pre-wrap" and style[1] > 2 * style[2], f"no wrap: {style}"
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
    # Each step's download links come before its blocks; the link for main.py serves
    # the next full main.py shown on the page.
    page = context.new_page()
    served = 0
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
                    if i[0] == "file" and i[1].endswith(label)
                ),
                None,
            )
            assert shown, f"{name}: no {label} shown after its download link"
            response = page.request.get(href)
            assert response.ok, f"{name}: {href}"
            assert response.body() == (ROOT / shown).read_bytes(), f"{name}: {href}"
            served += 1
    page.close()
    print(f"{served} download links checked")
    assert served >= 30


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
    page = browser.new_page(viewport={"width": 400, "height": 800})
    wide = {}
    for name in pages(site):
        page.goto(base + name)
        width = page.evaluate("document.documentElement.scrollWidth")
        if width > 400:
            wide[name] = width
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
