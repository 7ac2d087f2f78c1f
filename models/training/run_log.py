"""A run's log, ``metrics.jsonl``: one JSON record per line, a training step's (:class:`StepLog`, every
``--log-every`` steps) or a finished epoch's (:class:`EpochLog`), appended by rank 0 as the run goes.  One reader,
:func:`iter_records`, serves everyone who reads it: the check that a new run's folder holds no one else's file
(:func:`is_run_log`, strict), ``--resume`` dropping the records of steps it trains again (:func:`trim_metrics_log`)
and ``captioner plot`` (:func:`captioner.models.training.curves.read_metrics`), which pass over a torn line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..checkpoint import check_replaceable, is_checkpoint
from ..files import naming_errors, write_atomically

METRICS_LOG = "metrics.jsonl"
#: the kinds of record this loop writes, and how every one of them starts (json.dumps of ``to_json()``)
KINDS = ("step", "epoch")
RECORD_START = '{"kind": "'


@dataclass
class StepLog:
    """One logged training step (a ``metrics.jsonl`` line with ``"kind": "step"``)."""

    epoch: int  # 1-based
    step: int  # global optimiser step, 1-based
    lr: float
    losses: dict[str, float]
    ss_prob: float
    tokens_per_s: float
    seconds: float  # wall clock of the run so far

    def to_json(self) -> dict[str, Any]:
        return {"kind": "step", "epoch": self.epoch, "step": self.step, "lr": self.lr, "ss_prob": self.ss_prob,
                "tokens_per_s": round(self.tokens_per_s, 1), "seconds": self.seconds,
                **{k: round(v, 5) for k, v in self.losses.items()}}


@dataclass
class EpochLog:
    """One finished epoch: the last batch's losses and the validation scores (``"kind": "epoch"``)."""

    epoch: int
    step: int
    lr: float
    losses: dict[str, float]
    scores: dict[str, float]
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": "epoch", "epoch": self.epoch, "step": self.step, "lr": self.lr, "seconds": self.seconds,
                **{k: round(v, 4) for k, v in self.losses.items()}, **{k: round(v, 4) for k, v in self.scores.items()}}


def iter_records(path: Path, strict: bool) -> Iterator[tuple[str, Any]]:
    """Each record of the log at ``path`` with its line, in order.

    ``strict``: every line is one of this loop's records (a JSON object of a kind in :data:`KINDS`), except at most
    the start of one more after the last newline (a write that was killed), which is passed over; any other line
    raises ValueError.  Any file can be checked: undecodable bytes are read as U+FFFD, not raised.
    Otherwise a line that is not JSON (torn by a kill), not UTF-8 or not a JSON object is passed over and every
    other is yielded as it parses (the loop writes ASCII JSON: a U+FFFD stands for bytes that were not UTF-8)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    if strict and lines and not text.endswith("\n"):
        torn = lines.pop()
        if not (torn.startswith(RECORD_START) or RECORD_START.startswith(torn)):
            raise ValueError(f"{path}: its unfinished last line is not the start of a record")
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if strict:
                raise ValueError(f"{path}, line {number}: not JSON") from None
            continue
        if not strict and (not isinstance(record, dict) or "\ufffd" in line):
            continue
        if strict and not (isinstance(record, dict) and record.get("kind") in KINDS):
            raise ValueError(f"{path}, line {number}: not a record of this loop")
        yield line, record


def is_run_log(path: Path) -> bool:
    """Whether ``path`` holds nothing but this loop's records, and at most the start of one more (a write that was
    killed: no newline after it)."""
    try:
        for _ in iter_records(path, strict=True):
            pass
    except ValueError:
        return False
    return True


def append_record(run_dir: Path, record: StepLog | EpochLog) -> None:
    # a full disk's torn line is dropped on --resume
    with naming_errors(run_dir / METRICS_LOG), open(run_dir / METRICS_LOG, "a") as handle:
        handle.write(json.dumps(record.to_json()) + "\n")


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def trim_metrics_log(path: Path, last_step: int) -> None:
    """On resume, drop records of steps after ``last_step``, the snapshot's (they will be trained again), and a torn
    last line."""
    if not path.exists():
        return
    keep = [line for line, record in iter_records(path, strict=False)
            if not (is_number(record.get("step")) and record["step"] > last_step)]
    # a new file renamed over the old one: a crash in the middle leaves the whole log, never half of it
    write_atomically(path, "".join(f"{line}\n" for line in keep), durable=True)


def check_new_run_folder(run_dir: Path, announce: bool) -> None:
    """A new run writes into ``run_dir`` only what is its own to write, checked before any work (an unusable
    ``best/`` was met only at the end of the first epoch): not into a checkpoint folder, not over a ``best/`` or
    ``last/`` that is no checkpoint, not on a ``metrics.jsonl`` that is not a run's log.  A log of this loop's
    records without a resumable state is an earlier start killed before its first snapshot: its steps are trained
    again, so :func:`~captioner.models.training.loop.fit` drops them rather than log them twice."""
    if (run_dir / "config.json").is_file():
        raise FileExistsError(f"--out {run_dir} is a checkpoint folder, not a run's: choose another --out (a run "
                              "writes its checkpoints into best/ and last/ below it)")
    for name in ("best", "last"):
        if is_checkpoint(run_dir / name):  # a finished run's, or one whose state was removed: a new run would
            # replace it (and its card) at its first validation
            raise FileExistsError(f"{run_dir} holds a trained model ({name}/) and no state to resume its run from: "
                                  "nothing was overwritten; choose another --out, or move the folder away first")
        check_replaceable(run_dir / name)
    log = run_dir / METRICS_LOG
    if log.is_file() and not is_run_log(log):
        raise FileExistsError(f"{log} is not a training log (its lines are not this loop's records): nothing was "
                              "written there; choose another --out")
    if log.is_file() and log.stat().st_size and announce:
        print(f"{run_dir} holds the log of a start that stopped before its first snapshot (--checkpoint-every): "
              "the run starts afresh and its log with it")
