"""The demo page with a keyboard and a screen reader, against a real ``captioner serve`` of a tiny model: what a fourth
audit (twenty-first session: axe-core, keyboard only, the accessibility tree) found, each with the test that shows
it. axe-core found nothing; these are what it cannot see.

- A caption made again (another beam size or model, or a caption the server no longer kept) while a word had the
  keyboard focus dropped the focus to the page's body: the arrow keys then did nothing. The word chosen was lost too.
- Hovering a word while another had the focus moved the heatmap and the caption's Tab stop to the hovered word and
  left the focus behind: two stops in one toolbar.
- Home and End did nothing in the caption (the ARIA toolbar pattern moves to the first and last word).
- A beam size the service refused (above its limit) took the good caption and its photo off the screen.
- The heatmap's text alternative named the word and nothing of what the heatmap shows (WCAG 1.1.1); the mode was
  named by the service's identifier ("grid underscore smooth", read aloud).
- A photo captioned from the keyboard left the focus on a control that had scrolled out of view.
"""

from __future__ import annotations

import pytest

from .demo_pages import OVERLAY_SHOWN, image_bytes, needs_chromium, page_of, upload, wait_until

FOCUSED_WORD = "() => document.activeElement.classList.contains('word') ? document.activeElement.dataset.index : null"


def focus_word(page, index: int) -> None:
    """Tab into the caption from the control before it, then arrow to word ``index``."""
    page.focus("#mode")
    page.keyboard.press("Tab")
    for _ in range(index):
        page.keyboard.press("ArrowRight")
    assert page.evaluate(FOCUSED_WORD) == str(index)


def set_beam_without_focus(page, value: str) -> None:
    """Another beam size, as a pointer on the box's spin arrows sets it (the keyboard focus stays where it is)."""
    page.evaluate("""(value) => { const box = document.getElementById('beam'); box.value = value;
                                  box.dispatchEvent(new Event('change')); }""", value)


def caption_answered(page):
    return page.expect_response(lambda r: r.request.method == "POST" and "/caption?" in r.url, timeout=30_000)


@pytest.mark.browser
@needs_chromium
def test_the_keyboard_focus_stays_on_the_chosen_word_when_the_caption_is_made_again(captioned):
    page = captioned
    focus_word(page, 2)
    with caption_answered(page):
        set_beam_without_focus(page, "3")
    wait_until(page, "() => document.getElementById('status').textContent.includes('beam 3')", 30)
    wait_until(page, OVERLAY_SHOWN, timeout_s=30)
    assert page.evaluate(FOCUSED_WORD) == "2"  # was null: the focus fell to the body with the old words
    assert page.locator("#caption .word.active").get_attribute("data-index") == "2"
    page.keyboard.press("ArrowRight")
    assert page.evaluate(FOCUSED_WORD) == "3"


@pytest.mark.browser
@needs_chromium
def test_hovering_a_word_moves_the_keyboard_focus_with_the_heatmap(captioned):
    page = captioned
    focus_word(page, 0)
    page.locator("#caption .word").nth(2).hover()
    assert page.evaluate(FOCUSED_WORD) == "2"
    stops = page.evaluate("() => [...document.querySelectorAll('#caption .word')].filter(w => w.tabIndex === 0)"
                          ".map(w => w.dataset.index)")
    assert stops == ["2"]


@pytest.mark.browser
@needs_chromium
def test_home_and_end_move_to_the_first_and_last_word(captioned):
    page = captioned
    last = str(page.locator("#caption .word").count() - 1)
    focus_word(page, 1)
    page.keyboard.press("End")
    assert page.evaluate(FOCUSED_WORD) == last
    page.keyboard.press("Home")
    assert page.evaluate(FOCUSED_WORD) == "0"


@pytest.mark.browser
@needs_chromium
def test_a_beam_size_the_service_refuses_leaves_the_caption_and_its_photo_on_screen(captioned_without_openapi):
    page = captioned_without_openapi
    words = page.locator("#caption .word").all_inner_texts()
    alt = page.get_attribute("#photo", "alt")
    with caption_answered(page):
        set_beam_without_focus(page, "13")  # above the service's CAPTIONER_MAX_BEAM_SIZE (12)
    wait_until(page, "() => document.getElementById('status').className === 'error'", 10)
    assert "beam_size 13 is above the limit of 12" in page.locator("#status").inner_text()
    assert not page.evaluate("() => document.getElementById('result').hidden")
    assert page.locator("#caption .word").all_inner_texts() == words
    assert page.get_attribute("#photo", "alt") == alt
    page.locator("#caption .word").nth(1).hover()  # the caption on screen still shows its heatmaps
    wait_until(page, OVERLAY_SHOWN, timeout_s=30)


def attention_on_cells(cells):
    """A route handler answering the server's caption with every word's attention on one grid cell: word i's on
    ``cells[i % len(cells)]`` (the tiny model's random attention is spread nearly evenly)."""
    def answer(route):
        body = route.fetch().json()
        items = len(body["geometry"]["boxes"])
        body["attention"] = [[1.0 if j == cells[i % len(cells)] else 0.0 for j in range(items)]
                             for i in range(len(body["tokens"]))]
        route.fulfill(json=body)
    return answer


@pytest.mark.browser
@needs_chromium
def test_the_heatmaps_text_says_where_the_model_looked(tiny_server):
    # the tiny model's 3 × 3 grid: cell 0 is the upper left, 4 the centre, 8 the lower right
    with page_of(tiny_server, before_load=lambda page: page.route("**/caption?*", attention_on_cells([0, 4, 8]))) \
            as page:
        upload(page, "photo.png", image_bytes((160, 120), "PNG"), "image/png")
        words = page.locator("#caption .word")
        for index, part in enumerate(("upper left", "centre", "lower right")):
            words.nth(index).hover()
            wait_until(page, f"() => document.getElementById('overlay').alt.includes('“' + "
                             f"document.querySelectorAll('#caption .word')[{index}].textContent + '”')", 30)
            where = f"mostly the {part} of the photo (its 3 strongest of 9 cells hold 100 % of the attention)"
            assert page.get_attribute("#overlay", "alt").endswith(f": {where}")
            assert page.locator("#selected").inner_text() == \
                f"Showing “{words.nth(index).inner_text()}” (smooth heatmap): {where}."


@pytest.mark.browser
@needs_chromium
def test_a_photo_captioned_from_the_keyboard_brings_the_focus_to_the_result(tiny_server):
    """On a phone the result scrolled into view and the focus stayed on the file chooser, scrolled out of it: the
    next Tab went back up the page. The result's heading takes the focus; the next Tab reaches the words."""
    with page_of(tiny_server, viewport=(320, 640)) as page:
        page.focus("#file")
        upload(page, "photo.png", image_bytes((160, 120), "PNG"), "image/png")
        assert page.evaluate("() => document.activeElement.id") == "result-title"
        top = page.evaluate("() => document.getElementById('result-title').getBoundingClientRect().top")
        assert 0 <= top < 640
        page.keyboard.press("Tab")
        assert page.evaluate(FOCUSED_WORD) == "0"
