"""A run's log, ``metrics.jsonl`` (models/training/run_log.py): the records' fields as they are written, which files
count as a run's log (the start of a record a kill cut short included), and what a resume keeps of it."""

from __future__ import annotations

import json
import re

import pytest

from captioner.models import files as files_module
from captioner.models.training.run_log import METRICS_LOG, EpochLog, StepLog, append_record, check_new_run_folder, \
    is_run_log, iter_records, trim_metrics_log

STEP = StepLog(epoch=2, step=7, lr=1e-4, losses={"xe": 1.234567891}, ss_prob=0.25, tokens_per_s=1234.5678,
               seconds=12.5)
EPOCH = EpochLog(epoch=2, step=8, lr=1e-4, losses={"xe": 1.234567891},
                 scores={"CIDEr-D": 0.123456, "BLEU-4": 0.0512345}, seconds=13.0)


def _log(folder, *records) -> str:
    for record in records:
        append_record(folder, record)
    return (folder / METRICS_LOG).read_text()


def test_each_record_is_appended_on_a_line_of_its_own_with_its_fields_rounded(tmp_path):
    lines = _log(tmp_path, STEP, EPOCH, STEP).splitlines()
    step = {"kind": "step", "epoch": 2, "step": 7, "lr": 1e-4, "ss_prob": 0.25, "tokens_per_s": 1234.6,
            "seconds": 12.5, "xe": 1.23457}
    assert [json.loads(line) for line in lines] == [step, {
        "kind": "epoch", "epoch": 2, "step": 8, "lr": 1e-4, "seconds": 13.0, "xe": 1.2346, "CIDEr-D": 0.1235,
        "BLEU-4": 0.0512}, step]


@pytest.mark.parametrize("torn, run_log", [
    ("", True), ("{", True), ('{"ki', True), ('{"kind": "st', True), ('{"kind": "epoch", "epoch": 3, "st', True),
    ("x", False), ('{"step": 3', False), ("[1, 2", False)])
def test_a_log_whose_last_line_is_the_start_of_a_record_is_a_run_log(tmp_path, torn, run_log):
    # a kill in the middle of a write leaves any prefix of a record after the last newline, however short
    log = tmp_path / METRICS_LOG
    log.write_text(_log(tmp_path, STEP, EPOCH) + torn)
    assert is_run_log(log) is run_log


@pytest.mark.parametrize("line, reason", [
    ("not JSON", "line 2: not JSON"), ("[1]", "line 2: not a record of this loop"),
    ('{"kind": "summary", "step": 3}', "line 2: not a record of this loop"),
    ('{"step": 3}', "line 2: not a record of this loop"), ("", "line 2: not JSON")])
def test_a_whole_line_that_is_not_a_record_is_named_and_makes_no_run_log(tmp_path, line, reason):
    log = tmp_path / METRICS_LOG
    log.write_text(_log(tmp_path, STEP) + f"{line}\n" + json.dumps(EPOCH.to_json()) + "\n")
    assert not is_run_log(log)
    with pytest.raises(ValueError, match=re.escape(f"{log}, {reason}")):
        list(iter_records(log, strict=True))


def test_any_file_can_be_checked(tmp_path):
    log = tmp_path / METRICS_LOG
    log.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    assert not is_run_log(log)
    log.write_bytes(b"")
    assert is_run_log(log)


def test_a_resume_keeps_the_records_up_to_its_snapshot_and_drops_later_ones_and_a_torn_line(tmp_path):
    records = [StepLog(1, step, 1e-3, {"xe": 3.0}, 0.0, 100.0, step) for step in (1, 2)]
    records += [EpochLog(1, 2, 1e-3, {"xe": 3.0}, {"CIDEr-D": 0.1}, 2.0)]
    later = [StepLog(2, step, 1e-3, {"xe": 2.0}, 0.0, 100.0, step) for step in (3, 4)]
    later += [EpochLog(2, 4, 1e-3, {"xe": 2.0}, {"CIDEr-D": 0.2}, 4.0)]
    log = tmp_path / METRICS_LOG
    kept = _log(tmp_path, *records)
    log.write_text(_log(tmp_path, *later) + '{"kind": "step", "epo')
    trim_metrics_log(log, 2)
    assert log.read_text() == kept
    trim_metrics_log(tmp_path / "elsewhere.jsonl", 2)  # a run that never logged: nothing to trim, nothing made
    assert sorted(tmp_path.iterdir()) == [log]


def test_a_new_run_over_a_killed_starts_log_says_so_only_when_asked_and_not_for_an_empty_log(tmp_path, capsys):
    log = tmp_path / METRICS_LOG
    log.write_text("")
    check_new_run_folder(tmp_path, announce=True)
    _log(tmp_path, STEP)
    check_new_run_folder(tmp_path, announce=False)
    assert capsys.readouterr().out == ""
    check_new_run_folder(tmp_path, announce=True)
    assert "holds the log of a start that stopped before its first snapshot" in capsys.readouterr().out


def test_a_log_holding_only_the_start_of_its_first_record_is_a_run_log(tmp_path):
    # a run killed while it wrote its first record: it must be able to start again in the same folder
    log = tmp_path / METRICS_LOG
    for torn in ('{"kind": "st', "{"):
        log.write_text(torn)
        assert is_run_log(log), torn
    log.write_text("x")
    assert not is_run_log(log)


def test_a_resumes_trim_of_the_log_is_flushed_to_disk(tmp_path, monkeypatch):
    """The trim rewrites the whole log: unflushed, a machine crash after the rename can leave it empty."""
    log = tmp_path / METRICS_LOG
    _log(tmp_path, STEP, EPOCH)
    synced = []
    monkeypatch.setattr(files_module.os, "fsync", lambda fd: synced.append(fd))
    trim_metrics_log(log, 7)
    assert len(synced) >= 2  # the new file, then its folder
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [7]


def test_a_torn_line_after_the_last_record_a_resume_keeps_is_dropped_too(tmp_path):
    # the snapshot at the last whole record: the torn line after it is no record of its own to keep
    log = tmp_path / METRICS_LOG
    kept = _log(tmp_path, STEP)
    log.write_text(kept + '{"kind": "epoch", "ep')
    trim_metrics_log(log, STEP.step)
    assert log.read_text() == kept
