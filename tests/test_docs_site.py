"""The documentation site: `mkdocs build --strict` passes (what make docs runs; CI builds it here, once), the README
is a front page that links into it, and the built site works in a real browser: headless Chromium (driven as
benchmarks/ui_screenshot.py drives it) opens the home page, searches, and opens a generated reference page, with
no error in the console."""

from __future__ import annotations

import functools
import json
import re
import shutil
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from benchmarks.ui_screenshot import Browser, wait_for

from .docs_support import DOCS, ROOT, build_site

README_MAX_LINES = 200


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return build_site(tmp_path_factory.mktemp("site"))


def _nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_the_site_builds_strict_with_every_page_of_the_nav(site):
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    for page in _nav_pages(nav):  # a.md -> a/index.html; README.md and index.md -> their folder's index.html
        folder = re.sub(r"(^|/)(README|index)\.md$", "", page).removesuffix(".md")
        assert (site / folder / "index.html").is_file(), page
    # the Diátaxis split, and the reference pages written from the code
    sections = [next(iter(e)) for e in nav]
    assert sections == ["Home", "Getting started", "Tutorials", "How-to guides", "Reference", "Explanation"]
    config = (site / "reference" / "config" / "index.html").read_text()
    assert "hardware.precision" in config and "bf16, fp16, fp32" in config
    assert "benchmarks/figures" not in config and (site / "benchmarks" / "figures").is_dir()


def test_the_build_fails_on_a_broken_link(tmp_path, monkeypatch):
    """Strict means strict: a page that links to a page that does not exist stops the build."""
    from mkdocs.exceptions import Abort

    copy = tmp_path / "repo"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    for folder in ("benchmarks",):
        (copy / folder).symlink_to(ROOT / folder)
    (copy / "docs" / "getting-started.md").write_text("# Getting started\n\nSee [nothing](no-such-page.md).\n")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    with pytest.raises(Abort):
        build(load_config(str(copy / "mkdocs.yml"), site_dir=str(tmp_path / "out")))


def test_readme_is_a_front_page_that_links_into_the_site():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    for command in ("make run", "make test", "mlflow run . -P hardware=rtx3090", "models:/nli-minilm@champion",
                    "make ui"):
        assert command in readme
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link


# Collects what a page would show in its console: console.error calls, uncaught errors and rejections, and
# resources that failed to load (an error event on an element, caught in the capture phase).
CONSOLE_TRAP = """window.__errors = [];
const _error = console.error.bind(console);
console.error = (...args) => { window.__errors.push(args.map(String).join(' ')); _error(...args); };
window.addEventListener('error', e => window.__errors.push(
  e.message || ('failed to load ' + (e.target && (e.target.src || e.target.href)))), true);
window.addEventListener('unhandledrejection', e => window.__errors.push('unhandled: ' + e.reason));"""


@pytest.fixture
def served(site):
    """The built site over HTTP on loopback (search fetches its index and runs a worker: file:// URLs cannot)."""
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_the_site_in_headless_chromium_home_search_and_a_reference_page(served):
    if shutil.which("chromium") is None:
        pytest.fail("Debian's chromium is missing: apt-get install chromium (docker/install-engine.sh does)")
    browser = Browser()
    try:
        browser.page("Page.enable")
        browser.page("Page.addScriptToEvaluateOnNewDocument", source=CONSOLE_TRAP)

        def open_page(path: str, shows: str) -> None:
            browser.page("Page.navigate", url=served + path)
            assert wait_for(browser, f"document.body && document.body.innerText.includes({json.dumps(shows)})", 30), \
                f"{path} never showed {shows!r}"

        def value(expression: str) -> object:
            return browser.page("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

        open_page("/", "Getting started")
        assert value("document.title").startswith("maxout")
        # Search: type into the header's search box; the results come from the worker over the built index.
        value("""(() => { const box = document.querySelector('input.md-search__input'); box.focus();
                 box.value = 'resume'; box.dispatchEvent(new Event('input', {bubbles: true}));
                 box.dispatchEvent(new KeyboardEvent('keyup', {bubbles: true})); })()""")
        assert wait_for(browser, "document.querySelectorAll('.md-search-result__item').length > 0", 30), \
            value("document.querySelector('.md-search-result__meta')?.innerText")
        hits = value("[...document.querySelectorAll('.md-search-result__item')].map(e => e.innerText).join('\\n')")
        assert "resume" in hits.lower()
        errors_home = value("window.__errors")

        open_page("/reference/optimizations/", "opt.tf32.reason")
        time.sleep(0.5)  # late resources (fonts, the search worker) report their failures after the text shows
        assert value("document.querySelectorAll('table').length") >= 1
        assert errors_home == [] and value("window.__errors") == []
    finally:
        browser.close()
