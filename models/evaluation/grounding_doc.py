"""``docs/grounding.md``'s generated part (``captioner grounding-doc``, ``make grounding``): the Flickr30k Entities
grounding of every real-photo checkpoint, from ``captioner eval --grounding entities:DIR --output`` reports only.

A checkpoint counts as a real-photo one when it was trained on Flickr8k or Flickr30k, the photos Flickr30k Entities
annotate, read from Karpathy's JSON or the publishers' token file (``datasets.named_by_path``).  Written between the
document's markers: the table of both modes with chance rows, the per-type table, the figure of those numbers, a figure
of a few scikit-image photos with the words' heatmaps of the softmax, sparsemax and TVmax checkpoints side by side, and
a closing note that reads the normalisers' ordering off the intervals (and the scene benchmark's, from the scene reports
in ``docs/results/``).  A number no report holds is never filled in.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..attention import NORMALISERS
from ..checkpoint import checkpoint_children, read_config
from ..data.datasets import named_by_path
from .card import load_report
from .grounding import interval
from .phrase_grounding import CAPTION_SOURCES, summary_table, type_table
from .zoo_table import normaliser_label, write_between_markers

START, END = "<!-- grounding:start -->", "<!-- grounding:end -->"
#: scikit-image's bundled photos for the heatmap figure (never a Flickr photo: they may not be redistributed)
EXAMPLE_PHOTOS = ("chelsea", "astronaut", "coffee")
#: the data sets whose photos Flickr30k Entities annotates
REAL_PHOTO_DATASETS = ("flickr8k", "flickr30k")


def is_real_photo(checkpoint: Path) -> bool:
    meta = read_config(checkpoint).get("meta", {})
    dataset = meta.get("train_config", {}).get("dataset") or meta.get("dataset") or ""
    return bool(dataset) and named_by_path(dataset) in REAL_PHOTO_DATASETS


def real_photo_checkpoints(weights: Path) -> list[Path]:
    """Checkpoint folders under ``weights`` trained on Flickr photos, by name."""
    return [p for p in checkpoint_children(weights) if is_real_photo(p)]


def normaliser(checkpoint: Path) -> str:
    """The checkpoint's normaliser, as the tables label it (an ensemble's is no one normaliser's example)."""
    return normaliser_label(read_config(checkpoint))


def load_reports(results: Path, names: list[str], split: str = "test") -> list[tuple[str, dict]]:
    """``(name, grounding section)`` of every checkpoint whose report ``results/NAME.json`` holds Entities
    grounding on ``split``."""
    out = []
    for name in names:
        path = results / f"{name}.json"
        if path.exists():
            section = load_report(path).get(split, {}).get("grounding", {})
            if "references" in section:
                out.append((name, section))
    return out


def _all_row(section: dict, mode: str, control: str = "model") -> dict | None:
    return next((r for r in section[mode]["rows"] if r["control"] == control and r["phrase_type"] == "all"), None)


def results_figure(reports: list[tuple[str, dict]], out: Path) -> Path:
    """Attention correctness and pointing hit per model in both modes, attention against the two chance maps."""
    from .figures import control_bars

    controls = ("model", "other photo", "uniform")
    panels = []
    for mode in CAPTION_SOURCES:
        for stat, title in (("mass", "attention correctness"), ("pointing", "pointing hit")):
            entries = []
            for name, section in reports:
                stats = {c: (row[stat] if (row := _all_row(section, mode, c)) else None) for c in controls}
                entries.append((f"{name}\n({section['normaliser']})", stats))
            panels.append((f"{title}, {mode}", entries))
    return control_bars(panels, controls, {"model": "attention", "other photo": "chance: other photo",
                                           "uniform": "chance: uniform (boxes' share)"}, out, columns=2)


def heatmap_checkpoints(weights: Path) -> list[Path]:
    """One real-photo checkpoint per normaliser for the side-by-side heatmaps: SparseCap's where there is one
    (the three differ only in the normaliser), else any other of that normaliser."""
    chosen = []
    candidates = real_photo_checkpoints(weights)
    for name in NORMALISERS:  # the table's order: softmax, sparsemax, TVmax
        same = [c for c in candidates if normaliser(c) == name]
        same.sort(key=lambda c: read_config(c).get("arch") != "sparsecap")
        chosen += same[:1]
    return chosen


def examples_figure(checkpoints: list[Path], out: Path, device: str = "cpu",
                    photos: Sequence[str] = EXAMPLE_PHOTOS) -> Path | None:
    """scikit-image photos, one block per photo: a row per checkpoint with its caption's per-word heatmaps (the same
    ``grid_blocks`` rendering for all, so a sparse map's exact zeros show)."""
    if not checkpoints or not photos:
        return None
    from PIL import Image
    from skimage import data

    from ..pipeline import Pipeline
    from ..rendering.heatmaps import comparison_figure, save_picture

    pipelines = [(normaliser(c), Pipeline(c, device)) for c in checkpoints]
    blocks = []
    for photo in (Image.fromarray(getattr(data, name)()) for name in photos):
        rows = []
        for label, pipeline in pipelines:
            (result,) = pipeline([photo])
            rows.append(result.figure_row(label, "grid_blocks" if result.geometry.kind == "grid" else None))
        blocks.append(comparison_figure(photo, rows))
    width = max(b.width for b in blocks)
    canvas = Image.new("RGB", (width, sum(b.height for b in blocks)), "white")
    top = 0
    for block in blocks:
        canvas.paste(block, (0, top))
        top += block.height
    out.parent.mkdir(parents=True, exist_ok=True)
    save_picture(canvas, out)
    return out


#: the normalisers of the human study the ordering is read against (Martins et al., arXiv:2002.05556), in its order:
#: not the table of every normaliser (models/attention), which a new one joins without joining the study
STUDIED_NORMALISERS = ("softmax", "sparsemax", "tvmax")


def _overlap(a: dict, b: dict) -> bool:
    return a["ci95"][0] <= b["ci95"][1] and b["ci95"][0] <= a["ci95"][1]


def ordering_sentence(values: dict[str, dict]) -> str:
    """``softmax 0.41 [..] < sparsemax …``, each step said as "<" (intervals apart) or "≈" (they overlap), and
    whether that is the strict ordering softmax < sparsemax < TVmax of the human study of "Sparse and
    Structured Visual Attention" (Martins et al., arXiv:2002.05556: attention relevance 3.38, 3.89, 4.10 of 5)."""
    names = [n for n in STUDIED_NORMALISERS if n in values]
    if len(names) < 2:
        return "fewer than two of softmax, sparsemax and TVmax were measured: no ordering to read"
    ranked = sorted(names, key=lambda n: values[n]["mean"])
    text = f"{ranked[0]} {interval(values[ranked[0]])}"
    for low, high in zip(ranked, ranked[1:]):
        text += f" {'≈' if _overlap(values[low], values[high]) else '<'} {high} {interval(values[high])}"
    strict = ranked == list(STUDIED_NORMALISERS) and all(not _overlap(values[a], values[b])
                                                         for a, b in zip(ranked, ranked[1:]))
    verdict = "holds" if strict else "does not hold (as a strict, interval-separated ordering)"
    return (f"{text}: the ordering of the human study of Martins et al. (arXiv:2002.05556), softmax < sparsemax < "
            f"TVmax, {verdict}")


def closing_note(reports: list[tuple[str, dict]], weights: Path, scene_results: Path) -> list[str]:
    """The normalisers' ordering on real photos (SparseCap checkpoints, references teacher-forced and generated)
    and on the scene benchmark (its shipped SparseCap checkpoints' mass in object, from ``scene_results``)."""
    by_name = dict(reports)
    sparse = {normaliser(weights / n): n for n in by_name if read_config(weights / n).get("arch") == "sparsecap"}
    lines = ["Read off the intervals above, not tuned toward (no model was trained or selected on these numbers):"]
    for mode in CAPTION_SOURCES:
        values = {norm: row["mass"] for norm, name in sparse.items() if (row := _all_row(by_name[name], mode))}
        lines.append(f"- real photos, {mode}: attention correctness {ordering_sentence(values)}.")
        chance = {norm: row["mass"] for norm, name in sparse.items()
                  if (row := _all_row(by_name[name], mode, "other photo"))}
        if chance:
            gaps = ", ".join(f"{norm} {values[norm]['mean'] - chance[norm]['mean']:+.3f}"
                             for norm in STUDIED_NORMALISERS if norm in chance and norm in values)
            lines.append(f"  Above the other-photo chance row (which carries the best-word pick among as many rows, "
                         f"the part of a sparse map's score that needs no grounding): {gaps}.")
    scene = {}
    for norm in STUDIED_NORMALISERS:
        path = scene_results / f"sparsecap-{norm}.json"
        if path.exists():
            rows = load_report(path).get("test", {}).get("grounding", {}).get("rows", [])
            row = next((r for r in rows if r.get("control") == "model" and r.get("word_class") == "all"), None)
            if row:
                scene[norm] = row["mass"]
    lines.append(f"- generated scenes (`docs/model_zoo.md`), mass in object: {ordering_sentence(scene)}.")
    return lines


def write_grounding_doc(weights: Path, results: Path, document: Path, figure: Path, examples: Path,
                        scene_results: Path, device: str = "cpu", photos: Sequence[str] = EXAMPLE_PHOTOS) -> str:
    """Write the generated part of ``document`` between its markers (appended once if it has none)."""
    names = [c.name for c in real_photo_checkpoints(weights)]
    reports = load_reports(results, names)
    block = [START, "", "## Results (generated by `make grounding`)", ""]
    if not reports:
        block += ["No real-photo checkpoint has an Entities report yet: "
                  f"{', '.join(names) or 'no checkpoint in ' + str(weights) + ' was trained on Flickr photos'}."]
    else:
        block += [f"Flickr8k `test` split ({reports[0][1]['photos']} photos with Flickr30k Entities annotations; "
                  "Flickr8k: Hodosh et al., JAIR 2013; Flickr30k Entities: Plummer et al., arXiv:1505.04870). Mean "
                  "over phrases [95 % bootstrap interval over photos]; a phrase is scored by its best word (Liu et "
                  "al., arXiv:1605.09553).", "", summary_table(reports), "",
                  f"![grounding on Flickr30k Entities]({_relative(results_figure(reports, figure), document)})", ""]
        for mode in CAPTION_SOURCES:
            block += [f"### Per phrase type, {mode}", "", type_table(reports, mode), ""]
        chosen = heatmap_checkpoints(weights)
        picture = examples_figure(chosen, examples, device, photos)
        if picture is not None:
            rows = ", ".join(f"{normaliser(c)}: `{c.name}`" for c in chosen)
            block += ["### Heatmaps on scikit-image photos", "",
                      f"Each word's attention "
                      f"(`grid_blocks`: a sparse map's exact zeros stay transparent), one row per "
                      f"checkpoint ({rows}), on photos scikit-image bundles.", "",
                      f"![softmax, sparsemax and TVmax heatmaps]({_relative(picture, document)})", ""]
        block += ["### Closing note", "", *closing_note(reports, weights, scene_results)]
    block += ["", END]
    return write_between_markers(document, block)


def _relative(path: Path, document: Path) -> str:
    try:
        return str(path.resolve().relative_to(document.resolve().parent))
    except ValueError:
        return str(path)
