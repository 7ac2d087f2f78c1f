"""An out-of-distribution test set of shape scenes, drawn by a renderer written separately from the generator.

The scene generator (:mod:`.scenes`) draws with PIL's aliased polygon fill on a 256×256 textured canvas.  This
module shares only its *vocabulary* with it (colour and shape names, the held-out colour–shape pairs it leaves
out, and the caption wording of the references) and draws everything else its own way:

* **renderer**: matplotlib patches rasterised by Agg (anti-aliased edges), with its own shape geometry (a turned
  square and triangle, a 5-point star of varying depth, a rhombus of varying width);
* **canvas**: other sizes and aspect ratios, landscape and portrait (about 0.56 to 1.78);
* **background**: plain (white, greys, pale tints), noisy (strong per-pixel noise) or a smooth gradient;
* **colours**: several named shades per colour word (``crimson``, ``firebrick``, ``royalblue``, ``gold``...),
  jittered again per object;
* **objects** from 3 % to 22 % of the shorter side in circumradius (the generator: 6.6 % to 15.6 %);
* **JPEG** at quality 30–90.

Each object's pixel mask comes from the exact shape geometry (pixel centres inside the patch's path), written as
one label PNG per image (``i + 1`` = object ``i``) like the generator's, and the JSON is the same Karpathy layout
(``dataset_scenes.json``, split ``ood``), so ``captioner eval CKPT --dataset .cache/ood --split ood`` scores it,
``objects_named`` included, and ``--grounding`` can use the masks.  Colour–shape pairs held out by the generator
are left out, so the set measures the change of renderer alone, not compositional generalisation as well.
Never train on it.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
from PIL import Image

from ..files import being_written, held_alone, read_json_file, write_atomically
from .scenes import COLOURS, HELDOUT_COMBOS, SHAPES, SceneObject, captions_for

OOD_VERSION = 1
SPLIT = "ood"

#: matplotlib colour names (and a few hex shades) per colour word: other shades than the generator's one RGB each
SHADES = {
    "red": ("red", "crimson", "firebrick", "tab:red", "#e03a2f"),
    "green": ("forestgreen", "limegreen", "tab:green", "seagreen", "#2e9e3e"),
    "blue": ("royalblue", "mediumblue", "dodgerblue", "#1f4fd8", "#3050c0"),
    "yellow": ("gold", "yellow", "#ffe135", "#f2d22e"),
    "purple": ("purple", "darkviolet", "rebeccapurple", "mediumorchid", "#7d3c98"),
    "orange": ("darkorange", "tab:orange", "#f28c28", "#ff8c1a"),
}
ASPECTS = (9 / 16, 2 / 3, 3 / 4, 1.0, 4 / 3, 3 / 2, 16 / 9)  # width / height
BACKGROUNDS = ("plain", "noisy", "gradient")


def _background(rng: np.random.Generator, kind: str, width: int, height: int) -> np.ndarray:
    """``[H, W, 3]`` float pixels in 0..255: unpatterned and unsaturated, so object colours stay nameable."""
    def muted() -> np.ndarray:
        grey = rng.uniform(25, 250)
        return np.clip(grey + rng.uniform(-18, 18, 3), 0, 255)

    if kind == "gradient":
        start, end = muted(), muted()
        angle = rng.uniform(0, 2 * math.pi)
        yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
        t = (xx * math.cos(angle) + yy * math.sin(angle))
        t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
        return start[None, None] * (1 - t[..., None]) + end[None, None] * t[..., None]
    pixels = np.broadcast_to(muted(), (height, width, 3)).astype(np.float32)
    if kind == "noisy":
        pixels = pixels + rng.normal(0.0, rng.uniform(12, 30), pixels.shape)
    return pixels


def _patch(shape: str, x: float, y: float, r: float, rng: np.random.Generator, colour):
    """A matplotlib patch of circumradius ``r`` centred at (x, y) (image pixels, y down)."""
    from matplotlib import patches

    turn = math.radians(rng.uniform(-12, 12))
    if shape == "circle":
        return patches.Circle((x, y), r, facecolor=colour, edgecolor="none")
    if shape == "square":
        return patches.RegularPolygon((x, y), 4, radius=r, orientation=math.pi / 4 + turn, facecolor=colour,
                                      edgecolor="none")
    if shape == "triangle":
        # pointing up on screen: with y growing downward, vertex at angle -90°
        return patches.RegularPolygon((x, y), 3, radius=r, orientation=math.pi + turn, facecolor=colour,
                                      edgecolor="none")
    if shape == "star":
        depth = rng.uniform(0.38, 0.55)
        points = [(x + (r if i % 2 == 0 else depth * r) * math.cos(-math.pi / 2 + turn + i * math.pi / 5),
                   y + (r if i % 2 == 0 else depth * r) * math.sin(-math.pi / 2 + turn + i * math.pi / 5))
                  for i in range(10)]
        return patches.Polygon(points, closed=True, facecolor=colour, edgecolor="none")
    if shape == "diamond":
        half_width = rng.uniform(0.55, 0.75) * r
        return patches.Polygon([(x, y - r), (x + half_width, y), (x, y + r), (x - half_width, y)], closed=True,
                               facecolor=colour, edgecolor="none")
    raise ValueError(shape)


def _shade(rng: np.random.Generator, colour_word: str) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    base = np.asarray(to_rgb(SHADES[colour_word][rng.integers(len(SHADES[colour_word]))]))
    return tuple(np.clip(base + rng.uniform(-0.05, 0.05, 3), 0, 1))


def _draw(background: np.ndarray, items: list) -> tuple[np.ndarray, list[np.ndarray]]:
    """Rasterise the patches over the background with Agg; returns the RGB pixels and each patch's boolean mask
    (pixel centres inside the patch's path, the exact geometry rather than the anti-aliased coverage)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    height, width = background.shape[:2]
    dpi = 100
    figure = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    canvas = FigureCanvasAgg(figure)
    axes = figure.add_axes((0, 0, 1, 1))
    axes.set_xlim(0, width)
    axes.set_ylim(height, 0)  # image coordinates: y grows downward
    axes.axis("off")
    axes.imshow(np.clip(background, 0, 255).astype(np.uint8), extent=(0, width, height, 0), interpolation="nearest")
    for patch in items:
        patch.set_antialiased(True)
        axes.add_patch(patch)
    canvas.draw()
    pixels = np.asarray(canvas.buffer_rgba())[..., :3].copy()
    yy, xx = np.mgrid[0:height, 0:width]
    centres = np.stack([xx.ravel() + 0.5, yy.ravel() + 0.5], axis=1)
    masks = []
    for patch in items:
        path = patch.get_path().transformed(patch.get_patch_transform())
        masks.append(path.contains_points(centres).reshape(height, width))
    return pixels, masks


def _sample_objects(rng: np.random.Generator, width: int, height: int) -> list[tuple[str, str, float, float, float]]:
    """(colour, shape, x, y, r) for 1–4 objects that do not touch; some share their colour and shape."""
    allowed = [(c, s) for c in COLOURS for s in SHAPES if (c, s) not in HELDOUT_COMBOS]
    short = min(width, height)
    while True:
        count = int(rng.integers(1, 5))
        kinds = [allowed[i] for i in rng.choice(len(allowed), size=count)]
        if count > 1 and rng.random() < 0.3:  # a repeated kind ("two red circles")
            kinds[1] = kinds[0]
        placed: list[tuple[str, str, float, float, float]] = []
        for colour, shape in kinds:
            r = float(rng.uniform(0.03, 0.22)) * short
            for _ in range(300):
                x, y = rng.uniform(r + 2, width - r - 2), rng.uniform(r + 2, height - r - 2)
                if all(math.hypot(x - px, y - py) > r + pr + 5 for _, _, px, py, pr in placed):
                    placed.append((colour, shape, float(x), float(y), r))
                    break
            else:
                break
        if len(placed) == count:
            return placed


def _ood_image(index: int, seed: int, out: Path) -> dict:
    rng = np.random.default_rng([seed, index, 20240])
    aspect = ASPECTS[rng.integers(len(ASPECTS))]
    side = rng.uniform(180, 480)
    width, height = int(round(side * math.sqrt(aspect))), int(round(side / math.sqrt(aspect)))
    kind = BACKGROUNDS[rng.integers(len(BACKGROUNDS))]
    placed = _sample_objects(rng, width, height)
    items = [_patch(shape, x, y, r, rng, _shade(rng, colour)) for colour, shape, x, y, r in placed]
    pixels, masks = _draw(_background(rng, kind, width, height), items)
    labels = np.zeros((height, width), np.uint8)
    for i, mask in enumerate(masks):
        labels[mask] = i + 1
    quality = int(rng.integers(30, 91))
    filename = f"ood_{index:06d}.jpg"
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=quality)
    (out / "images" / filename).write_bytes(buffer.getvalue())
    Image.fromarray(labels).save(out / "masks" / filename.replace(".jpg", ".png"))
    short = min(width, height)
    # "small" / "large" relative to the shorter side, split where the generator's two size ranges meet
    objects = [SceneObject(shape, colour, "small" if r / short < 0.105 else "large", x, y, r)
               for colour, shape, x, y, r in placed]
    # the references: the generator's wording, with "plain" for every background (none of them is patterned)
    caption_rng = np.random.default_rng([seed, index, 7])
    sentences = []
    for j, words in enumerate(captions_for(objects, "plain", _PythonChoice(caption_rng), (width, height))):
        tokens = [w for w, _ in words]
        sentences.append({"tokens": tokens, "raw": " ".join(tokens), "imgid": index, "sentid": index * 5 + j,
                          "token_objects": [ids for _, ids in words]})
    return {"filepath": "images", "filename": filename, "imgid": index, "split": SPLIT,
            "sentids": [s["sentid"] for s in sentences], "sentences": sentences,
            "mask": f"masks/{filename.replace('.jpg', '.png')}", "background": kind, "canvas": [width, height],
            "jpeg_quality": quality, "objects": [o.to_json() for o in objects]}


class _PythonChoice:
    """The one ``random.Random`` method the caption templates use (``choice``: a :class:`.scenes.Chooser`), backed
    by a numpy generator."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def choice(self, options):
        return options[int(self.rng.integers(len(options)))]


def generate_ood(out_dir: str | Path = ".cache/ood", images: int = 500, seed: int = 0) -> Path:
    """Write the OOD set (images, label masks, ``dataset_scenes.json`` with split ``ood``); returns the JSON
    path.  Deterministic: the same ``images`` and ``seed`` give identical files.  Skips the work when ``out_dir``
    already holds this version's set for the same arguments."""
    out = Path(out_dir)
    path = out / "dataset_scenes.json"
    header = {"dataset": "ood", "ood_version": OOD_VERSION, "seed": seed, "size": images}
    with held_alone(out, being_written(out, "captioner data ood")):
        if path.exists() or path.is_symlink():
            existing = read_json_file(path, "a data set's JSON")
            if all(existing.get(k) == v for k, v in header.items()):
                return path
            if existing.get("dataset") != "ood":  # the generated scenes (the default --dataset), a user's own set
                raise ValueError(f"{path} holds another data set ({existing.get('dataset') or 'unnamed'}), not an "
                                 "OOD set: nothing was written; give --out a folder of its own")
        (out / "images").mkdir(parents=True, exist_ok=True)
        (out / "masks").mkdir(parents=True, exist_ok=True)
        entries = [_ood_image(index, seed, out) for index in range(images)]
        write_atomically(path, json.dumps({**header, "images": entries}))
    return path
