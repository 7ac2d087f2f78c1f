"""The demo page in headless Chromium (``demo_pages.py``): upload → caption → hover a word → its overlay is visible;
and the same through a "Try a sample" photo. The screenshots are kept in ``.cache/test-artifacts/``."""

import contextlib
import io
import json

import httpx
from PIL import Image

from captioner.models.data.scenes import generate

from .conftest import DEMO_SAMPLES, ROOT, tiny_demo_server
from .demo_pages import OVERLAY_SHOWN, blank_page, needs_chromium, page_of, wait_until

ARTIFACTS = ROOT / ".cache" / "test-artifacts"


@needs_chromium
def test_upload_caption_hover_shows_overlay(server, tmp_path):
    dataset = json.loads(generate(tmp_path, {"test": 1}, seed=5, progress=False).read_text())
    image_path = tmp_path / "images" / dataset["images"][0]["filename"]
    with page_of(server) as page:
        page.set_input_files("#file", str(image_path))
        page.wait_for_selector("#caption .word", timeout=60_000)
        words = page.locator("#caption .word")
        caption = " ".join(words.all_inner_texts())
        assert words.count() >= 3, caption
        words.nth(1).hover()
        wait_until(page, OVERLAY_SHOWN, timeout_s=30)
        assert page.locator("#caption .word.active").inner_text() == words.nth(1).inner_text()
        size = page.evaluate("() => [document.getElementById('overlay').naturalWidth,"
                             " document.getElementById('overlay').naturalHeight]")
        assert size == [256, 256]
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "demo-page.png"), full_page=True)


@needs_chromium
def test_a_sample_photo_is_captioned_like_an_upload(server):
    """Clicking "Try a sample" (chelsea) sends that JPEG as the upload would: one multipart POST /caption, and its
    words rendered with one word per attention row; focusing the first word (the keyboard path) shows its overlay.
    The server's checkpoints are scene models, so the words themselves are not checked."""
    sample = (DEMO_SAMPLES / "chelsea.jpg").read_bytes()
    with page_of(server) as page:
        button = page.get_by_role("button", name="Caption the sample photo: a cat (scikit-image chelsea)")
        with page.expect_response(lambda r: r.request.method == "POST" and "/caption?" in r.url,
                                  timeout=60_000) as caught:
            button.click()
        response = caught.value
        assert response.ok, response.text()
        assert response.request.headers["content-type"].startswith("multipart/form-data")
        body = response.json()
        # Chromium does not hand a Blob body to Playwright, so the bytes sent are checked by their caption: the same
        # request with the file's bytes (same URL, same options) captions identically
        upload = httpx.post(response.url, files={"file": ("chelsea.jpg", sample, "image/jpeg")}, timeout=60)
        assert upload.status_code == 200 and upload.json()["tokens"] == body["tokens"]
        page.wait_for_selector("#caption .word", timeout=30_000)
        words = page.locator("#caption .word")
        assert words.count() >= 1
        assert words.count() == len(body["tokens"]) == len(body["attention"])
        words.first.focus()
        wait_until(page, OVERLAY_SHOWN, timeout_s=30)
        assert page.locator("#caption .word.active").inner_text() == words.first.inner_text()
        assert page.evaluate("() => document.getElementById('photo').naturalWidth") == 451
        # a long caption (scene models on a real photo) wraps instead of widening the page
        assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "demo-page-sample.png"), full_page=True)


def test_the_sample_photos_are_served_as_jpegs(server):
    """The committed samples (``make samples``), at the sizes skimage.data gives them with the longest side capped
    at 512 px, under the page's Content-Security-Policy like the rest of /static."""
    sizes = {"chelsea": (451, 300), "astronaut": (512, 512), "coffee": (512, 341)}
    page_csp = httpx.get(server).headers["content-security-policy"]
    for name, size in sizes.items():
        response = httpx.get(f"{server}/static/samples/{name}.jpg")
        assert response.status_code == 200 and response.headers["content-type"] == "image/jpeg"
        assert response.headers["content-security-policy"] == page_csp
        assert len(response.content) < 80_000
        with Image.open(io.BytesIO(response.content)) as image:
            assert image.format == "JPEG" and image.size == size and image.mode == "RGB"


@needs_chromium
def test_the_api_docs_render_with_no_request_leaving_the_server(server):
    """/docs is Swagger UI served by the app itself: with every request to another host refused (as on a machine
    without internet access), the page still lists the caption endpoint."""
    with blank_page() as page:
        elsewhere = []

        def only_the_server(route):
            if route.request.url.startswith(server):
                route.continue_()
            else:
                elsewhere.append(route.request.url)
                route.abort()

        page.route("**/*", only_the_server)
        page.goto(f"{server}/docs")
        page.locator(".opblock-summary-path", has_text="/caption").first.wait_for(timeout=30_000)
        assert "Attention captioner" in page.locator(".info .title").inner_text()
        assert elsewhere == []


@needs_chromium
def test_only_the_newest_caption_is_shown_and_a_hidden_heatmap_stays_hidden(server):
    """Two captions in flight (a sample clicked while another is still being captioned, its answer held back): the
    page cancels the older request and shows the newer caption alone, even if the older answer were to arrive;
    the heatmap, hidden until a word is chosen, is not drawn; a beam size the box rejects is not sent; a failed
    upload shows the service's detail."""
    held = []

    def hold_the_first_caption(route):
        if held:
            route.continue_()
        else:
            held.append(route)  # sent on only once the second request has been answered

    def caption_answer(r):
        return r.request.method == "POST" and "/caption?" in r.url

    with page_of(server) as page:
        overlay_display = "() => getComputedStyle(document.getElementById('overlay')).display"
        failed = []
        page.on("requestfailed", lambda r: failed.append(r.failure))
        page.route("**/caption?*", hold_the_first_caption)
        page.get_by_role("button", name="Caption the sample photo: a cat (scikit-image chelsea)").click()
        wait_until(page, "() => document.getElementById('status').textContent === 'Captioning…'", 30)
        with page.expect_response(caption_answer, timeout=60_000) as newer:
            page.get_by_role("button", name="Caption the sample photo: a cup of coffee (scikit-image coffee)").click()
        page.wait_for_selector("#caption .word", timeout=30_000)
        assert len(failed) == 1 and "ABORTED" in failed[0].upper(), failed  # the cat's request, cancelled
        with contextlib.suppress(Exception):  # an aborted request can no longer be sent on
            held[0].continue_()
        page.wait_for_timeout(500)  # anything late from the cat's request has arrived
        words = page.locator("#caption .word")
        assert words.count() == len(newer.value.json()["tokens"])
        assert page.evaluate("() => document.getElementById('photo').naturalWidth") == 512  # coffee, not the cat
        assert page.evaluate(overlay_display) == "none"
        page.unroute("**/caption?*")
        page.fill("#beam", "2.5")
        sent = []
        page.on("request", lambda r: sent.append(r.url) if "/caption?" in r.url else None)
        page.get_by_role("button", name="Caption the sample photo: a cat (scikit-image chelsea)").click()
        wait_until(page, "() => document.getElementById('status').textContent.startsWith('Not sent')", 10)
        assert sent == []
        page.fill("#beam", "3")
        page.set_input_files("#file", files=[{"name": "notes.jpg", "mimeType": "image/jpeg", "buffer": b"not a photo"}])
        wait_until(page, "() => document.getElementById('status').className === 'error'", 30)
        assert "cannot identify a JPEG" in page.locator("#status").inner_text()
        assert page.evaluate("() => document.getElementById('result').hidden")


@needs_chromium
def test_the_page_and_the_docs_work_behind_a_proxys_path_prefix(tmp_path_factory):
    """Served as ``https://…/captioner/`` by a proxy that strips the prefix (``CAPTIONER_ROOT_PATH``): the page's
    every request stays below the prefix, a sample is captioned and a word's heatmap shown, and the docs page loads
    its spec and assets from below the prefix and names it as the server. The proxy is the test's route handler:
    it sends each request on to the server without the prefix, as nginx's ``proxy_pass http://server/;`` does."""
    public = "http://proxy.test/captioner"
    outside = []
    with tiny_demo_server(tmp_path_factory, CAPTIONER_ROOT_PATH="/captioner") as server:
        def strip_the_prefix(route):
            url = route.request.url
            if not url.startswith(public + "/"):
                outside.append(url)
                route.abort()
                return
            route.fulfill(response=route.fetch(url=server + url[len(public):]))

        with page_of(f"{public}/", before_load=lambda page: page.route("**/*", strip_the_prefix)) as page:
            page.get_by_role("button", name="Caption the sample photo: a cat (scikit-image chelsea)").click()
            page.wait_for_selector("#caption .word", timeout=30_000)
            page.locator("#caption .word").first.focus()
            wait_until(page, OVERLAY_SHOWN, timeout_s=30)
            page.goto(f"{public}/docs")
            page.locator(".opblock-summary-path", has_text="/caption").first.wait_for(timeout=30_000)
            assert page.locator(".servers select option").first.inner_text() == "/captioner"
    assert outside == []
