"""The Flickr8k table of docs/model_zoo.md (``captioner zoo-f8k``), generated from measurements only.

Inputs: the checkpoints in ``weights/flickr8k/NAME`` (their ``config.json`` names the architecture and holds the
decoding rules chosen on val), the ``captioner eval --output`` report ``RESULTS/NAME.json`` and the captions
``RESULTS/captions/NAME.json`` (``captioner eval --results-json``) of each, and the data set, whose references the
paired bootstrap scores the captions against (Koehn, "Statistical Significance Tests for Machine Translation
Evaluation", EMNLP 2004; models/evaluation/compare.py).  A checkpoint without a report is listed as not measured;
a number no report holds is "—", never filled in.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..data.datasets import CITATIONS
from ..files import read_json_file
from ..protocol import configured_normaliser
from .zoo_table import write_between_markers

START, END = "<!-- zoo-f8k:start -->", "<!-- zoo-f8k:end -->"
BEAM_SIZE = 3

#: the table's row order; other checkpoints follow by name
ROW_ORDER = ("sat", "sat-supervised", "sat-hard", "aoanet", "xlan", "xtransformer",
             "sparsecap-softmax", "sparsecap-sparsemax",
             "sparsecap-tvmax", "area-transformer", "ensemble")
ARCH_TITLES = {"sat": "SAT soft", "sat-hard": "SAT hard", "sparsecap": "SparseCap", "aoanet": "AoANet",
               "xlan": "X-LAN", "xtransformer": "X-Transformer", "area-transformer": "Area-attention Transformer"}
NORMALISER_TITLES = {"softmax": "softmax", "sparsemax": "sparsemax", "tvmax": "TVmax"}

#: Show, Attend and Tell's Flickr8k rows, ×100 (Xu et al., ICML 2015, arXiv:1502.03044, Table 1), each beside the
#: checkpoint it belongs to; the other papers report no Flickr8k scores
PAPER_ROWS = {
    "sat": ("Xu et al. 2015, soft attention", {"BLEU-1": 67, "BLEU-2": 44.8, "BLEU-3": 29.9, "BLEU-4": 19.5,
                                               "METEOR": 18.93}),
    "sat-hard": ("Xu et al. 2015, hard attention", {"BLEU-1": 67, "BLEU-2": 45.7, "BLEU-3": 31.4, "BLEU-4": 21.3,
                                                    "METEOR": 20.30}),
}
#: the issue's floors: SAT soft and hard each reach the paper's hard-attention row; the three newer models each
#: beat the baseline on CIDEr-D and BLEU-4 beyond the bootstrap's doubt; the best model reaches these (×100)
PAPER_FLOOR, PAPER_FLOOR_MODELS = "sat-hard", ("sat", "sat-supervised", "sat-hard")
ABOVE_BASELINE_MODELS = ("aoanet", "xlan", "xtransformer")
BEST_FLOORS = {"CIDEr-D": 70.0, "BLEU-4": 26.0}

#: the scores of the table's first cells, in its order (the head row is written out in ``markdown``)
COLUMNS = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L")


def title(name: str, config: dict[str, Any] | None) -> str:
    """"SAT soft `sat`": the architecture's name (with SparseCap's normaliser, "supervised attention" after
    ``--attention-supervision`` and "+ SCST" after SCST); an ensemble's members by name."""
    if config is None:
        return f"`{name}`"
    arch = config.get("arch", name)
    meta = config.get("meta", {})
    if arch == "ensemble":
        members = " + ".join(f"`{member['name']}`" for member in meta.get("ensemble_of", []))
        return f"Ensemble of {members} `{name}`"
    text = ARCH_TITLES.get(arch, arch)
    if arch == "sparsecap":
        normaliser = configured_normaliser(config.get("model", {}))
        text += f" ({NORMALISER_TITLES.get(normaliser, normaliser)})"
    if meta.get("train_config", {}).get("attention_supervision"):
        text += ", supervised attention"
    if meta.get("phase") == "scst":
        text += " + SCST"
    return f"{text} `{name}`"


def read_report(path: Path, split: str, config: dict[str, Any] | None,
                checkpoint: Path | None = None) -> dict[str, Any]:
    """The ``split`` section of a ``captioner eval`` report, checked to be beam 3 with the checkpoint's own
    decoding rules (what the note under the table says of every row), and of ``checkpoint``'s weights where the
    report records theirs (:func:`~captioner.models.evaluation.card.check_report_scores`)."""
    from ..decoding import DecodingRules
    from .card import check_report_scores

    report = read_json_file(path, "a `captioner eval` report", kind=object)
    if not isinstance(report, dict) or not isinstance(report.get(split), dict) or "images" not in report[split]:
        raise ValueError(f"{path} is not a `captioner eval` report with a {split!r} split")
    if report.get("beam_size") != BEAM_SIZE:
        raise ValueError(f"{path} was decoded with beam {report.get('beam_size')}, not {BEAM_SIZE}")
    if config is not None and "decoding" in report:
        # compared as rules: a report written before a rule existed names no value for it, which is its default
        own = DecodingRules.of_checkpoint(config.get("meta", {}))
        if DecodingRules.of_checkpoint(report, str(path)) != own:
            raise ValueError(f"{path} was decoded with {report['decoding']}, not the checkpoint's defaults "
                             f"{asdict(own)}")
    if checkpoint is not None:
        check_report_scores(report, path, checkpoint)
    return report[split]


def ordered_names(names: set[str]) -> list[str]:
    return [n for n in ROW_ORDER if n in names] + sorted(names - set(ROW_ORDER))


def collect_rows(weights: Path, results: Path, dataset: str | Path | None, image_root: str | Path | None,
                 split: str, baseline: str, resamples: int) -> list[dict[str, Any]]:
    """One row per checkpoint in ``weights`` (and per report ``NAME.json`` without one): its title, its report's
    ``split`` (None: not measured), its CIDEr-D's bootstrap interval and its differences from ``baseline``."""
    from ..checkpoint import read_config

    if not weights.is_dir():
        raise ValueError(f"{weights} is not a folder of checkpoints")
    configs = {p.name: read_config(p) for p in weights.iterdir() if (p / "config.json").is_file()}
    # NAME.SOMETHING.json are other reports of NAME (zoo-table's convention), not rows of their own
    names = set(configs) | {p.stem for p in results.glob("*.json") if "." not in p.stem}
    rows = []
    for name in ordered_names(names):
        report = results / f"{name}.json"
        checkpoint = weights / name if name in configs else None
        split_report = read_report(report, split, configs.get(name), checkpoint) if report.is_file() else None
        rows.append({"name": name, "title": title(name, configs.get(name)), "split": split_report})
    measured = [row for row in rows if row["split"] is not None]
    if measured:
        add_intervals(measured, results, dataset, image_root, split, baseline, resamples)
    return rows


def add_intervals(rows: list[dict[str, Any]], results: Path, dataset: str | Path | None,
                  image_root: str | Path | None, split: str, baseline: str, resamples: int) -> None:
    """Each measured row's CIDEr-D interval over images and, beside the baseline's captions, ΔCIDEr-D and ΔBLEU-4
    with paired-bootstrap intervals, all from the captions."""
    import numpy as np

    from ..data.datasets import load_captioned
    from .bootstrap import percentile_interval, resampled_ratios
    from .compare import compare_captions, read_results, result_id, scored_captions
    from .metrics import cider_d, reference_texts

    if dataset is None:
        raise ValueError("the paired bootstrap scores the captions against the references: pass --dataset")
    images = load_captioned(dataset, image_root, (split,), check_images=False)
    if not images:
        raise ValueError(f"split {split!r} of {dataset} is empty")
    keys = [result_id(im) for im in images]
    refs = reference_texts(images)
    captions = {}
    for row in rows:
        path = results / "captions" / f"{row['name']}.json"
        captions[row["name"]] = read_results(path)
        missing, extra = set(keys) - set(captions[row["name"]]), set(captions[row["name"]]) - set(keys)
        if missing or extra or row["split"]["images"] != len(images):
            raise ValueError(f"{path}: its image ids do not match the {len(images)} images of the {split!r} split "
                             f"({len(missing)} missing, {len(extra)} not in it; the report scores "
                             f"{row['split']['images']})")
        per_image = cider_d(scored_captions(captions[row["name"]], keys), refs)
        # the captions must be the ones the report scored (the report rounds to 4 decimals)
        if abs(per_image.mean() - row["split"].get("CIDEr-D", per_image.mean())) > 5e-4:
            raise ValueError(f"{path} scores CIDEr-D {per_image.mean():.4f}, but its report says "
                             f"{row['split']['CIDEr-D']}: not the captions of that report")
        row["CIDEr-D interval"] = percentile_interval(
            resampled_ratios(per_image, np.ones(len(per_image)), resamples, seed=0))
    if shutil.which("java") is not None:  # without it the table says so (ptb_lines)
        add_ptb_scores(rows, images, keys, captions)
    if baseline in captions:
        for row in rows:
            if row["name"] != baseline:
                row["against baseline"] = compare_captions(captions[row["name"]], captions[baseline], images,
                                                           resamples)


def add_ptb_scores(rows: list[dict[str, Any]], images: Sequence[Any], keys: list[int],
                   captions: dict[str, dict[int, str]]) -> None:
    """Each row's BLEU-4 and CIDEr-D scored as coco-caption scores them: PTB tokens of the raw references and of
    the captions (metrics.py; one Java run for the references, one for every row's captions)."""
    from .compare import scored_captions
    from .metrics import ptb_captions, reference_texts, score_captions

    refs = dict(zip(keys, reference_texts(images, ptb=True)))
    tokenized = ptb_captions({(row["name"], key): caption for row in rows
                              for key, caption in zip(keys, scored_captions(captions[row["name"]], keys))})
    for row in rows:
        row["ptb"] = score_captions({key: tokenized[(row["name"], key)] for key in keys}, refs, ("BLEU", "CIDEr-D"))


# -- Markdown --------------------------------------------------------------------------------------------------
def points(value: Any, digits: int = 1) -> str:
    return f"{100 * value:.{digits}f}" if isinstance(value, (int, float)) else "—"


def excludes_zero(stat: dict[str, Any]) -> bool:
    low, high = stat["ci95"]
    return low > 0 or high < 0


def difference(stat: dict[str, Any] | None) -> str:
    """"+3.2 [+1.0, +5.4] †" (× 100; † when the 95 % interval excludes 0)."""
    if stat is None:
        return "—"
    low, high = (100 * v for v in stat["ci95"])
    return f"{100 * stat['difference']:+.1f} [{low:+.1f}, {high:+.1f}]" + (" †" if excludes_zero(stat) else "")


def model_row(row: dict[str, Any], baseline: str) -> str:
    split = row["split"]
    if split is None:
        return f"| {row['title']}: not measured |" + " — |" * 14
    cells = [points(split.get(key), 2 if key == "METEOR" else 1) for key in COLUMNS]
    cider = points(split.get("CIDEr-D"))
    if "CIDEr-D interval" in row:
        low, high = row["CIDEr-D interval"]
        cider += f" [{100 * low:.1f}, {100 * high:.1f}]"
    spice = split.get("SPICE")
    against = row.get("against baseline", {})
    cells += [cider, "unavailable" if not isinstance(spice, (int, float)) else points(spice),
              f"{split['REP']:.2f}" if "REP" in split else "—",
              f"{split['distinct_words']:.0f}" if "distinct_words" in split else "—",
              f"{100 * split['novel_captions']:.1f} %" if "novel_captions" in split else "—",
              f"{split['mean_length']:.1f}" if "mean_length" in split else "—",
              "—" if row["name"] == baseline else difference(against.get("CIDEr-D")),
              "—" if row["name"] == baseline else difference(against.get("BLEU-4"))]
    return f"| {row['title']} | " + " | ".join(cells) + " |"


def paper_score(key: str, value: float) -> str:
    return f"{value:.2f}" if key == "METEOR" else f"{value:g}"  # as the paper prints them


def paper_row(name: str) -> str:
    source, scores = PAPER_ROWS[name]
    cells = [paper_score(key, scores[key]) if key in scores else "—" for key in COLUMNS]
    return f"| *{source} (paper)* | " + " | ".join(cells) + " |" + " — |" * 8


def floor_lines(rows: list[dict[str, Any]], baseline: str) -> list[str]:
    """The issue's floors, each met / not met with its numbers; a checkpoint that is not in ``rows`` is "not
    shipped yet", one without a report "not measured"."""
    by_name = {row["name"]: row for row in rows}

    def unavailable(name: str) -> str | None:
        if name not in by_name:
            return f"`{name}`: not shipped yet"
        if by_name[name]["split"] is None:
            return f"{by_name[name]['title']}: not measured"
        return None

    paper_source, paper = PAPER_ROWS[PAPER_FLOOR]
    lines = [f"Floors (issue): each SAT checkpoint at least the paper's hard-attention row ({paper_source}) on "
             "BLEU-1..4 and METEOR:"]
    for name in PAPER_FLOOR_MODELS:
        if (reason := unavailable(name)) is not None:
            lines.append(f"- {reason}")
            continue
        split = by_name[name]["split"]
        # compared at the reports' precision (4 decimals, 2 after × 100), so 0.2030 meets 20.30
        scores = {key: round(100 * split[key], 2) if key in split else None for key in paper}
        short = [key for key in paper if scores[key] is None or scores[key] < paper[key]]
        numbers = ", ".join(f"{key} {'—' if scores[key] is None else f'{scores[key]:.2f}'} vs "
                            f"{paper_score(key, paper[key])}" for key in paper)
        verdict = "met" if not short else f"not met (short on {', '.join(short)})"
        lines.append(f"- {by_name[name]['title']}: **{verdict}**: {numbers}")
    lines += ["", f"Each of AoANet, X-LAN and X-Transformer above `{baseline}` on CIDEr-D and BLEU-4, both 95 % "
                  "intervals excluding 0:"]
    for name in ABOVE_BASELINE_MODELS:
        if (reason := unavailable(name)) is not None:
            lines.append(f"- {reason}")
            continue
        if (reason := unavailable(baseline)) is not None:
            lines.append(f"- {by_name[name]['title']}: no baseline to compare with ({reason})")
            continue
        against = by_name[name].get("against baseline", {})
        stats = [against.get(key) for key in ("CIDEr-D", "BLEU-4")]
        met = all(stat is not None and stat["difference"] > 0 and excludes_zero(stat) for stat in stats)
        lines.append(f"- {by_name[name]['title']}: **{'met' if met else 'not met'}**: "
                     f"ΔCIDEr-D {difference(stats[0])}, ΔBLEU-4 {difference(stats[1])}")
    floors = " and ".join(f"{key} ≥ {value:g}" for key, value in BEST_FLOORS.items())
    measured = [row for row in rows if row["split"] is not None and "CIDEr-D" in row["split"]]
    if not measured:
        lines += ["", f"The best model (by CIDEr-D) at {floors}: no checkpoint measured yet."]
        return lines
    best = max(measured, key=lambda row: row["split"]["CIDEr-D"])
    scores = {key: round(100 * best["split"].get(key, float("nan")), 2) for key in BEST_FLOORS}
    met = all(scores[key] >= value for key, value in BEST_FLOORS.items())
    lines += ["", f"The best model (by CIDEr-D) at {floors}: {best['title']}, **{'met' if met else 'not met'}**: "
                  + ", ".join(f"{key} {scores[key]:.2f}" for key in BEST_FLOORS) + "."]
    return lines


def markdown(rows: list[dict[str, Any]], baseline: str, split: str, results: Path) -> list[str]:
    head = ("| model | B-1 | B-2 | B-3 | B-4 | METEOR | ROUGE-L | CIDEr-D [95 % CI] | SPICE | REP | distinct words "
            f"| novel captions | mean length | ΔCIDEr-D vs `{baseline}` [95 % CI] "
            f"| ΔBLEU-4 vs `{baseline}` [95 % CI] |")
    lines = [head, "|---|" + "---:|" * 14]
    by_name = {row["name"]: row for row in rows}
    for name in ordered_names(set(by_name) | set(PAPER_ROWS)):
        if name in by_name:
            lines.append(model_row(by_name[name], baseline))
        if name in PAPER_ROWS:
            lines.append(paper_row(name))
    images = next((row["split"]["images"] for row in rows if row["split"] is not None), None)
    photos = f"the {images:,} {split} photos" if images else f"the {split} photos"
    photos += f" of {CITATIONS['flickr8k']}"
    return [*lines, "",
            "Paper rows: Show, Attend and Tell (Xu et al. 2015, arXiv:1502.03044, Table 1) is the only paper here "
            "that reports Flickr8k; the others report other data sets (COCO, some also Flickr30k), so they have no "
            "paper row.",
            "",
            f"Every model row is `captioner eval` on {photos}, beam {BEAM_SIZE}, with each checkpoint's own decoding "
            "defaults (chosen on val), generated by `captioner zoo-f8k` (`make zoo-f8k`) from the reports in "
            f"`{results}/`. Scores × 100 (REP as reported: lower is better); CIDEr-D's interval is a 95 % "
            f"bootstrap over the photos, and the Δ columns are each model minus `{baseline}` on the same photos "
            "with a paired-bootstrap 95 % interval (Koehn, EMNLP 2004; BLEU-4 recomputed from the n-gram counts "
            "summed over each resample); † marks an interval that excludes 0. SPICE is unavailable: its Stanford "
            "CoreNLP models cannot be downloaded here.",
            "", *ptb_lines(rows), "", *floor_lines(rows, baseline)]


def ptb_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The measured rows' BLEU-4 and CIDEr-D scored as coco-caption scores them, beside the table's."""
    measured = [row for row in rows if "ptb" in row]
    if not measured:
        return ["The same captions scored as coco-caption scores them (its PTB tokenizer): not here, where there is "
                "no Java to run it."] if any(row["split"] is not None for row in rows) else []
    lines = ["The same captions scored as coco-caption scores them (`captioner eval --ptb`): Stanford's PTB tokenizer "
             "over the raw references and the captions, punctuation dropped, where the table above uses the "
             "project's one tokenizer on both (docs/decisions.md, \"Scoring: the project's tokenizer, and "
             "coco-caption's\"):", "",
             "| model | BLEU-4 | CIDEr-D | BLEU-4, PTB − above | CIDEr-D, PTB − above |", "|---|---:|---:|---:|---:|"]
    for row in measured:
        ptb, split = row["ptb"], row["split"]
        shifts = " | ".join(f"{100 * (ptb[key] - split[key]):+.2f}" for key in ("BLEU-4", "CIDEr-D"))
        lines.append(f"| {row['title']} | {points(ptb['BLEU-4'])} | {points(ptb['CIDEr-D'])} | {shifts} |")
    return lines


def write_f8k_section(weights: Path, results: Path, document: Path, dataset: str | Path | None = None,
                      image_root: str | Path | None = None, split: str = "test", baseline: str = "sat",
                      resamples: int = 2000) -> str:
    """Write the Flickr8k table between the zoo-f8k markers of ``document`` (appended once if it has none)."""
    rows = collect_rows(weights, results, dataset, image_root, split, baseline, resamples)
    return write_between_markers(document, [START, "", *markdown(rows, baseline, split, results), "", END])
