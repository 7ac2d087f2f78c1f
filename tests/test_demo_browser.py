"""The demo page in headless Chromium: upload → caption → hover a word → its overlay is visible.

Uses Debian's chromium (``make test`` installs it when it can) driven by Playwright; skips with the reason when
no chromium is installed.  The screenshot is kept in ``test-artifacts/``.
"""

import json
import shutil
import time

import pytest

from captioner.models.data.scenes import generate

from .conftest import ROOT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
ARTIFACTS = ROOT / "test-artifacts"


def wait_until(page, predicate: str, timeout_s: float) -> None:
    """Poll ``predicate`` with ``page.evaluate`` until it holds. Not ``page.wait_for_function``: its polling compiles
    the predicate inside the page, which the demo page's Content-Security-Policy (``script-src 'self'``, no
    'unsafe-eval') forbids, and the page is tested under its own policy."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(predicate):
        assert time.monotonic() < deadline, f"not true after {timeout_s} s: {predicate}"
        time.sleep(0.1)


def test_upload_caption_hover_shows_overlay(server, tmp_path):
    from playwright.sync_api import sync_playwright

    dataset = json.loads(generate(tmp_path, {"test": 1}, seed=5, progress=False).read_text())
    image_path = tmp_path / "images" / dataset["images"][0]["filename"]
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 900})
            page.goto(server)
            page.locator("#model option").first.wait_for(state="attached")
            page.set_input_files("#file", str(image_path))
            page.wait_for_selector("#caption .word", timeout=60_000)
            words = page.locator("#caption .word")
            caption = " ".join(words.all_inner_texts())
            assert words.count() >= 3, caption
            words.nth(1).hover()
            wait_until(page, "() => { const o = document.getElementById('overlay');"
                             " return !o.hidden && o.complete && o.naturalWidth > 0; }", timeout_s=30)
            assert page.locator("#caption .word.active").inner_text() == words.nth(1).inner_text()
            size = page.evaluate("() => [document.getElementById('overlay').naturalWidth,"
                                 " document.getElementById('overlay').naturalHeight]")
            assert size == [256, 256]
            page.screenshot(path=str(ARTIFACTS / "demo-page.png"), full_page=True)
        finally:
            browser.close()
