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


#: the Playwright driver and Chromium the pages of the module being run share (:func:`shared_browser`), once started
_shared: dict[str, object] = {}


def shared_browser():
    """One Chromium for the test module being run, started by its first page (Playwright's driver and the browser
    took about 2 s a page to start) and closed by :func:`close_shared_browser` when the module ends.  Each page
    still opens in a context of its own: cookies, storage and cache start empty, as in a new browser."""
    if not _shared:
        driver = sync_playwright().start()
        _shared["driver"] = driver
        _shared["browser"] = driver.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
    return _shared["browser"]


def close_shared_browser() -> None:
    """End :func:`shared_browser`'s Chromium and driver, if a page started them (tests/conftest.py, per module)."""
    if _shared:
        try:
            _shared["browser"].close()
        finally:
            _shared.pop("driver").stop()
            _shared.clear()


@contextlib.contextmanager
def blank_page(viewport=(1000, 900)):
    """A blank page in a new browser context of the module's Chromium (:func:`shared_browser`), closed after."""
    context = shared_browser().new_context(viewport={"width": viewport[0], "height": viewport[1]})
    try:
        page = context.new_page()
        try:
            yield page
        finally:
            # a route handler still answering one of the page's last requests (the docs page's favicon, fetched
            # through a test's proxy route) failed as the page closed under it ("Fetch response has been disposed"),
            # an error at teardown; unrouted so, what such a handler raises afterwards is dropped, after a test that
            # failed as after one that passed (its own failure is then the one reported)
            page.unroute_all(behavior="ignoreErrors")
    finally:
        context.close()


@contextlib.contextmanager
def page_of(url, viewport=(1000, 900), before_load=None):
    """The demo page at ``url`` once its model list has arrived (a caption request needs a model to name), in a
    :func:`blank_page`; ``before_load(page)`` runs before it is opened (routes that stand in for the server)."""
    with blank_page(viewport) as page:
        if before_load is not None:
            before_load(page)
        page.goto(url)
        page.locator("#model option").first.wait_for(state="attached", timeout=30_000)
        yield page


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
