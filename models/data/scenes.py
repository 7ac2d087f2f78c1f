"""Deterministic generated-scene dataset: captioned images that need no download.

Each 256×256 image holds 1–4 objects (shape × colour × size) on a textured background.  Every image gets five
reference captions with varied wording that name the objects left to right, their colours, counts and spatial
relations; every object has a pixel mask (one label PNG per image, value ``i + 1`` for object ``i``), and every
caption records which of its words refer to which objects (``token_objects``, aligned with ``tokens``).

The dataset is written in the Karpathy split JSON layout (``dataset_coco.json``: ``images`` → ``filename``,
``split``, ``sentences[].tokens``) so the same loader reads real COCO / Flickr8k / Flickr30k.  The
``heldout`` split contains colour–shape combinations that never occur in train / val / test.
"""

from __future__ import annotations

import json
import math
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

CANVAS = 256
COLOURS = {
    "red": (215, 35, 35),
    "green": (35, 165, 50),
    "blue": (35, 70, 220),
    "yellow": (240, 215, 35),
    "purple": (135, 45, 180),
    "orange": (245, 130, 25),
}
SHAPES = ("circle", "square", "triangle", "star", "diamond")
SIZES = {"small": (17, 22), "large": (32, 40)}  # circumradius range in pixels
BACKGROUNDS = ("plain", "striped", "checkered", "dotted")
#: colour–shape pairs reserved for the ``heldout`` split (each colour and shape is still seen in training)
HELDOUT_COMBOS = frozenset({("red", "triangle"), ("green", "star"), ("blue", "diamond"),
                            ("yellow", "circle"), ("purple", "square")})
NUMBER_WORDS = {1: "a", 2: "two", 3: "three", 4: "four"}
SPLITS = ("train", "val", "test", "heldout")


@dataclass
class SceneObject:
    shape: str
    colour: str
    size: str
    x: float
    y: float
    radius: float

    def to_json(self) -> dict:
        return {"shape": self.shape, "colour": self.colour, "size": self.size,
                "center": [round(self.x, 1), round(self.y, 1)], "radius": round(self.radius, 1)}


# ---------------------------------------------------------------------------------------------------------------
# Sampling a scene
# ---------------------------------------------------------------------------------------------------------------
def _sample_combos(rng: random.Random, heldout: bool) -> list[tuple[str, str]]:
    """Distinct (colour, shape) groups with counts, expanded to one entry per object (1–4 objects)."""
    allowed = [(c, s) for c in COLOURS for s in SHAPES if ((c, s) in HELDOUT_COMBOS) == heldout or not heldout]
    if not heldout:
        allowed = [cs for cs in allowed if cs not in HELDOUT_COMBOS]
    n_objects = rng.randint(1, 4)
    n_groups = rng.randint(max(1, math.ceil(n_objects / 2)), min(3, n_objects))
    groups = rng.sample(allowed, n_groups)
    if heldout and not any(g in HELDOUT_COMBOS for g in groups):
        groups[0] = rng.choice(sorted(HELDOUT_COMBOS))
        if len(set(groups)) < len(groups):
            groups = list(dict.fromkeys(groups))
    counts = [1] * len(groups)
    for _ in range(n_objects - len(groups)):
        counts[rng.randrange(len(groups))] += 1
    return [g for g, n in zip(groups, counts) for _ in range(n)]


def _place(rng: random.Random, radius: float, placed: list[SceneObject]) -> tuple[float, float] | None:
    margin = radius + 4
    for _ in range(200):
        x, y = rng.uniform(margin, CANVAS - margin), rng.uniform(margin, CANVAS - margin)
        if all(math.hypot(x - o.x, y - o.y) > radius + o.radius + 8 for o in placed):
            return x, y
    return None


def sample_scene(rng: random.Random, heldout: bool) -> tuple[list[SceneObject], str]:
    while True:
        objects: list[SceneObject] = []
        for colour, shape in _sample_combos(rng, heldout):
            size = rng.choice(list(SIZES))
            radius = rng.uniform(*SIZES[size])
            spot = _place(rng, radius, objects)
            if spot is None:
                break
            objects.append(SceneObject(shape, colour, size, *spot, radius))
        else:
            return objects, rng.choice(BACKGROUNDS)


# ---------------------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------------------
def _polygon(obj: SceneObject) -> list[tuple[float, float]]:
    def ring(n: int, radius_at, phase: float) -> list[tuple[float, float]]:
        return [(obj.x + radius_at(i) * math.cos(phase + 2 * math.pi * i / n),
                 obj.y + radius_at(i) * math.sin(phase + 2 * math.pi * i / n)) for i in range(n)]

    r = obj.radius
    if obj.shape == "square":
        return ring(4, lambda i: r, math.pi / 4)
    if obj.shape == "diamond":
        return ring(4, lambda i: r if i % 2 == 0 else 0.6 * r, -math.pi / 2)
    if obj.shape == "triangle":
        return ring(3, lambda i: r, -math.pi / 2)
    if obj.shape == "star":
        return ring(10, lambda i: r if i % 2 == 0 else 0.45 * r, -math.pi / 2)
    raise ValueError(obj.shape)


def _background(rng: random.Random, kind: str) -> Image.Image:
    # muted colours (low saturation) so that the saturated object colours stay unambiguous
    base = np.array([rng.randint(90, 200)] * 3) + np.array([rng.randint(-20, 20) for _ in range(3)])
    other = np.clip(base + rng.choice([-1, 1]) * rng.randint(30, 55), 0, 255)
    yy, xx = np.mgrid[0:CANVAS, 0:CANVAS]
    if kind == "striped":
        period = rng.randint(10, 24)
        direction = rng.choice([(1, 0), (0, 1), (1, 1), (1, -1)])
        pattern = ((xx * direction[0] + yy * direction[1]) // (period // 2)) % 2 == 0
    elif kind == "checkered":
        cell = rng.randint(14, 32)
        pattern = ((xx // cell) + (yy // cell)) % 2 == 0
    elif kind == "dotted":
        step = rng.randint(12, 20)
        pattern = ((xx % step - step / 2) ** 2 + (yy % step - step / 2) ** 2) < (step / 5) ** 2
    else:
        pattern = np.zeros((CANVAS, CANVAS), dtype=bool)
    pixels = np.where(pattern[..., None], other, base).astype(np.float32)
    pixels += np.asarray(rng.random() * 8 + 2) * np.random.default_rng(rng.getrandbits(32)).standard_normal(pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def render(objects: list[SceneObject], background: str, rng: random.Random) -> tuple[Image.Image, Image.Image]:
    """The RGB image and its label mask (0 = background, ``i + 1`` = object ``i``)."""
    image = _background(rng, background)
    mask = Image.new("L", (CANVAS, CANVAS), 0)
    draw, draw_mask = ImageDraw.Draw(image), ImageDraw.Draw(mask)
    for index, obj in enumerate(objects):
        colour = tuple(int(np.clip(v + rng.randint(-15, 15), 0, 255)) for v in COLOURS[obj.colour])
        if obj.shape == "circle":
            bbox = [obj.x - obj.radius, obj.y - obj.radius, obj.x + obj.radius, obj.y + obj.radius]
            draw.ellipse(bbox, fill=colour)
            draw_mask.ellipse(bbox, fill=index + 1)
        else:
            polygon = _polygon(obj)
            draw.polygon(polygon, fill=colour)
            draw_mask.polygon(polygon, fill=index + 1)
    return image, mask


# ---------------------------------------------------------------------------------------------------------------
# Captions
# ---------------------------------------------------------------------------------------------------------------
Words = list[tuple[str, list[int]]]  # (word, ids of the objects it refers to)


def _groups(objects: list[SceneObject]) -> list[list[int]]:
    """Object ids grouped by (colour, shape), ordered left to right by the group's mean x."""
    by_key: dict[tuple[str, str], list[int]] = {}
    for i, obj in enumerate(objects):
        by_key.setdefault((obj.colour, obj.shape), []).append(i)
    return sorted(by_key.values(), key=lambda ids: np.mean([objects[i].x for i in ids]))


def _phrase(objects: list[SceneObject], ids: list[int], with_size: bool) -> Words:
    obj = objects[ids[0]]
    words = [NUMBER_WORDS[len(ids)]]
    sizes = {objects[i].size for i in ids}
    if with_size and len(sizes) == 1:
        words.append(obj.size)
    words += [obj.colour, obj.shape + ("es" if obj.shape.endswith("s") else "s") * (len(ids) > 1)]
    return [(w, list(ids)) for w in words]


def _listing(objects: list[SceneObject], groups: list[list[int]], with_size: bool = False) -> Words:
    words: Words = []
    for position, ids in enumerate(groups):
        if position > 0:
            words.append(("and", []))
        words += _phrase(objects, ids, with_size)
    return words


def _plain(text: str) -> Words:
    return [(w, []) for w in text.split()]


def _centre(objects: list[SceneObject], ids: list[int]) -> tuple[float, float]:
    return float(np.mean([objects[i].x for i in ids])), float(np.mean([objects[i].y for i in ids]))


def _relation(objects: list[SceneObject], groups: list[list[int]]) -> Words:
    """A spatial phrase: two groups → "A to the left of / above B"; one → its place; more → left to right."""
    if len(groups) == 2:
        (ax, ay), (bx, by) = _centre(objects, groups[0]), _centre(objects, groups[1])
        if abs(ay - by) > abs(ax - bx) * 1.5:
            first, second = (groups[0], groups[1]) if ay < by else (groups[1], groups[0])
            return _phrase(objects, first, False) + _plain("above") + _phrase(objects, second, False)
        return _phrase(objects, groups[0], False) + _plain("to the left of") + _phrase(objects, groups[1], False)
    if len(groups) == 1:
        x, y = _centre(objects, groups[0])
        vertical = "top" if y < CANVAS / 3 else "bottom" if y > 2 * CANVAS / 3 else "middle"
        horizontal = "left" if x < CANVAS / 3 else "right" if x > 2 * CANVAS / 3 else "centre"
        place = "in the centre" if (vertical, horizontal) == ("middle", "centre") else f"in the {vertical} {horizontal}"
        return _phrase(objects, groups[0], False) + _plain(place)
    return _listing(objects, groups) + _plain("from left to right")


def captions_for(objects: list[SceneObject], background: str, rng: random.Random) -> list[Words]:
    groups = _groups(objects)
    listing = _listing(objects, groups)
    n = len(objects)
    count = _plain(f"{'one' if n == 1 else NUMBER_WORDS[n]} {'shape' if n == 1 else 'shapes'}")
    return [
        listing,
        listing + _plain(f"on a {background} background"),
        _relation(objects, groups),
        _plain("there is" if len(groups[0]) == 1 else "there are") + listing + _plain("in the picture"),
        count + _plain(rng.choice(["with", "showing"])) + _listing(objects, groups, with_size=True),
    ]


# ---------------------------------------------------------------------------------------------------------------
# Writing the dataset
# ---------------------------------------------------------------------------------------------------------------
def _make_image(args: tuple[int, str, int, str]) -> dict:
    index, split, seed, out_dir = args
    rng = random.Random(f"{seed}:{index}")  # one stream per image: deterministic and order-free
    objects, background = sample_scene(rng, heldout=(split == "heldout"))
    image, mask = render(objects, background, rng)
    filename = f"scene_{index:06d}.jpg"
    image.save(Path(out_dir) / "images" / filename, quality=95)
    mask.save(Path(out_dir) / "masks" / filename.replace(".jpg", ".png"))
    sentences = []
    for j, words in enumerate(captions_for(objects, background, rng)):
        tokens = [w for w, _ in words]
        sentences.append({"tokens": tokens, "raw": " ".join(tokens), "imgid": index, "sentid": index * 5 + j,
                          "token_objects": [ids for _, ids in words]})
    return {"filepath": "images", "filename": filename, "imgid": index, "split": split,
            "sentids": [s["sentid"] for s in sentences], "sentences": sentences,
            "mask": f"masks/{filename.replace('.jpg', '.png')}", "background": background,
            "objects": [o.to_json() for o in objects]}


def generate(out_dir: str | Path, sizes: dict[str, int] | None = None, seed: int = 0, workers: int = 1,
             progress: bool = True) -> Path:
    """Write images, masks and ``dataset_scenes.json`` to ``out_dir``; returns the JSON path.

    The same ``seed`` and ``sizes`` always give byte-identical annotations and identical pixels.
    """
    sizes = sizes or {"train": 6000, "val": 500, "test": 500, "heldout": 500}
    unknown = set(sizes) - set(SPLITS)
    if unknown:
        raise ValueError(f"unknown split(s) {sorted(unknown)}; choose from {SPLITS}")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "masks").mkdir(parents=True, exist_ok=True)
    jobs, index = [], 0
    for split in SPLITS:
        for _ in range(sizes.get(split, 0)):
            jobs.append((index, split, seed, str(out)))
            index += 1
    bar = dict(total=len(jobs), desc="generating scenes", unit="img", disable=not progress)
    if workers > 1:
        with ProcessPoolExecutor(workers) as pool:
            images = list(tqdm(pool.map(_make_image, jobs, chunksize=32), **bar))
    else:
        images = [_make_image(job) for job in tqdm(jobs, **bar)]
    path = out / "dataset_scenes.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"dataset": "scenes", "seed": seed, "images": images}))
    tmp.replace(path)  # atomic: a crash never leaves a half-written annotation file
    return path


# ---------------------------------------------------------------------------------------------------------------
# Scoring captions against the scene content
# ---------------------------------------------------------------------------------------------------------------
def named_objects(tokens: list[str], objects: list[dict]) -> list[bool]:
    """For each object, whether the caption names its colour and shape together ("red circle(s)")."""
    pairs = set(zip(tokens, tokens[1:]))
    out = []
    for obj in objects:
        forms = {obj["shape"], obj["shape"] + ("es" if obj["shape"].endswith("s") else "s")}
        out.append(any((obj["colour"], form) in pairs for form in forms))
    return out


def object_naming_accuracy(items: list[tuple[list[str], list[dict]]]) -> float:
    """Fraction of all objects (over all images) named with the right colour and shape."""
    flags = [flag for tokens, objects in items for flag in named_objects(tokens, objects)]
    return sum(flags) / max(len(flags), 1)
