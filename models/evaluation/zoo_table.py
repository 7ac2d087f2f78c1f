"""The model-zoo table and grounding figure (``captioner zoo-table``), generated from measurements only.

Inputs: every checkpoint folder under ``weights/`` (parameters counted on the model its ``config.json`` describes,
built on the meta device as the card and ``GET /models`` count them; training time and hardware from its
``config.json`` training record) and the ``captioner eval --output`` reports in a results folder, one or more per
checkpoint, named ``NAME.json`` or ``NAME.SOMETHING.json`` (e.g. ``sat.json`` with the test / heldout splits and
``--grounding``, ``sat.ood.json`` with the ``ood`` split).  A number that no report holds is printed as "—", never
filled in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint import checkpoint_children, described_model, read_config
from ..files import read_text_file, write_atomically
from ..protocol import configured_normaliser
from .card import load_report, merge_reports, total_train_seconds
from .params import count_parameters

START, END = "<!-- zoo-table:start -->", "<!-- zoo-table:end -->"


def normaliser_label(config: dict[str, Any]) -> str:
    """The attention normaliser of a checkpoint's ``config.json``, as the docs' tables label it: "ensemble" for the
    mean of its members' maps, "hard" for SAT-hard's sampling distribution, else the configured one
    (:func:`~captioner.models.protocol.configured_normaliser`)."""
    arch = config.get("arch")
    if arch == "ensemble":
        return "ensemble"
    if arch == "sat-hard":
        return "hard"
    return configured_normaliser(config.get("model", {}))


def parameter_count(checkpoint: Path) -> int:
    """The checkpoint's parameters, as its card and ``GET /models`` count them (buffers, such as SAT-hard's
    baseline, are not parameters), read from its config without loading its weights."""
    return count_parameters(described_model(checkpoint))


def merged_reports(results: Path, name: str) -> dict[str, Any]:
    """The splits of every report for checkpoint ``name`` (later files win on a split both hold)."""
    paths = sorted(results.glob(f"{name}.json")) + sorted(results.glob(f"{name}.*.json"))
    merged = merge_reports([load_report(path) for path in paths])
    return {k: v for k, v in merged.items() if isinstance(v, dict) and "images" in v}


def _grounding_all(split: dict[str, Any] | None, stat: str) -> dict | None:
    rows = (split or {}).get("grounding", {}).get("rows", [])
    row = next((r for r in rows if r["control"] == "model" and r["word_class"] == "all"), None)
    return row[stat] if row else None


def _metric(split: dict[str, Any] | None, key: str, digits: int = 3) -> str:
    value = (split or {}).get(key)
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "—"


def _with_ci(stat: dict | None) -> str:
    from .grounding import interval

    return "—" if stat is None else interval(stat)


def zoo_rows(weights: Path, results: Path) -> list[dict[str, Any]]:
    rows = []
    for checkpoint in checkpoint_children(weights):
        config = read_config(checkpoint)
        meta = config.get("meta", {})
        splits = merged_reports(results, checkpoint.name)
        rows.append({"name": checkpoint.name, "arch": config.get("arch", "?"),
                     "normaliser": normaliser_label(config),
                     "parameters": parameter_count(checkpoint), "train_seconds": total_train_seconds(meta),
                     "hardware": meta.get("hardware"), "threads": meta.get("train_config", {}).get("threads"),
                     "splits": splits})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ("| checkpoint | architecture | normaliser | parameters | training | test objects_named | "
            "held-out objects_named | OOD objects_named | CIDEr-D (test) | BLEU-4 (test) | grounding mass (test) | "
            "pointing hit (test) |")
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    for row in rows:
        test, heldout, ood = (row["splits"].get(s) for s in ("test", "heldout", "ood"))
        minutes = f"{row['train_seconds'] / 60:.0f} min" if row["train_seconds"] else "not recorded"
        hardware = row["hardware"] or "2-core CPU (not recorded)"
        threads = f", {row['threads']} thread(s)" if row["threads"] else ""

        def sized(split, key):
            return f"{_metric(split, key)} (n={split['images']})" if split and key in split else "—"

        lines.append(" | ".join([
            f"| {row['name']}", row["arch"], row["normaliser"], f"{row['parameters'] / 1e6:.1f} M",
            f"{minutes} on {hardware}{threads}", sized(test, "objects_named"), sized(heldout, "objects_named"),
            sized(ood, "objects_named"), _metric(test, "CIDEr-D"), _metric(test, "BLEU-4"),
            _with_ci(_grounding_all(test, "mass")), _with_ci(_grounding_all(test, "pointing"))]) + " |")
    lines += ["", "Grounding: attention of every word that correctly names an object (colour adjective and shape "
              "noun), test split; mean [95 % bootstrap interval over images]. Chance rows: "
              "`captioner eval --grounding` reports (`docs/results/`)."]
    return "\n".join(lines)


def grounding_markdown(rows: list[dict[str, Any]]) -> str:
    from .grounding import markdown_table

    return markdown_table([(row["name"], row["splits"]["test"]["grounding"]) for row in rows
                           if "grounding" in row["splits"].get("test", {})])


def grounding_figure(rows: list[dict[str, Any]], out: Path) -> Path | None:
    """Bars of mass in object and pointing hit per model (attention vs the two chance controls), all words, with
    their 95 % intervals as error bars."""
    from .figures import control_bars

    models = [r for r in rows if "grounding" in r["splits"].get("test", {})]
    if not models:
        return None
    controls = ("model", "other image", "uniform")

    def stats(row: dict[str, Any], stat: str) -> dict[str, dict | None]:
        rows_all = [r for r in row["splits"]["test"]["grounding"]["rows"] if r["word_class"] == "all"]
        entries = {r["control"]: r[stat] for r in rows_all}
        return {control: entries.get(control) for control in controls}

    labels = [f"{r['name']}\n({r['splits']['test']['grounding']['normaliser']})" for r in models]
    panels = [(title, [(label, stats(r, stat)) for label, r in zip(labels, models)])
              for stat, title in (("mass", "mass in object"), ("pointing", "pointing-game hit"))]
    return control_bars(panels, controls, {"model": "attention", **{c: f"chance: {c}" for c in controls[1:]}}, out)


def paired_markdown(results: Path, dataset: Path, baseline: str, split: str = "test") -> list[str]:
    """Every checkpoint's CIDEr-D and ``objects_named`` minus ``baseline``'s on the same images of ``split``, with
    the paired-bootstrap interval (``captioner compare``), from the captions in ``results/captions/NAME.json``
    (``captioner eval --results-json``).  Empty when the baseline's captions or the dataset are missing."""
    from ..data.karpathy import load_karpathy
    from .compare import compare_captions, read_results

    folder = results / "captions"
    if not (folder / f"{baseline}.json").exists() or not dataset.exists():
        return []
    images = load_karpathy(dataset, None, (split,))
    want = read_results(folder / f"{baseline}.json")
    lines = [f"| checkpoint | CIDEr-D − {baseline} [95 % CI] | objects_named − {baseline} [95 % CI] |", "|---|---|---|"]
    for path in sorted(folder.glob("*.json")):
        if path.stem == baseline:
            continue
        result = compare_captions(read_results(path), want, images)
        cells = [f"{result[m]['difference']:+.3f} [{result[m]['ci95'][0]:+.3f}, {result[m]['ci95'][1]:+.3f}]"
                 for m in ("CIDEr-D", "objects_named")]
        lines.append(f"| {path.stem} | {' | '.join(cells)} |")
    return [f"### Against `{baseline}`, image by image ({split} split, {len(images)} scenes)", "",
            f"Each checkpoint's score minus `{baseline}`'s on the same scenes, with the 95 % interval of a paired "
            "bootstrap over the scenes (`captioner compare`, from the captions in `results/captions/`): an interval "
            "that contains 0 is a difference the choice of test scenes could make.", "", *lines]


def write_zoo(weights: Path, results: Path, document: Path, figure: Path, dataset: Path | None = None,
              baseline: str = "sat") -> str:
    """Write the tables between the markers of ``document`` (appended once if it has none) and the figure;
    with ``dataset`` (the scenes' ``dataset_scenes.json``), also every checkpoint against ``baseline``."""
    rows = zoo_rows(weights, results)
    picture = grounding_figure(rows, figure)
    block = [START, "", "## All shipped checkpoints (generated by `captioner zoo-table`)", "", markdown(rows)]
    paired = paired_markdown(results, dataset, baseline) if dataset is not None else []
    if paired:
        block += ["", *paired]
    grounding = grounding_markdown(rows)
    if grounding.count("\n") > 1:
        block += ["", "### Attention grounding (test split)", "", grounding]
    if picture is not None:
        block += ["", f"![grounding]({Path('figures') / picture.name})" if picture.parent.name == "figures"
                  else f"![grounding]({picture})"]
    block += ["", END]
    return write_between_markers(document, block)


def write_between_markers(document: Path, block: list[str]) -> str:
    """Put ``block`` (its first and last lines are the markers) in place of the document's text between those
    markers, or append it once when the document has none; the prose around it stays, a failed write included (the
    document is replaced whole).  A document with one marker alone, or its end before its start, is a
    :class:`ValueError`, the document left as it was."""
    start, end = block[0], block[-1]
    text = read_text_file(document) if document.exists() else ""
    if (start in text) != (end in text):
        # appending would leave two starts (or ends), and the next run would replace the prose between the two blocks
        held, missing = (start, end) if start in text else (end, start)
        raise ValueError(f"{document}: {held} without {missing}: put the missing marker back (the text between them "
                         "is replaced) or remove this one (the block is appended)")
    if start in text:  # and so is the end, by the check above
        before, rest = text.split(start, 1)
        if end not in rest:  # the markers in the wrong order: which text is the generated part cannot be told
            raise ValueError(f"{document}: {end} comes before {start}: put the markers in order (the text between "
                             "them is replaced)")
        text = before + "\n".join(block) + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(block) + "\n"
    document.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(document, text)  # a full disk half-way would otherwise leave the prose around the block cut off
    return "\n".join(block)
