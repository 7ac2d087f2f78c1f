"""The README's first example and docs/heatmaps.md quote the default model's own caption of the demo page's sample
photo (scikit-image's ``chelsea``), so a retrained default cannot leave the docs describing another model's words."""

from __future__ import annotations

import re

import pytest

from captioner.models.pipeline import Pipeline
from captioner.service.settings import Settings

from .conftest import DEMO_SAMPLES, ROOT

SAMPLE = DEMO_SAMPLES / "chelsea.jpg"
#: the model the service answers with when a request names none
DEFAULT = ROOT / Settings.model_fields["weights_dir"].default / Settings.model_fields["default_model"].default

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def default_caption():
    captioned = Pipeline(DEFAULT)([SAMPLE])[0]
    return captioned.caption, captioned.tokens


def test_readme_example_is_the_default_models_answer(default_caption):
    caption, tokens = default_caption
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "curl -F file=@service/static/samples/chelsea.jpg" in readme
    assert re.search(r'"caption": "([^"]*)"', readme).group(1) == caption
    quoted_tokens = re.search(r'"tokens": \[([^\]]*)\]', readme).group(1)
    assert re.findall(r'"([^"]*)"', quoted_tokens) == list(tokens)


def test_heatmaps_page_quotes_the_default_models_caption(default_caption):
    caption, _ = default_caption
    page = (ROOT / "docs" / "heatmaps.md").read_text(encoding="utf-8")
    section = page[page.index("figures/sat_chelsea.png"):]
    assert re.search(r'Caption: "([^"]*)"', section).group(1) == caption
