"""Model cards written from measurements only: the checkpoint's own training record (config.json ``meta``) and a
``captioner eval`` report.  Nothing here is typed in by hand, so a card cannot quote a number nobody measured."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any

from ..checkpoint import CARD, WEIGHTS, checkpoint_name, load_checkpoint, read_config, replace_files
from ..data.datasets import named_by_path, trained_on
from ..data.scenes import describe_dataset, read_dataset_header
from ..decoding import DecodingRules
from ..files import file_checksum, read_json_file
from .params import count_parameters

METRICS = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr-D", "objects_named", "SPICE")
#: the columns of a card whose reports are of real photos (no objects to name): the caption metrics, then what
#: models/evaluation/diversity.py measures
PHOTO_METRICS = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr-D", "SPICE", "REP",
                 "distinct_words", "novel_captions", "mean_length")


def _train_command(meta: dict[str, Any]) -> str:
    from ..training.recipes import command_line  # imported here: training imports evaluation

    return command_line(meta.get("train_config", {}))


def _ancestors(start: dict[str, Any] | None) -> list[dict[str, Any]]:
    chain = []
    while start:
        chain.append(start)
        start = start.get("started_from")
    return chain


def _lineage_lines(start: dict[str, Any] | None) -> list[str]:
    """One line per checkpoint a warm start began from (the run's own line first, then its ancestors')."""
    lines = []
    for step in _ancestors(start):
        # a checkpoint holds its run up to its own epoch, the best one: the run may have trained on past it
        minutes = f", {step['train_seconds'] / 60:.1f} min to reach it" if step.get("train_seconds") else ""
        command = f": `{step['command']}`" if step.get("command") else ""
        lines.append(f"- Started from `{step['checkpoint']}`: {step.get('arch')}, epoch {step.get('epochs')} of its "
                     f"{step.get('phase')} run (its best) on `{step.get('dataset')}`{minutes}{command}")
    return lines


def total_train_seconds(meta: dict[str, Any]) -> float | None:
    """A checkpoint's training time including the runs its warm start began from; None if any is unrecorded."""
    times = [meta.get("train_seconds")] + [step.get("train_seconds") for step in _ancestors(meta.get("started_from"))]
    return sum(times) if all(times) else None


def _with_ancestors(meta: dict[str, Any]) -> str:
    total = total_train_seconds(meta)
    if not meta.get("started_from") or total is None:
        return ""
    return f" ({total / 60:.1f} min with the runs it started from)"


def _encoder_state(encoder: dict[str, Any], meta: dict[str, Any]) -> str:
    """Frozen, or which of its stages training fine-tuned (this run's, or those its --init checkpoint brought)."""
    if not encoder.get("tuned_weights"):
        return "frozen"
    stages = meta.get("train_config", {}).get("finetune_stages") or 0
    last = "its last stage" if stages == 1 else f"its last {stages} stages"
    own = f"{last} fine-tuned by this run" if stages else "the fine-tuned stages of the checkpoint it started from"
    return f"ImageNet weights, {own}: `{encoder['tuned_weights']}`"


def _number(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and 0 < abs(value) < 1e-3:  # learning rates
        return f"{value:g}"
    return f"{value:.4f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)


def _other_measures(splits: list[tuple[str, dict[str, Any]]]) -> tuple[str, ...]:
    """The numbers a report holds beyond the known columns (a measure added to score_dataset, evaluate.py): a card
    shows them after those, rather than dropping them."""
    known = {*METRICS, *PHOTO_METRICS, "images"}
    return tuple(sorted({key for _, scores in splits for key, value in scores.items() if key not in known
                         and isinstance(value, (int, float)) and not isinstance(value, bool)}))


def _row(name: str, scores: dict[str, Any], metrics: tuple[str, ...] = METRICS) -> str:
    cells = []
    for metric in metrics:
        value = scores.get(metric)
        cells.append("unavailable" if isinstance(value, str) else "—" if value is None
                     else f"{value:.0f}" if metric == "distinct_words" else f"{value:.4f}")
    return f"| {name} ({scores.get('images', '?')} images) | " + " | ".join(cells) + " |"


def load_report(path: str | Path) -> dict[str, Any]:
    """A ``captioner eval --output`` report, refused (ValueError naming the file) when the file is something else,
    such as the captions of ``--results-json``: a card written from it would hold an empty table."""
    report = read_json_file(path, "a report of `captioner eval --output`", kind=object)
    if not isinstance(report, dict) or not any(isinstance(v, dict) and "images" in v for v in report.values()):
        raise ValueError(f"{path} is not a report of `captioner eval --output` (it holds no scored split; "
                         "--results-json writes captions, not scores)")
    DecodingRules.of_checkpoint(report, str(path))  # its rules are printed on the card
    for split, scores in report.items():
        if isinstance(scores, dict) and "images" in scores:
            wrong = next((m for m in METRICS if not isinstance(scores.get(m), (int, float, str, type(None)))
                          or isinstance(scores.get(m), bool)), None)
            if wrong is not None:
                raise ValueError(f"{path}: the {split} split's {wrong} is {scores[wrong]!r}, not a score")
    return report


def check_report_scores(report: dict[str, Any], path: str | Path, checkpoint: str | Path) -> None:
    """Refuse (ValueError) a report that scored other weights than ``checkpoint``'s: a card would print another
    model's numbers under this one's name.  Reports written before they recorded the weights' sha256 pass."""
    from ..checkpoint import recorded_checksum

    scored, here = report.get("weights_sha256"), recorded_checksum(checkpoint)
    if scored and here and scored != here:
        raise ValueError(f"{path} scores {report.get('checkpoint')}, whose weights are not {checkpoint}'s: evaluate "
                         f"{checkpoint} into the report first (captioner eval {checkpoint} --output {path})")


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Several ``captioner eval`` reports as one: the first one's settings, every report's splits (a later report's
    split replaces an earlier one of the same name)."""
    merged = dict(reports[0]) if reports else {}
    for report in reports[1:]:
        merged.update({k: v for k, v in report.items() if isinstance(v, dict) and "images" in v})
    return merged


def _rules_phrase(decoding: dict[str, Any] | None) -> str:
    """The card heading's account of the decoding rules a report was measured with (none for an older report)."""
    if not decoding:
        return ""
    rules = DecodingRules(**decoding)
    return (f", length penalty α = {rules.length_penalty:g}, trigram blocking {'on' if rules.block_trigrams else 'off'}"
            + (", doubled words blocked" if rules.block_doubled_words else ""))


def _storage_lines(storage: str, chosen: dict[str, Any] | None, report: dict[str, Any]) -> list[str]:
    """For weights stored at another precision than the one the decoding rules were chosen with: the chosen
    split's score then and now, so the card shows whether the rounding changed the captions' quality."""
    if not chosen or "score" not in chosen or chosen.get("storage", "float32") == storage:
        return []
    now = (report.get(chosen["split"]) or {}).get(chosen["metric"])
    if now is None:
        return [f"Weights stored as {storage}; not re-measured on {chosen['split']}.", ""]
    return [f"Weights stored as {storage}: {chosen['split']} {chosen['metric']} {now:.4f}, against "
            f"{chosen['score']:.4f} with the {chosen.get('storage', 'float32')} weights the rules were chosen on.",
            ""]


def _data_description(meta: dict[str, Any]) -> str:
    """The data set a checkpoint was trained on, as its card names it: generated scenes by what their own
    ``dataset_scenes.json`` records (generator version and settings, so the card says how to draw them again), any
    other data set by its citation (:func:`trained_on`).  The header training recorded (``dataset_header``) is read
    first, so the card does not depend on the data set being here; only checkpoints trained before it was recorded
    (the shipped scene ones) read the data set's file."""
    if meta.get("dataset_header"):
        return describe_dataset(meta["dataset_header"])
    dataset = meta.get("dataset")
    if dataset and named_by_path(dataset) == "scenes":
        header = read_dataset_header(dataset)
        if header is not None:
            return describe_dataset(header)
        print(f"note: {dataset} is not here: the card names the generated scenes without their generator's settings",
              file=sys.stderr)
    return trained_on(meta)


def _training_lines(meta: dict[str, Any]) -> list[str]:
    """The card's account of the run that trained the checkpoint: data, selection, command, time, per-epoch scores."""
    history = meta.get("history", [])
    seconds = meta.get("train_seconds")
    columns = list(dict.fromkeys(key for h in history for key in h))
    threads = meta.get("train_config", {}).get("threads")
    val_beam = meta.get("train_config", {}).get("val_beam", 1)
    return [
        "## Training",
        "",
        f"- Data: {_data_description(meta)}: `{meta.get('dataset', '?')}` (training split; validation split for model "
        "selection).",
        f"- Phase: {meta.get('phase', 'xe')}; selected by validation {meta.get('selected_by', '?')} "
        # best/ is saved at its epoch, so its history ends there: later epochs trained by then validated no higher
        # (a run resumed for more epochs after its best/ was shipped may have validated higher since)
        f"(epoch {meta.get('best_epoch', '?')}; the history below ends at it: no epoch trained before this "
        "checkpoint was written validated higher).",
        f"- Command: `{_train_command(meta)}`",
        *_lineage_lines(meta.get("started_from")),
        f"- Training time: {f'{seconds / 60:.1f} min' if seconds >= 60 else f'{seconds:.0f} s'} of wall clock"
        f"{_with_ancestors(meta)}" if seconds
        else "- Training time: not recorded",
        # checkpoints from before the hardware was recorded were all trained on this project's 2-core CI machine
        f"  on a {meta.get('hardware', f'2-core {platform.machine()} CPU, no GPU')}, "
        + (f"{threads} intra-op thread(s) (`--threads {threads}`)." if threads else "default threads."),
        "",
        "Per epoch: the last training batch's losses, then validation scores ("
        + ("greedy decoding" if val_beam == 1 else f"beam {val_beam}") + ", the numbers the run selected on):",
        "",
        "| " + " | ".join(columns) + " |",
        "|---" * len(columns) + "|",
        *("| " + " | ".join(_number(h.get(c)) for c in columns) + " |" for h in history),
    ]


def _members_lines(meta: dict[str, Any]) -> list[str]:
    """An ensemble's card says what it holds: each member checkpoint, the data it was trained on, and how the members
    were chosen (``captioner ensemble``); it was not trained itself."""
    chosen = meta.get("members_chosen_on")
    lines = ["## Members", "",
             "Built by `captioner ensemble`, not trained: each step decodes the mean of the members' next-word "
             "probabilities and of their attention rows (models/ensemble.py)."
             + (f" Members chosen by greedy forward selection on the {chosen['split']} split's {chosen['metric']} "
                f"(beam {chosen['beam_size']}, at most {chosen['max_members']}, each addition gaining at least "
                f"{chosen['min_gain']:g})." if chosen else ""),
             "",
             "| member | architecture | trained on | training time | weights sha256 |",
             "|---|---|---|---:|---|"]
    for member in meta["ensemble_of"]:
        seconds = member.get("train_seconds")
        lines.append(f"| `{member['name']}` | `{member['arch']}` | {member.get('trained_on') or 'not recorded'} | "
                     f"{f'{seconds / 60:.1f} min' if seconds else 'not recorded'} | `{member['checksum'][:16]}…` |")
    return lines


def write_card(checkpoint: str | Path, report: dict[str, Any], title: str | None = None,
               notes: str = "") -> Path:
    """Write ``MODEL_CARD.md`` into ``checkpoint`` from its config ``meta`` and an eval ``report`` (the JSON that
    ``captioner eval --output`` writes)."""
    path = Path(checkpoint)
    ckpt = load_checkpoint(path, "cpu")
    config = read_config(path)
    meta = config.get("meta", {})
    model = ckpt.model
    params = count_parameters(model)
    splits = [(name, scores) for name, scores in report.items() if isinstance(scores, dict) and "images" in scores]
    scenes = any("objects_named" in scores for _, scores in splits)
    metrics = (METRICS if scenes else PHOTO_METRICS) + _other_measures(splits)
    chosen = meta.get("decoding_chosen_on")
    lines = [
        f"# {title or checkpoint_name(path)}",  # a run's best/ and last/ are named after their run
        "",
        f"**Architecture** `{model.arch}` ({model.attention_kind}); {params:,} parameters; model config "
        f"`{json.dumps(config['model'])}`.",
        f"**Encoder** ({_encoder_state(config['encoder'], meta)}) `{json.dumps(config['encoder'])}`.",
        f"**Vocabulary** {len(ckpt.vocab)} tokens. **Weights** `{WEIGHTS}` sha256 "
        f"`{file_checksum(path / WEIGHTS)[:16]}…`.",
        "",
    ]
    lines += _members_lines(meta) if meta.get("ensemble_of") else _training_lines(meta)
    lines += [
        "",
        f"## Measured by `captioner eval` (beam {report.get('beam_size', '?')}"
        + _rules_phrase(report.get("decoding")) + ")",
        "",
        *([f"The decoding rules were chosen on the {chosen['split']} split by {chosen['metric']} (`captioner "
           f"tune-decoding`, {chosen['images']} images); they are the checkpoint's defaults.", ""] if chosen else []),
        *_storage_lines(config.get("storage", "float32"), chosen, report),
        "| split | " + " | ".join(metrics) + " |",
        "|---" * (len(metrics) + 1) + "|",
        *(_row(name, scores, metrics) for name, scores in splits),
        "",
        ("`objects_named`: fraction of the objects of each image named with the right colour and shape. `heldout`: "
         "colour–shape combinations never seen in training (reported, not a target). " if scenes else
         "REP: the repetition score of SparseCap's Table 1 (lower is better); `distinct_words`: different words "
         "over the split; `novel_captions`: share of captions that are no training caption. ")
        + "SPICE needs Stanford CoreNLP models that cannot be downloaded here, so it is not measured.",
    ]
    if notes:
        lines += ["", "## Notes", "", notes.strip()]
    # the card is part of the checkpoint: written with its sha256 in the manifest, whole or not at all
    replace_files(path, {CARD: "\n".join(lines) + "\n"})
    return path / CARD
