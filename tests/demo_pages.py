"""The demo page in headless Chromium, as the browser tests open it: Debian's chromium (``make test`` installs it
when it can) driven by Playwright; the browser tests skip with the reason when no chromium is installed."""

from __future__ import annotations

import contextlib
import io
import shutil
import time

import pytest
from PIL import Image
from playwright.sync_api import sync_playwright

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
OVERLAY_SHOWN = ("() => { const o = document.getElementById('overlay');"
                 " return !o.hidden && o.complete && o.naturalWidth > 0; }")


def wait_until(page, predicate: str, timeout_s: float) -> None:
    """Poll ``predicate`` with ``page.evaluate`` until it holds. Not ``page.wait_for_function``: its polling compiles
    the predicate inside the page, which the demo page's Content-Security-Policy (``script-src 'self'``, no
    'unsafe-eval') forbids, and the page is tested under its own policy."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(predicate):
        assert time.monotonic() < deadline, f"not true after {timeout_s} s: {predicate}"
        time.sleep(0.1)


@contextlib.contextmanager
def page_of(url, viewport=(1000, 900), before_load=None):
    """The demo page at ``url`` once its model list has arrived (a caption request needs a model to name);
    ``before_load(page)`` runs before it is opened (routes that stand in for the server)."""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            if before_load is not None:
                before_load(page)
            page.goto(url)
            page.locator("#model option").first.wait_for(state="attached", timeout=30_000)
            yield page
        finally:
            browser.close()


def without_openapi(page) -> None:
    """``before_load`` of a page that cannot read the service's OpenAPI document (a proxy that does not pass it):
    its beam box has no maximum, so a beam above the service's limit is sent and the service refuses it."""
    page.route("**/openapi.json", lambda route: route.fulfill(status=404))


def image_bytes(size, fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.radial_gradient("L").resize(size).convert("RGB").save(buffer, format=fmt)
    return buffer.getvalue()


def upload(page, name: str, data: bytes, mime: str) -> None:
    """Choose a file and wait for its caption's words."""
    with page.expect_response(lambda r: r.request.method == "POST" and "/caption?" in r.url, timeout=30_000):
        page.set_input_files("#file", files=[{"name": name, "mimeType": mime, "buffer": data}])
    page.wait_for_selector("#caption .word", timeout=30_000)
