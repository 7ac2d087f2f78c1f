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

import colorsys
import json
import math
import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Collection, Protocol, Sequence, TypeVar

import numpy as np
from PIL import Image, ImageDraw

from ..files import being_written, held_alone, write_atomically
from ..progress import progress_bar
from .karpathy import read_karpathy_json

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
#: scenes per split when none are given (``captioner data generate``'s defaults)
DEFAULT_SIZES = {"train": 6000, "val": 500, "test": 500, "heldout": 500}
#: bumped whenever the images or references a seed produces change, so that `captioner data generate --if-stale`
#: (and `make data`) rewrite a dataset made by an older generator.  2: "an" before vowel sounds ("an orange circle")
GENERATOR_VERSION = 2
#: words that begin with a vowel letter but a consonant sound ("a unit") or the reverse ("an hour"): none of the
#: generator's words today, listed so that a new colour or shape word gets the right article without a code change
_ARTICLE_EXCEPTIONS = {"one": "a", "unit": "a", "unique": "a", "uniform": "a", "user": "a", "hour": "an",
                       "honest": "an"}


def article(next_word: str) -> str:
    """The indefinite article for the word that follows it: "an" before a vowel sound ("an orange circle"),
    "a" otherwise ("a large orange circle": the article agrees with the word right after it)."""
    word = next_word.lower()
    if word in _ARTICLE_EXCEPTIONS:
        return _ARTICLE_EXCEPTIONS[word]
    return "an" if word[:1] in "aeiou" else "a"


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
    # a held-out scene draws from the held-out pairs alone, any other scene from all the rest
    allowed = [(c, s) for c in COLOURS for s in SHAPES if ((c, s) in HELDOUT_COMBOS) == heldout]
    n_objects = rng.randint(1, 4)
    n_groups = rng.randint(max(1, math.ceil(n_objects / 2)), min(3, n_objects))
    groups = rng.sample(allowed, n_groups)
    counts = [1] * len(groups)
    for _ in range(n_objects - len(groups)):
        counts[rng.randrange(len(groups))] += 1
    return [g for g, n in zip(groups, counts) for _ in range(n)]


@dataclass(frozen=True)
class Variation:
    """How far a *varied* scene departs from the classic 256×256 one (``captioner data generate --varied``): the
    training-time augmentation for robustness beyond the generator's own look.  Features are cached per image, so
    the augmentation is drawn into the images once, each image with its own canvas, colours, noise and JPEG.

    The words of the references are unchanged (same vocabulary); sizes "small" / "large" are relative to the
    canvas's shorter side, and places ("on the left") to the canvas's own width and height.
    """

    classic_share: float = 0.25  # images on the classic 256×256 canvas (still with the other variations)
    side: tuple[int, int] = (160, 400)  # geometric mean of width and height, pixels
    aspect: tuple[float, float] = (0.5, 2.0)  # width / height; < 1 is portrait
    small: tuple[float, float] = (0.045, 0.095)  # circumradius ÷ shorter side (classic: 0.066–0.086)
    large: tuple[float, float] = (0.11, 0.19)  # classic: 0.125–0.156
    # colour jitter in HSV, so a shade never drifts toward a neighbouring name (orange's hue sits 0.07 from both
    # red's and yellow's); the classic generator jitters ±15 per RGB channel
    hue_jitter: float = 0.02
    saturation: tuple[float, float] = (0.75, 1.0)
    value: tuple[float, float] = (0.85, 1.1)  # darker turns yellow olive and orange brown
    channel_jitter: int = 10  # ± per RGB channel on top
    noise: tuple[float, float] = (0.0, 25.0)  # Gaussian noise σ range (classic: 2–10)
    rotation: float = 15.0  # ± degrees for polygons
    supersample: tuple[int, ...] = (1, 3, 4)  # 1 = aliased edges as in the classic generator
    jpeg_quality: tuple[int, int] = (35, 95)


#: named variations for ``captioner data generate --varied NAME``: ``standard`` is what the shipped checkpoints
#: trained on (all but ``xtransformer``'s last stage); ``small-objects`` draws "small" objects down to 3 % of the
#: shorter side (the out-of-distribution set's low end), added when that set's smallest objects were among its
#: worst misses (docs/decisions.md, "Smaller objects in the varied scenes")
VARIATIONS = {"standard": Variation(), "small-objects": Variation(small=(0.03, 0.095))}


def _place(rng: random.Random, radius: float, placed: list[SceneObject],
           canvas: tuple[int, int] = (CANVAS, CANVAS)) -> tuple[float, float] | None:
    margin = radius + 4
    width, height = canvas
    for _ in range(200):
        x, y = rng.uniform(margin, width - margin), rng.uniform(margin, height - margin)
        if all(math.hypot(x - o.x, y - o.y) > radius + o.radius + 8 for o in placed):
            return x, y
    return None


def sample_scene(rng: random.Random, heldout: bool, canvas: tuple[int, int] = (CANVAS, CANVAS),
                 sizes: dict[str, tuple[float, float]] | None = None) -> tuple[list[SceneObject], str]:
    sizes = sizes or SIZES
    while True:
        objects: list[SceneObject] = []
        for colour, shape in _sample_combos(rng, heldout):
            size = rng.choice(list(sizes))
            radius = rng.uniform(*sizes[size])
            spot = _place(rng, radius, objects, canvas)
            if spot is None:
                break
            objects.append(SceneObject(shape, colour, size, *spot, radius))
        else:
            return objects, rng.choice(BACKGROUNDS)


# ---------------------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------------------
def _polygon(obj: SceneObject, scale: float = 1.0, rotation: float = 0.0) -> list[tuple[float, float]]:
    """The shape's vertices; ``scale`` maps to a supersampled canvas, ``rotation`` (radians) turns it."""
    def ring(n: int, radius_at, phase: float) -> list[tuple[float, float]]:
        phase += rotation
        return [(scale * (obj.x + radius_at(i) * math.cos(phase + 2 * math.pi * i / n)),
                 scale * (obj.y + radius_at(i) * math.sin(phase + 2 * math.pi * i / n))) for i in range(n)]

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


def _background(rng: random.Random, kind: str, canvas: tuple[int, int] = (CANVAS, CANVAS),
                noise: tuple[float, float] = (2.0, 10.0)) -> Image.Image:
    # muted colours (low saturation) so that the saturated object colours stay unambiguous
    base = np.array([rng.randint(90, 200)] * 3) + np.array([rng.randint(-20, 20) for _ in range(3)])
    other = np.clip(base + rng.choice([-1, 1]) * rng.randint(30, 55), 0, 255)
    width, height = canvas
    yy, xx = np.mgrid[0:height, 0:width]
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
        pattern = np.zeros((height, width), dtype=bool)
    pixels = np.where(pattern[..., None], other, base).astype(np.float32)
    sigma = rng.random() * (noise[1] - noise[0]) + noise[0]
    pixels += np.asarray(sigma) * np.random.default_rng(rng.getrandbits(32)).standard_normal(pixels.shape)
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


def _jittered_colour(rng: random.Random, name: str, variation: Variation) -> tuple[int, int, int]:
    hue, saturation, value = colorsys.rgb_to_hsv(*(v / 255 for v in COLOURS[name]))
    hue = (hue + rng.uniform(-variation.hue_jitter, variation.hue_jitter)) % 1.0
    saturation = min(1.0, saturation * rng.uniform(*variation.saturation))
    value = min(1.0, value * rng.uniform(*variation.value))
    jitter = variation.channel_jitter
    return tuple(int(np.clip(255 * v + rng.randint(-jitter, jitter), 0, 255))
                 for v in colorsys.hsv_to_rgb(hue, saturation, value))


def render_varied(objects: list[SceneObject], background: str, rng: random.Random, canvas: tuple[int, int],
                  variation: Variation) -> tuple[Image.Image, Image.Image]:
    """A varied scene: stronger colour jitter and background noise, turned polygons and, when supersampled,
    anti-aliased edges (drawn at ``k``× and reduced with a box filter).  The label mask is drawn at 1× from the
    same geometry, so each object's mask is its hard (non-anti-aliased) footprint."""
    width, height = canvas
    k = rng.choice(variation.supersample)
    image = _background(rng, background, canvas, variation.noise)
    layer = image.resize((width * k, height * k), Image.NEAREST) if k > 1 else image
    mask = Image.new("L", canvas, 0)
    draw, draw_mask = ImageDraw.Draw(layer), ImageDraw.Draw(mask)
    for index, obj in enumerate(objects):
        colour = _jittered_colour(rng, obj.colour, variation)
        if obj.shape == "circle":
            box = [obj.x - obj.radius, obj.y - obj.radius, obj.x + obj.radius, obj.y + obj.radius]
            draw.ellipse([v * k for v in box], fill=colour)
            draw_mask.ellipse(box, fill=index + 1)
        else:
            turn = math.radians(rng.uniform(-variation.rotation, variation.rotation))
            draw.polygon(_polygon(obj, k, turn), fill=colour)
            draw_mask.polygon(_polygon(obj, 1.0, turn), fill=index + 1)
    if k > 1:
        # the background keeps its own (1×) noise: NEAREST up then BOX down returns it unchanged
        image = layer.resize(canvas, Image.BOX)
    return image, mask


def sample_varied_canvas(rng: random.Random, variation: Variation) -> tuple[int, int]:
    """A canvas of varied size and aspect ratio (portrait included), or the classic square."""
    if rng.random() < variation.classic_share:
        return CANVAS, CANVAS
    side = rng.uniform(*variation.side)
    aspect = math.exp(rng.uniform(math.log(variation.aspect[0]), math.log(variation.aspect[1])))
    return max(64, round(side * math.sqrt(aspect))), max(64, round(side / math.sqrt(aspect)))


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
    words = []
    sizes = {objects[i].size for i in ids}
    if with_size and len(sizes) == 1:
        words.append(obj.size)
    words += [obj.colour, obj.shape + ("es" if obj.shape.endswith("s") else "s") * (len(ids) > 1)]
    count = article(words[0]) if len(ids) == 1 else NUMBER_WORDS[len(ids)]
    return [(w, list(ids)) for w in [count] + words]


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


def _place_phrase(vertical: str, horizontal: str) -> str:
    """Where one group sits, in idiomatic English: "in the top left", "at the top", "on the left", "in the
    centre" (never "in the middle left" or "in the top centre")."""
    if vertical == "middle":
        return "in the centre" if horizontal == "centre" else f"on the {horizontal}"
    return f"at the {vertical}" if horizontal == "centre" else f"in the {vertical} {horizontal}"


def _relation(objects: list[SceneObject], groups: list[list[int]],
              canvas: tuple[int, int] = (CANVAS, CANVAS)) -> Words:
    """A spatial phrase: two groups → "A to the left of / above B"; one → its place; more → left to right."""
    if len(groups) == 2:
        (ax, ay), (bx, by) = _centre(objects, groups[0]), _centre(objects, groups[1])
        if abs(ay - by) > abs(ax - bx) * 1.5:
            first, second = (groups[0], groups[1]) if ay < by else (groups[1], groups[0])
            return _phrase(objects, first, False) + _plain("above") + _phrase(objects, second, False)
        return _phrase(objects, groups[0], False) + _plain("to the left of") + _phrase(objects, groups[1], False)
    if len(groups) == 1:
        x, y = _centre(objects, groups[0])
        width, height = canvas
        vertical = "top" if y < height / 3 else "bottom" if y > 2 * height / 3 else "middle"
        horizontal = "left" if x < width / 3 else "right" if x > 2 * width / 3 else "centre"
        return _phrase(objects, groups[0], False) + _plain(_place_phrase(vertical, horizontal))
    return _listing(objects, groups) + _plain("from left to right")


_Option = TypeVar("_Option")


class Chooser(Protocol):
    """What the caption templates draw with: a ``random.Random``, or the OOD set's numpy-backed stand-in
    (:mod:`.ood`), which has ``choice`` alone."""

    def choice(self, options: Sequence[_Option], /) -> _Option: ...


def captions_for(objects: list[SceneObject], background: str, rng: Chooser,
                 canvas: tuple[int, int] = (CANVAS, CANVAS)) -> list[Words]:
    """Five references; ``canvas`` (width, height) places a lone group ("in the top left"); ``rng`` picks among
    the wordings."""
    groups = _groups(objects)
    listing = _listing(objects, groups)
    n = len(objects)
    count = _plain(f"{'one' if n == 1 else NUMBER_WORDS[n]} {'shape' if n == 1 else 'shapes'}")
    return [
        listing,
        listing + _plain(f"on {article(background)} {background} background"),
        _relation(objects, groups, canvas),
        _plain("there is" if len(groups[0]) == 1 else "there are") + listing + _plain("in the picture"),
        count + _plain(rng.choice(["with", "showing"])) + _listing(objects, groups, with_size=True),
    ]


# ---------------------------------------------------------------------------------------------------------------
# Writing the dataset
# ---------------------------------------------------------------------------------------------------------------
def _make_image(args: tuple[int, str, int, str, Variation | None]) -> dict:
    index, split, seed, out_dir, variation = args
    if variation is None:
        rng = random.Random(f"{seed}:{index}")  # one stream per image: deterministic and order-free
        canvas = (CANVAS, CANVAS)
        objects, background = sample_scene(rng, heldout=(split == "heldout"))
        image, mask = render(objects, background, rng)
        quality = 95
    else:
        rng = random.Random(f"{seed}:{index}:varied")  # other scenes than the classic dataset of the same seed
        canvas = sample_varied_canvas(rng, variation)
        short = min(canvas)
        sizes = {"small": tuple(f * short for f in variation.small), "large": tuple(f * short for f in variation.large)}
        objects, background = sample_scene(rng, heldout=(split == "heldout"), canvas=canvas, sizes=sizes)
        image, mask = render_varied(objects, background, rng, canvas, variation)
        quality = rng.randint(*variation.jpeg_quality)
    filename = f"scene_{index:06d}.jpg"
    image.save(Path(out_dir) / "images" / filename, quality=quality)
    mask.save(Path(out_dir) / "masks" / filename.replace(".jpg", ".png"))
    sentences = []
    for j, words in enumerate(captions_for(objects, background, rng, canvas)):
        tokens = [w for w, _ in words]
        sentences.append({"tokens": tokens, "raw": " ".join(tokens), "imgid": index, "sentid": index * 5 + j,
                          "token_objects": [ids for _, ids in words]})
    return {"filepath": "images", "filename": filename, "imgid": index, "split": split,
            "sentids": [s["sentid"] for s in sentences], "sentences": sentences,
            "mask": f"masks/{filename.replace('.jpg', '.png')}", "background": background,
            "canvas": list(canvas), "objects": [o.to_json() for o in objects]}


def dataset_header(seed: int, sizes: dict[str, int], variation: Variation | None,
                   only: Collection[str] | None = None) -> dict:
    """What determines a dataset's content: compared by :func:`is_current` to skip an up-to-date regeneration.
    ``only`` (the splits written, where not all were) is recorded only where given, so that the header of a whole
    data set reads as it did before there was a choice."""
    header = {"dataset": "scenes", "generator_version": GENERATOR_VERSION, "seed": seed,
              "sizes": {split: int(sizes.get(split, 0)) for split in SPLITS},
              "variation": None if variation is None else asdict(variation)}
    if only is not None:
        header["only"] = [split for split in SPLITS if split in only]
    return header


def split_indices(sizes: dict[str, int]) -> dict[str, range]:
    """Each split's image indices (``imgid``, and the number in the file name): the splits in :data:`SPLITS` order,
    each numbered on from the one before.  An image's index seeds its scene, so the same sizes give every split the
    same images whichever splits are written."""
    indices, start = {}, 0
    for split in SPLITS:
        indices[split] = range(start, start + sizes.get(split, 0))
        start += sizes.get(split, 0)
    return indices


#: the Makefile's targets that write a scene data set, by the ``captioner data generate`` arguments they give beside
#: ``--out`` and ``--if-stale``: a model card names the target a reader types (tests/test_card_regeneration.py holds
#: them to the Makefile)
MAKE_TARGETS = {"": "make data", "--varied --train 12000": "make data-varied",
                "--varied small-objects --train 12000": "make data-varied-small"}


def generate_arguments(header: dict) -> list[str] | None:
    """The ``captioner data generate`` arguments (beside ``--out``) that write the data set of ``header`` (what
    :func:`dataset_header` recorded in its ``dataset_scenes.json``); None when this generator cannot write it again:
    another generator version, or a variation it no longer names."""
    if header.get("generator_version") != GENERATOR_VERSION or not isinstance(header.get("sizes"), dict):
        return None
    args: list[str] = []
    if header.get("variation") is not None:
        # through JSON, as the header was written: the variation's ranges are lists in the file
        name = next((name for name, variation in VARIATIONS.items()
                     if json.loads(json.dumps(asdict(variation))) == header["variation"]), None)
        if name is None:
            return None
        args += ["--varied"] if name == "standard" else ["--varied", name]  # standard: what a bare --varied draws
    for split in SPLITS:
        if header["sizes"].get(split, 0) != DEFAULT_SIZES[split]:
            args += [f"--{split}", str(header["sizes"].get(split, 0))]
    if header.get("seed", 0) != 0:
        args += ["--seed", str(header["seed"])]
    if header.get("only") is not None:
        args += ["--only", *header["only"]]
    return args


def describe_dataset(header: dict) -> str:
    """How a model card names a scene data set, from its own header: the generator, its version and the command that
    writes the same files again (the Makefile's target for it, where one does)."""
    args = generate_arguments(header)
    if args is None:
        return (f"generated scenes (this project's generator, models/data/scenes.py, version "
                f"{header.get('generator_version', '?')}, which this checkout's generator does not draw again)")
    command = " ".join(["captioner data generate", *args])
    target = MAKE_TARGETS.get(" ".join(args))
    how = f"`{target}`, that is `{command}`" if target else f"`{command}`"
    return f"generated scenes (this project's generator, models/data/scenes.py, version {GENERATOR_VERSION}: {how}, " \
           "no download)"


def read_dataset_header(path: str | Path) -> dict | None:
    """The settings a ``dataset_scenes.json`` records (:func:`dataset_header`, without its images); None when the
    file is missing or is not JSON."""
    try:
        data = read_karpathy_json(path)
    except (OSError, ValueError):
        return None
    return {key: value for key, value in data.items() if key != "images"}


def is_current(out_dir: str | Path, sizes: dict[str, int], seed: int = 0, variation: Variation | None = None,
               only: Collection[str] | None = None) -> bool:
    """Whether ``out_dir`` already holds the dataset this generator version would write for these settings (``only``
    as :func:`generate` takes it: a data set of some splits is never taken for the whole one, nor the reverse)."""
    return describes(read_dataset_header(Path(out_dir) / "dataset_scenes.json"), sizes, seed, variation, only)


def describes(held: dict | None, sizes: dict[str, int], seed: int = 0, variation: Variation | None = None,
              only: Collection[str] | None = None) -> bool:
    """Whether a data set's header (:func:`read_dataset_header`; None: no data set) is the one :func:`generate`
    writes for these settings (:func:`is_current`, for a header already read)."""
    if held is None:
        return False
    # through JSON, as it was written: the variation's ranges are tuples in Python and lists in the file
    header = json.loads(json.dumps(dataset_header(seed, sizes, variation, only)))
    return all(held.get(key) == header.get(key) for key in {*header, "only"})  # "only": in neither, or alike


def generate(out_dir: str | Path, sizes: dict[str, int] | None = None, seed: int = 0, workers: int = 1,
             progress: bool = True, variation: Variation | None = None, only: Collection[str] | None = None) -> Path:
    """Write images, masks and ``dataset_scenes.json`` to ``out_dir``; returns the JSON path.

    The same ``seed``, ``sizes`` and ``variation`` always give byte-identical annotations and identical pixels.
    ``variation`` draws varied scenes (canvas sizes and aspect ratios, colour jitter, noise, anti-aliasing, JPEG):
    the training-time augmentation, written to its own folder so no feature cache mixes the two.
    ``only`` writes those splits alone, each image the one the whole data set has (:func:`split_indices`): the
    test scenes of a shipped checkpoint without its 6,000 training scenes.
    """
    sizes = sizes or DEFAULT_SIZES
    unknown = (set(sizes) | set(only or ())) - set(SPLITS)
    if unknown:
        raise ValueError(f"unknown split(s) {sorted(unknown)}; choose from {SPLITS}")
    out = Path(out_dir)
    # images are written in place: a second run at once (another seed) would mix its images into this one's
    with held_alone(out, being_written(out, "captioner data generate")):
        (out / "images").mkdir(parents=True, exist_ok=True)
        (out / "masks").mkdir(parents=True, exist_ok=True)
        jobs = [(index, split, seed, str(out), variation) for split, indices in split_indices(sizes).items()
                if only is None or split in only for index in indices]
        bar = dict(total=len(jobs), desc="generating scenes", unit="img", disable=not progress)
        if workers > 1:
            # spawned, not forked: the caller may hold threads (PyTorch's, a test runner's), and a forked child of a
            # threaded process can deadlock (Python 3.12 warns so; 3.14 no longer forks by default on Linux). A
            # script that calls this with workers > 1 needs the `if __name__ == "__main__":` guard spawning asks for
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                images = list(progress_bar(pool.map(_make_image, jobs, chunksize=32), **bar))
        else:
            images = [_make_image(job) for job in progress_bar(jobs, **bar)]
        path = out / "dataset_scenes.json"
        # a crash never leaves a half-written annotation file
        write_atomically(path, json.dumps({**dataset_header(seed, sizes, variation, only), "images": images}))
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
