"""What tests/test_shipped_results.py (real photos) and tests/test_shipped_scene_results.py (generated scenes) both
check of a shipped checkpoint: that it still writes the captions its committed report scored."""

from __future__ import annotations

from pathlib import Path

from captioner.models.evaluation.compare import read_results
from captioner.models.evaluation.report import evaluation_report

#: ``captioner eval`` captions 50 images at a time (models/evaluation/evaluate.py): the first 50 are decoded in the
#: same batch as when the report was made, so the comparison is exact rather than up to batch-size rounding
FIRST_BATCH = 50


def captions_unlike_the_committed(checkpoint: Path, captions: Path, dataset: Path, image_root: Path,
                                  cache_dir: Path) -> list[tuple[int, str, str | None]]:
    """``(image id, caption now, caption committed)`` for each of the first :data:`FIRST_BATCH` ``test`` images that
    ``checkpoint`` captions, with ``captioner eval``'s code, otherwise than ``captions`` (its ``--results-json``)."""
    committed = read_results(captions)
    written = evaluation_report(checkpoint, dataset, ["test"], image_root=image_root, limit=FIRST_BATCH, meteor=False,
                                cache_dir=cache_dir, device="cpu", progress=False)
    assert len(written.coco_results) == FIRST_BATCH
    return [(row["image_id"], row["caption"], committed.get(row["image_id"])) for row in written.coco_results
            if row["caption"] != committed.get(row["image_id"])]
