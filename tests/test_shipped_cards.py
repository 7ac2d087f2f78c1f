"""The shipped checkpoints quote only what was measured: every score row of a ``MODEL_CARD.md`` in ``weights/`` and
``weights/flickr8k/`` is the row ``captioner card`` writes from the committed ``captioner eval`` report of that split
(``docs/results/NAME.json`` and ``NAME.ood.json`` for the scene checkpoints, ``docs/results/flickr8k/NAME.json`` for
the real-photo ones, which ``make zoo-f8k`` tables), and every checkpoint's files match its manifest.

A report re-measured without its card rewritten (or a card edited by hand) fails here. The Flickr8k cards' ``val``
rows have no committed report (``make train-f8k-STAGE`` writes it under ``runs/``), so only their reported splits are
checked against a file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from captioner.models.checkpoint import CARD, verify_manifest
from captioner.models.evaluation.card import _row

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def _shipped() -> list[tuple[Path, list[Path]]]:
    scenes = [(card.parent, [RESULTS / f"{card.parent.name}.json", RESULTS / f"{card.parent.name}.ood.json"])
              for card in sorted((ROOT / "weights").glob(f"*/{CARD}"))]
    photos = [(card.parent, [RESULTS / "flickr8k" / f"{card.parent.name}.json"])
              for card in sorted((ROOT / "weights" / "flickr8k").glob(f"*/{CARD}"))]
    return scenes + photos


SHIPPED = _shipped()
IDS = [str(checkpoint.relative_to(ROOT)) for checkpoint, _ in SHIPPED]


def test_the_repository_ships_checkpoints_to_check():
    assert SHIPPED, "no MODEL_CARD.md under weights/: the checks below would pass on nothing"


@pytest.mark.parametrize(("checkpoint", "reports"), SHIPPED, ids=IDS)
def test_every_score_row_of_a_card_is_its_reports_row(checkpoint: Path, reports: list[Path]):
    card = (checkpoint / CARD).read_text().splitlines()
    header = next(line for line in card if line.startswith("| split |"))
    metrics = tuple(cell.strip() for cell in header.strip().strip("|").split("|")[1:])
    for path in reports:
        assert path.is_file(), f"{checkpoint.relative_to(ROOT)}'s card has no report {path.relative_to(ROOT)}"
        report = json.loads(path.read_text())
        splits = {name: scores for name, scores in report.items() if isinstance(scores, dict) and "images" in scores}
        assert splits, f"{path.relative_to(ROOT)} scores no split"
        for split, scores in splits.items():
            row = _row(split, scores, metrics)
            assert row in card, (f"{checkpoint.relative_to(ROOT)}/{CARD} does not quote {path.relative_to(ROOT)}'s "
                                 f"{split} scores:\n{row}")


@pytest.mark.parametrize("checkpoint", [checkpoint for checkpoint, _ in SHIPPED], ids=IDS)
def test_every_shipped_checkpoint_matches_its_manifest(checkpoint: Path):
    verify_manifest(checkpoint)
