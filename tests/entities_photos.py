"""Photos whose Flickr30k Entities boxes are known: a red circle filling one quadrant of each, for the grounding
measure (test_entities.py) and supervised attention (test_attention_supervision.py)."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image, ImageDraw

#: the Entities captions of every photo: the circle boxed (chain 1), the background a scene chain without a box
SENTENCES = "[/EN#1/other a red circle] on [/EN#2/scene a plain background] .\n[/EN#1/other one circle] .\n"


def circle_photos(folder: Path, photos: list[tuple[str, tuple[int, int, int, int], str]],
                  captions: list[list[str]]) -> tuple[Path, Path]:
    """64×48 copies of 128×96 photos, ``photos`` as (Flickr id, the circle's box on the copy, split), their
    Entities files, and a Karpathy JSON giving each photo ``captions``: the JSON's path and the Entities folder."""
    (folder / "images").mkdir()
    entities = folder / "entities"
    (entities / "Sentences").mkdir(parents=True)
    (entities / "Annotations").mkdir()
    entries = []
    for index, (flickr_id, box, split) in enumerate(photos):
        picture = Image.new("RGB", (64, 48), (235, 235, 235))
        ImageDraw.Draw(picture).ellipse(box, fill=(220, 30, 30))
        picture.save(folder / "images" / f"{flickr_id}_x.jpg")
        (entities / "Sentences" / f"{flickr_id}.txt").write_text(SENTENCES)
        x0, y0, x1, y1 = (2 * v for v in box)
        (entities / "Annotations" / f"{flickr_id}.xml").write_text(
            f"<annotation><size><width>128</width><height>96</height></size><object><name>1</name><bndbox>"
            f"<xmin>{x0 + 1}</xmin><ymin>{y0 + 1}</ymin><xmax>{x1}</xmax><ymax>{y1}</ymax></bndbox></object>"
            f"<object><name>2</name><scene>1</scene></object></annotation>")
        entries.append({"filename": f"{flickr_id}_x.jpg", "filepath": "images", "imgid": index, "split": split,
                        "sentences": [{"tokens": tokens} for tokens in captions]})
    (folder / "dataset.json").write_text(json.dumps({"images": entries}))
    return folder / "dataset.json", entities
