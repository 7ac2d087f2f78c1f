"""A training run's files altered or damaged by hand: ``train_state.json`` of the wrong shape or not UTF-8, and
``metrics.jsonl`` lines that are not objects or not UTF-8.  ``--resume`` refuses the state naming it (it was a
TypeError/KeyError traceback, or the codec's message alone) and leaves the run as it was; ``plot`` and the resume's
trimming of the log pass over such lines as over a torn one (they were an AttributeError traceback)."""

from __future__ import annotations

import json

import pytest
import torch

from captioner.models.checkpoint import CheckpointError
from captioner.models.training import load_recipe
from captioner.models.training.curves import read_metrics
from captioner.models.training.run_log import METRICS_LOG, trim_metrics_log
from captioner.models.training.state import STATE_JSON, load_state, save_state
from captioner.service.cli import main

from .conftest import cli_error


def saved_run(folder):
    folder.mkdir()
    save_state(folder, {"config": {}, "progress": {"epoch": 1}, "model": {"w": torch.zeros(2)}, "optimizer": {}})
    return folder


def skeleton(folder) -> dict:
    return json.loads((folder / STATE_JSON).read_text())


@pytest.mark.parametrize("damage", ["list", "not utf-8", "no progress", "reference", "tensor name",
                                    "tensor name not text"])
def test_a_state_altered_by_hand_is_refused_naming_it(damage, tmp_path, capsys):
    run = saved_run(tmp_path / "run")
    state = skeleton(run)
    if damage == "list":
        text = b"[1]"
    elif damage == "not utf-8":
        text = b"\xff\xfe{}"
    else:
        if damage == "no progress":
            del state["progress"]
        elif damage == "reference":
            state["__tensors__"] = "x"
        elif damage == "tensor name":
            state["model"]["w"] = {"__tensor__": "nowhere"}
        else:  # a list cannot name a tensor (a TypeError looking it up, not a KeyError)
            state["model"]["w"] = {"__tensor__": ["s", "model", "w"]}
        text = json.dumps(state).encode()
    (run / STATE_JSON).write_bytes(text)
    with pytest.raises(CheckpointError, match=str(run / STATE_JSON)):
        load_state(run, objects=("progress",))
    assert cli_error(capsys, "train", "--out", str(run), "--resume", "--device", "cpu").startswith(
        f"error: {run / STATE_JSON}")
    assert (run / STATE_JSON).read_bytes() == text


@pytest.mark.parametrize("text, found", [("[1]", "its JSON is list, not an object"), ("{", "not JSON: ")])
def test_a_state_that_is_not_a_json_object_is_refused_saying_what_the_file_should_be(tmp_path, text, found):
    """The message is what ``--resume`` prints: it names the file, what it should hold and what it holds instead."""
    run = saved_run(tmp_path / "run")
    (run / STATE_JSON).write_text(text)
    with pytest.raises(CheckpointError) as refused:
        load_state(run, objects=("progress",))
    assert str(refused.value).startswith(f"{run / STATE_JSON} is not a training run's state ({found}")
    assert str(refused.value).endswith("(torn or altered): refusing to resume from it")


def test_log_lines_that_are_not_objects_or_not_utf8_are_passed_over(tmp_path):
    log = tmp_path / METRICS_LOG
    good = '{"kind": "step", "step": 10, "lr": 0.1, "xe": 2.0}'
    log.write_bytes(f'{good}\n[1, 2]\n"text"\n'.encode() + b'{"kind": "step", "step": 1\xff}\n'
                    + b'{"kind": "epoch", "epoch": "one", "CIDEr-D": [1]}\n{"kind": "step", "step": "x"}\n')
    steps, epochs = read_metrics(tmp_path)
    assert steps[0] == json.loads(good) and epochs == [{"kind": "epoch"}]
    trim_metrics_log(log, 10)
    assert log.read_text().splitlines() == [good, '{"kind": "epoch", "epoch": "one", "CIDEr-D": [1]}',
                                            '{"kind": "step", "step": "x"}']


def test_plot_draws_a_log_with_a_line_of_another_kind(tmp_path, capsys):
    # a loss or a score whose step or epoch is not a number is left out, not looked up (a KeyError traceback)
    (tmp_path / METRICS_LOG).write_text('{"kind": "step", "step": 10, "lr": 0.1, "xe": 2.0}\n[1]\n'
                                        '{"kind": "step", "step": 20, "lr": "high", "xe": 1.5}\n'
                                        '{"kind": "step", "step": "x", "xe": 1.0}\n'
                                        '{"kind": "epoch", "epoch": 1, "CIDEr-D": 0.4}\n'
                                        '{"kind": "epoch", "epoch": "two", "CIDEr-D": 0.5}\n')
    main(["plot", str(tmp_path), "--out", str(tmp_path / "curves.png")])
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_plot_of_a_folder_that_is_no_run_or_with_a_label_too_few_is_one_line_and_draws_nothing(tmp_path, capsys):
    """Not a silent exit 0 with no picture: a mistyped run folder must say so."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / METRICS_LOG).write_text('{"kind": "step", "step": 10, "lr": 0.1, "xe": 2.0}\n')
    out = tmp_path / "curves.png"
    run, nothing = str(tmp_path / "run"), tmp_path / "nothing"
    for argv, reason in (([str(nothing)], f"error: {nothing} does not exist"),
                         ([run, run, "--label", "A"], "error: 1 --label for 2 runs")):
        assert cli_error(capsys, "plot", *argv, "--out", str(out)).startswith(reason)
    assert not out.exists()


@pytest.mark.parametrize("damage, named", [("no progress", "progress missing"),
                                           ("reference", "__tensors__ missing"),
                                           ("reference's file a number", "__tensors__ missing")])
def test_a_refused_state_says_which_part_is_missing_or_of_the_wrong_kind(damage, named, tmp_path):
    """The refusal names what was altered: the reader's own object where that is missing, the tensor file's
    reference only where that is the fault (one name for both sends the user to the wrong part of the file)."""
    run = saved_run(tmp_path / "run")
    state = skeleton(run)
    if damage == "no progress":
        del state["progress"]
    elif damage == "reference":
        state["__tensors__"] = "x"
    else:  # its sha256 still text: every part of the reference is checked, not any one
        state["__tensors__"]["file"] = 5
    (run / STATE_JSON).write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=f"altered: {named} or of the wrong kind"):
        load_state(run, objects=("progress",))


@pytest.mark.parametrize("recipe, reason", [
    (b"lr = [", "is not a recipe \\(not TOML"), (b"lr = 1e-4\n\xff", ":2 is not UTF-8"),
    (b"model_args = 5", ": model_args is 5, not a table"), (b"xe = 5", ": xe is 5, not a table"),
    (b"[xe]\nmodel_args = 'wide'", ": xe.model_args is 'wide', not a table"), (b"phase = 2", ": phase is 2")])
def test_a_recipe_file_that_is_not_one_is_named(recipe, reason, tmp_path, capsys):
    path = tmp_path / "mine.toml"
    path.write_bytes(recipe)
    with pytest.raises(ValueError, match=f"{path}.*{reason}"):
        load_recipe(str(path))
    message = cli_error(capsys, "train", "--recipe", str(path), "--out", str(tmp_path / "run"), "--device", "cpu")
    assert message.startswith(f"error: {path}")
    assert not (tmp_path / "run").exists()


def test_a_log_line_that_was_not_utf8_is_passed_over_even_where_it_parses(tmp_path):
    # a byte that is not UTF-8 inside a string still parses once read as U+FFFD: the line is damaged all the same,
    # so it is neither drawn nor kept (kept, the resume's trim would write it back with other bytes)
    log = tmp_path / METRICS_LOG
    good = '{"kind": "step", "step": 10, "lr": 0.1, "xe": 2.0}'
    log.write_bytes(f"{good}\n".encode() + b'{"kind": "step", "step": 5, "lr": 0.1, "xe": 9.0, "note": "\xff"}\n')
    steps, _ = read_metrics(tmp_path)
    assert steps == [json.loads(good)]
    trim_metrics_log(log, 10)
    assert log.read_text() == f"{good}\n"
