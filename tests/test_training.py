"""XE training smoke tests: the loss falls, checkpoints load, and an interrupted run resumes exactly."""

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from captioner.models.checkpoint import load_checkpoint, save_checkpoint
from captioner.models.data.karpathy import CaptionedImage, load_karpathy
from captioner.models.data.scenes import describe_dataset, generate, read_dataset_header
from captioner.models.encoder import EncoderSpec
from captioner.models.evaluation.card import write_card
from captioner.models.files import FolderInUse, held_alone
from captioner.models.protocol import VisualBatch
from captioner.models.training import TrainConfig, fit, loop, prepare_run, train
from captioner.models.training.config import Progress
from captioner.models.training.distributed import DistContext
from captioner.models.training.loop import RunInUse, TrainingDiverged, TrainingInterrupted, _optimizer_step
from captioner.models.training.phase import PHASES, Phase, PhaseModule, register_phase
from captioner.models.training.resume import merge_resume
from captioner.models.training.run_log import EpochLog
from captioner.models.training.schedules import learning_rate
from captioner.models.training.scst import SCSTPhase
from captioner.models.training.warm_start import adopt_init, choose_vocab, lineage, load_init_weights
from captioner.models.training.xe import XEPhase, xe_loss
from captioner.models.vocab import Vocabulary
from captioner.models.zoo import create

from .conftest import before_each_step
from .model_checks import keys_store

SMALL = dict(embed_dim=32, hidden_dim=48, attn_dim=32, dropout=0.3)


def _config(scenes, out, cache, **overrides):
    cfg = dict(dataset=str(scenes), out=str(out), model_args=SMALL, cache_dir=str(cache), epochs=2, batch_size=16,
               lr=3e-3, progress=False, encoder={"image_size": 128})
    cfg.update(overrides)
    return TrainConfig(**cfg)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("features")


def test_loss_falls_and_best_checkpoint_loads(scenes, tmp_path, cache):
    # with AoANet's scheduled sampling, +0.05 a step here every epoch (the recipe: every 5 epochs)
    best = train(_config(scenes, tmp_path / "run", cache, epochs=3, ss_increase=0.05, ss_every=1, log_every=5))
    state = json.loads((tmp_path / "run" / "train_state.json").read_text())
    xe = [h["xe"] for h in state["progress"]["history"]]
    assert len(xe) == 3 and xe[-1] < xe[0]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(5, 46, 5))  # 15 steps an epoch, one record every 5
    assert sorted({(r["epoch"], r["ss_prob"]) for r in steps}) == [(1, 0.0), (2, 0.05), (3, 0.1)]
    assert all(r["tokens_per_s"] > 0 and r["lr"] == 3e-3 for r in steps)
    epochs = [{k: v for k, v in r.items() if k != "kind"} for r in records if r["kind"] == "epoch"]
    assert epochs == state["progress"]["history"]  # the log's epoch records are the run's history
    ckpt = load_checkpoint(best)
    assert ckpt.model.arch == "sat" and ckpt.encoder.image_size == 128 and "CIDEr-D" in ckpt.meta["val_scores"]
    # generated scenes list their objects, so validation also says how many were named right
    assert 0.0 <= ckpt.meta["val_scores"]["objects_named"] <= 1.0
    assert "CPU" in ckpt.meta["hardware"] or "GPU" in ckpt.meta["hardware"]


def test_resume_continues_exactly(scenes, tmp_path, cache, capsys):
    train(_config(scenes, tmp_path / "straight", cache))
    partial = _config(scenes, tmp_path / "resumed", cache, max_steps=20)  # stops inside epoch 2 (15 steps/epoch)
    train(partial)
    state = json.loads((tmp_path / "resumed" / "train_state.json").read_text())["progress"]
    assert (state["epoch"], state["step_in_epoch"], state["global_step"]) == (1, 5, 20)
    capsys.readouterr()
    train(_config(scenes, tmp_path / "resumed", cache), resume=True)
    assert "ignored" not in capsys.readouterr().out  # the same command resumes without a word about it
    # the recorded training time adds up both parts of the run
    first_part = state["train_seconds"]
    assert load_checkpoint(tmp_path / "resumed" / "last").meta["train_seconds"] > first_part > 0
    a = load_file(tmp_path / "straight" / "last" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "last" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], msg=f"{key} differs after resume")


def test_max_steps_at_an_epochs_end_takes_no_step_of_the_next(scenes, tmp_path, cache):
    """``max_steps`` was checked only after a step: reached at the end of an epoch, the epoch was validated and the
    next one took one step more (16 of 15), as did a resume given fewer steps than the run had taken."""
    train(_config(scenes, tmp_path / "run", cache, max_steps=15))  # 15 steps an epoch
    state = json.loads((tmp_path / "run" / "train_state.json").read_text())["progress"]
    assert (state["epoch"], state["step_in_epoch"], state["global_step"]) == (1, 0, 15)
    assert len(state["history"]) == 1  # the finished epoch was validated
    train(_config(scenes, tmp_path / "run", cache, max_steps=10), resume=True)
    assert json.loads((tmp_path / "run" / "train_state.json").read_text())["progress"]["global_step"] == 15


def test_a_runs_progress_in_a_log_is_a_few_lines_with_no_carriage_return(scenes, tmp_path, cache, capsys):
    """Standard error redirected to a file (``captioner train … > train.log 2>&1``): the epoch's bar is a line at
    its start and at its end, not a redraw a step joined by carriage returns (models/progress.py)."""
    train(_config(scenes, tmp_path / "run", cache, epochs=1, max_steps=15, progress=True))
    err = capsys.readouterr().err
    assert "\r" not in err
    bar_lines = [line for line in err.splitlines() if line.startswith("xe epoch 1/1: ")]
    assert 2 <= len(bar_lines) <= 3 and "15/15" in bar_lines[-1] and "lr=" in bar_lines[-1], err


def test_a_resumed_epochs_bar_counts_on_from_the_step_it_resumes_at(scenes, tmp_path, cache, capsys):
    """A run resumed inside an epoch shows that epoch's bar, numbered among the run's epochs, from its saved step:
    counted from 0, the bar of an epoch resumed after its first step began at 0/3 and ended at 2/3, an epoch that
    looked cut short (a fresh run's first epoch, the only bar tested, looks alike either way)."""
    small = dict(train_limit=8, val_limit=2)  # 8 photos × 5 captions in batches of 16: 3 steps an epoch, 2 epochs
    train(_config(scenes, tmp_path / "run", cache, max_steps=4, **small))  # one step into epoch 2
    capsys.readouterr()
    train(_config(scenes, tmp_path / "run", cache, progress=True, **small), resume=True)
    err = capsys.readouterr().err
    bar_lines = [line for line in err.splitlines() if line.startswith("xe epoch 2/2: ")]
    assert bar_lines and "| 1/3 " in bar_lines[0] and "| 3/3 " in bar_lines[-1], err


def test_a_run_says_what_it_trains_on_before_its_first_epoch(scenes, tmp_path, cache, capsys):
    """Before the features are read and the first bar is drawn, the run states its model, how many photos and
    captions it trains on, of which data set, how many it validates on and its vocabulary's size: a wrong --dataset
    or --train-limit is seen then, not after an epoch (and said by the main rank, the one whose output is read)."""
    run = prepare_run(_config(scenes, tmp_path / "run", cache, train_limit=8, val_limit=2))
    line = r"^training sat on 8 photos \((\d+) captions\) of (.+), validating on 2; vocabulary of (\d+) words$"
    said = re.findall(line, capsys.readouterr().out, re.M)
    assert said == [("40", str(scenes), str(len(run.vocab)))]


@pytest.mark.parametrize("broken, said", [("loss", r"the loss became nan \(its gradients' norm nan\)"),
                                           ("gradient", r"the loss became \d+\.\d+ \(its gradients' norm nan\)")])
def test_a_loss_or_gradient_that_is_not_a_number_stops_the_run_before_its_update_and_keeps_the_state_saved_last(
        scenes, tmp_path, cache, monkeypatch, broken, said):
    """A NaN loss or gradient, once stepped on, is NaN in every weight, and each later snapshot (the epoch's end,
    best/ when validation happens to score it well) would keep it: the run stops before the update, saying where it
    stopped, and last/ still holds the finite weights of the step before.  A finite loss may have a NaN gradient
    (√x at 0 is 0, its slope infinite): the loss alone would let that step through."""
    small = dict(train_limit=8, val_limit=2)  # 3 steps an epoch
    train(_config(scenes, tmp_path / "run", cache, epochs=1, **small))
    finite_loss, calls = XEPhase.loss, []

    def broken_after_one_step(self, batch, global_batch=None):
        out = finite_loss(self, batch, global_batch)
        calls.append(True)
        if len(calls) == 1:
            return out
        if broken == "loss":
            return replace(out, loss=out.loss * float("nan"))
        return replace(out, loss=out.loss + torch.sqrt(next(self.model.parameters()).sum() * 0))

    monkeypatch.setattr(XEPhase, "loss", broken_after_one_step)
    with pytest.raises(TrainingDiverged, match=said + r" at epoch 2, step 2, .* --resume"):
        train(_config(scenes, tmp_path / "run", cache, epochs=2, checkpoint_every=1, **small), resume=True)
    state = json.loads((tmp_path / "run" / "train_state.json").read_text())
    assert state["progress"]["global_step"] == 4  # epoch 1's three steps and the one before the NaN
    weights = load_file(tmp_path / "run" / "last" / "model.safetensors")
    assert all(torch.isfinite(value).all() for value in weights.values())


def test_a_learning_rate_drop_added_on_resume_equals_the_schedule_from_the_start(scenes, tmp_path, cache):
    scheduled = _config(scenes, tmp_path / "scheduled", cache, lr_drops=[1], lr_drop_factor=0.5)
    assert [learning_rate(scheduled, e) for e in range(3)] == [3e-3, 1.5e-3, 1.5e-3]
    train(scheduled)
    train(_config(scenes, tmp_path / "extended", cache, epochs=1))
    with pytest.raises(ValueError, match="already trained"):  # a drop inside the trained epochs would rewrite history
        train(_config(scenes, tmp_path / "extended", cache, lr_drops=[0]), resume=True)
    train(_config(scenes, tmp_path / "extended", cache, lr_drops=[1], lr_drop_factor=0.5), resume=True)
    history = load_checkpoint(tmp_path / "extended" / "last").meta["history"]
    assert [h["lr"] for h in history] == [3e-3, 1.5e-3]
    a = load_file(tmp_path / "scheduled" / "last" / "model.safetensors")
    b = load_file(tmp_path / "extended" / "last" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], msg=f"{key} differs")


def _scripted_validation(monkeypatch, scores):
    """Validation that gives epoch ``e`` the score ``scores[e - 1]`` (on every metric) without captioning: the run's
    bookkeeping (best/, the plateau, early stopping) then takes a known course."""
    def validate(run, epoch, lr, logs):
        return EpochLog(epoch=epoch + 1, step=run.progress.global_step, lr=lr, losses=logs,
                        scores={"BLEU-4": scores[epoch], "CIDEr-D": scores[epoch]}, seconds=run.elapsed())

    monkeypatch.setattr(loop, "_validate", validate)


def test_a_resumed_run_keeps_its_best_checkpoint_plateau_early_stop_log_and_clock(scenes, tmp_path, cache, capsys,
                                                                                   monkeypatch):
    """What a resume takes from the state beside the weights, against the same run trained straight: the best score
    and epoch (forgotten, the next epoch became best/, or early stopping counted from the start), the plateau's count
    and scale, that the run stopped early (a finished run trained on), the log without the steps a killed process
    logged after its last snapshot, and the training time (each snapshot adds the time since the one before).
    The scores make best/ epoch 2, halve the rate after epoch 3 and stop the run after epoch 4."""
    _scripted_validation(monkeypatch, [0.5, 0.7, 0.6, 0.6, 0.9, 0.9])
    # 8 photos × 5 captions in batches of 16: 3 steps an epoch; a snapshot after every step
    common = dict(train_limit=8, val_limit=2, epochs=6, early_stop=2, plateau_factor=0.5, plateau_patience=1,
                  log_every=1, checkpoint_every=1)
    run = prepare_run(_config(scenes, tmp_path / "straight", cache, **common))
    began = run.started
    fit(run)
    clock = time.time() - began
    straight = json.loads((tmp_path / "straight" / "train_state.json").read_text())["progress"]
    assert straight["train_seconds"] <= clock + 0.05 * straight["global_step"]  # rounded to 0.1 s at each snapshot

    out = tmp_path / "resumed"
    train(_config(scenes, out, cache, max_steps=4, **common))  # inside epoch 2
    log = out / "metrics.jsonl"
    last = json.loads(log.read_text().splitlines()[-1])  # step 4's: what a process killed after it logs next
    log.write_text(log.read_text() + "".join(json.dumps({**last, "step": step}) + "\n" for step in (5, 6)))
    train(_config(scenes, out, cache, max_steps=8, **common), resume=True)  # inside epoch 3, after best/ at epoch 2
    train(_config(scenes, out, cache, **common), resume=True)
    capsys.readouterr()
    train(_config(scenes, out, cache, **common), resume=True)  # it stopped early: nothing more to train
    assert "has finished (stopped early)" in capsys.readouterr().out
    resumed = json.loads((out / "train_state.json").read_text())["progress"]

    def course(progress):
        return {**progress, "train_seconds": None,
                "history": [{k: v for k, v in row.items() if k != "seconds"} for row in progress["history"]]}

    assert course(resumed) == course(straight)
    assert (resumed["epoch"], resumed["best_epoch"], resumed["stopped_early"]) == (4, 2, True)
    assert [h["lr"] for h in resumed["history"]] == [3e-3, 3e-3, 3e-3, 1.5e-3]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, 13))
    for name in ("straight", "resumed"):
        assert load_checkpoint(tmp_path / name / "best").meta["best_epoch"] == 2
    a, b = (load_file(tmp_path / name / "best" / "model.safetensors") for name in ("straight", "resumed"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=f"best/ {key} differs after resume")


def test_snapshots_and_step_records_count_the_runs_steps_and_an_epochs_end_is_saved_once(scenes, tmp_path, cache,
                                                                                          monkeypatch):
    """``--checkpoint-every`` and ``--log-every`` count the run's steps, not the epoch's (a kill loses at most that
    many steps, and the log's records fall every that many steps, however the epochs divide them), and an epoch's
    last step is saved once, by the epoch's end: a periodic snapshot there as well wrote the whole state (weights
    and optimiser: gigabytes for a large model) twice in a row."""
    _scripted_validation(monkeypatch, [0.5, 0.6])
    saved, real_save_state = [], loop.save_state

    def save_state(run_dir, state):
        saved.append(tuple(state["progress"][k] for k in ("epoch", "step_in_epoch", "global_step")))
        real_save_state(run_dir, state)

    monkeypatch.setattr(loop, "save_state", save_state)
    # 8 photos × 5 captions in batches of 16: 3 steps an epoch, 6 in all
    train(_config(scenes, tmp_path / "run", cache, train_limit=8, val_limit=2, checkpoint_every=2, log_every=2))
    assert saved == [(0, 2, 2), (1, 0, 3), (1, 1, 4), (2, 0, 6)]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["step"]) for r in records if r["kind"] == "step"] == [(1, 2), (2, 4), (2, 6)]


def test_each_step_updates_the_weights_with_one_optimiser_step(scenes, tmp_path, cache):
    """Every step the loop takes is one optimiser step: the checks on a run's course (the loss falls, a resume
    ends where the straight run does) also held for a loop that computed the losses and never stepped."""
    run = prepare_run(_config(scenes, tmp_path / "run", cache, train_limit=8, val_limit=2, max_steps=2))
    before = run.model.embed.weight.detach().clone()
    fit(run)
    assert {float(state["step"]) for state in run.optimizer.state.values()} == {2.0}
    assert not torch.equal(run.model.embed.weight, before)


def test_the_optimiser_is_the_one_the_run_names_with_its_betas_and_epsilon(scenes, tmp_path, cache):
    """--optimizer, --adam-betas and --adam-eps reach the optimiser: the recipes take them from their papers (the
    area Transformer's β2 0.98 and ε 1e-9, SparseCap's β1 0.8), and every run in the tests trained with the
    defaults, which any of them dropped would have given in silence."""
    run = prepare_run(_config(scenes, tmp_path / "run", cache, train_limit=8, val_limit=2, optimizer="radam",
                              adam_betas=[0.8, 0.98], adam_eps=1e-9))
    assert type(run.optimizer) is torch.optim.RAdam
    assert {(group["betas"], group["eps"]) for group in run.optimizer.param_groups} == {((0.8, 0.98), 1e-9)}


def test_a_warm_up_gives_every_step_its_own_rate(scenes, tmp_path, cache, monkeypatch):
    """Under a Noam warm-up the rate changes at every step, so the loop sets it before each step, not once an
    epoch: each step of an epoch took its first step's rate, a warm-up rising in steps of whole epochs."""
    _scripted_validation(monkeypatch, [0.5, 0.6])
    cfg = _config(scenes, tmp_path / "run", cache, train_limit=8, val_limit=2, warmup_steps=4, noam_dim=64,
                  log_every=1)  # 3 steps an epoch
    run = prepare_run(cfg)
    rates = []
    before_each_step(run, lambda *_: rates.append(run.optimizer.param_groups[0]["lr"]))
    fit(run)
    expected = [learning_rate(cfg, step // 3, step) for step in range(6)]
    assert len(set(expected)) == 6 and rates == expected
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records if r["kind"] == "step"] == expected


def test_a_learning_rate_drop_in_an_epoch_the_run_has_begun_is_refused(scenes, tmp_path, cache):
    """A state saved inside epoch 2 has trained some of epoch 2's steps at the old rate: a drop from epoch 2 on,
    added on resume, gave its other steps the new rate, a course no run with that schedule from the start takes
    (it was accepted: only the completed epochs were compared)."""
    small = dict(train_limit=8, val_limit=2)  # 8 photos × 5 captions in batches of 16: 3 steps an epoch
    train(_config(scenes, tmp_path / "run", cache, max_steps=4, **small))
    with pytest.raises(ValueError, match="epoch 2, which this run has already trained"):
        train(_config(scenes, tmp_path / "run", cache, lr_drops=[1], lr_drop_factor=0.5, **small), resume=True)
    train(_config(scenes, tmp_path / "run", cache, epochs=3, lr_drops=[2], lr_drop_factor=0.5, **small),
          resume=True)  # from the next epoch on
    history = json.loads((tmp_path / "run" / "train_state.json").read_text())["progress"]["history"]
    assert [h["lr"] for h in history] == [3e-3, 3e-3, 1.5e-3]


def test_checkpoints_can_be_selected_on_object_naming_but_not_on_unmeasured_metrics(scenes, tmp_path, cache):
    best = train(_config(scenes, tmp_path / "run", cache, epochs=1, select_metric="objects_named"))
    assert load_checkpoint(best).meta["selected_by"] == "objects_named"
    with pytest.raises(ValueError, match="METEOR"):
        train(_config(scenes, tmp_path / "other", cache, select_metric="METEOR"))
    assert not (tmp_path / "other" / "train_state.json").exists()


def test_checkpoints_are_selected_on_the_val_split_and_the_test_split_is_never_read(scenes, tmp_path, cache):
    """Validation, which picks best/ and drives early stopping and the plateau, captions the val split alone: a
    model chosen on the test split reports a test score tuned to it. The scenes' val and test splits are the same
    size, so only the photos' own split tells them apart."""
    train_images, val_images = loop._load_splits(_config(scenes, tmp_path / "run", cache))
    assert {im.split for im in train_images} == {"train"}
    assert {im.split for im in val_images} == {"val"} and len(val_images) == 12


def test_a_run_selects_on_its_models_own_measure_unless_the_command_names_one(scenes, tmp_path, cache):
    """``best/`` of a SAT run is picked on BLEU-4, SAT's early-stopping measure, not the protocol's CIDEr-D
    default, and ``--select-metric`` overrides it (the scripted validations score every measure alike, so only the
    run's own ``select`` shows which one it reads)."""
    small = dict(train_limit=8, val_limit=2)
    assert prepare_run(_config(scenes, tmp_path / "sat", cache, **small)).select == "BLEU-4"
    assert prepare_run(_config(scenes, tmp_path / "chosen", cache, select_metric="CIDEr-D", **small)).select == \
        "CIDEr-D"


def test_every_measure_validation_takes_can_select_and_objects_named_only_where_the_data_lists_objects(
        scenes, tmp_path, cache, monkeypatch):
    """``--select-metric`` takes BLEU-1 to 4 and CIDEr-D on any data set, and ``objects_named`` on generated scenes
    alone: photos list no objects, so a run selecting on it met a KeyError at its first epoch's end, an epoch of
    training lost."""
    for metric in ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "CIDEr-D", "objects_named"):  # a val split of one too
        loop._load_splits(_config(scenes, tmp_path / "run", cache, select_metric=metric, train_limit=8, val_limit=1))
    real = loop.load_captioned

    def photos(dataset, image_root, splits, limit=None):  # the scenes without their object lists, as photos are
        return [replace(im, info={k: v for k, v in im.info.items() if k != "objects"})
                for im in real(dataset, image_root, splits, limit=limit)]

    monkeypatch.setattr(loop, "load_captioned", photos)
    with pytest.raises(ValueError, match=r"--select-metric 'objects_named' cannot select .* CIDEr-D \("):
        loop._load_splits(_config(scenes, tmp_path / "run", cache, select_metric="objects_named", train_limit=8,
                                  val_limit=2))


def test_the_runs_seed_draws_its_initial_weights(scenes, tmp_path, cache):
    """``--seed`` picks a new run's initial weights: the same seed the same weights, another seed others."""
    weights = [prepare_run(_config(scenes, tmp_path / name, cache, train_limit=8, val_limit=2, seed=seed)).model
               .embed.weight for name, seed in [("a", 3), ("b", 3), ("c", 4)]]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])


def test_a_diverged_step_leaves_the_weights_and_the_count_of_the_step_before(scenes, tmp_path, cache, monkeypatch):
    """:class:`TrainingDiverged` says the run stopped *before* that step's update: a library caller that catches it
    (to save, or to lower the rate and go on) holds the last good step's weights and count, not weights stepped on a
    NaN gradient or a step counted that never trained (the CLI tests read only the state saved before it)."""
    run = prepare_run(_config(scenes, tmp_path / "run", cache, train_limit=8, val_limit=2, epochs=1, batch_size=4))
    finite_loss, weights = XEPhase.loss, []

    def nan_in_the_second_step(self, batch, global_batch=None):
        out = finite_loss(self, batch, global_batch)
        weights.append({key: value.clone() for key, value in self.model.state_dict().items()})
        return out if len(weights) == 1 else replace(out, loss=out.loss * float("nan"))

    monkeypatch.setattr(XEPhase, "loss", nan_in_the_second_step)
    with pytest.raises(TrainingDiverged, match="at epoch 1, step 2,"):
        fit(run)
    assert (run.progress.epoch, run.progress.step_in_epoch, run.progress.global_step) == (0, 1, 1)
    for key, value in run.model.state_dict().items():
        torch.testing.assert_close(value, weights[1][key], rtol=0, atol=0, msg=f"{key} was stepped on")


def test_existing_run_is_never_overwritten(scenes, tmp_path, cache):
    train(_config(scenes, tmp_path / "run", cache, max_steps=2))
    with pytest.raises(FileExistsError, match="--resume"):
        train(_config(scenes, tmp_path / "run", cache, max_steps=2))


def test_a_new_scst_run_without_init_is_refused_before_any_data_is_read(scenes, tmp_path, cache, monkeypatch):
    """Self-critical training samples from the model it improves: a new ``--phase scst`` run from random weights
    scores 0 on every sample and learns nothing, so it needs ``--init``; only a resumed run (whose recipe gives its
    ``init`` back) goes on without one.  The refusal comes before the data is read."""
    monkeypatch.setattr(loop, "_load_splits", lambda cfg: pytest.fail("the data was read before the refusal"))
    with pytest.raises(ValueError, match="--phase scst starts from a trained model: give --init"):
        prepare_run(_config(scenes, tmp_path / "run", cache, phase="scst"))


def test_ctrl_c_saves_state_and_resume_finishes_and_no_second_trainer_gets_in(scenes, tmp_path, cache):
    out = tmp_path / "interrupted"
    cmd = [sys.executable, "-m", "captioner.service.cli", "train", "--dataset", str(scenes), "--out", str(out),
           "--epochs", "50",
           "--batch-size", "4", "--cache-dir", str(cache), "--encoder", "image_size=128", "--set", "embed_dim=32",
           "--set", "hidden_dim=48", "--set", "attn_dim=32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    # wait until the first epoch is done (its best checkpoint saved), then interrupt mid-epoch; a loaded machine took
    # over two minutes for that epoch, and a signal sent before it ended found no best checkpoint to keep
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None and not (out / "train_state.json").exists():
        time.sleep(0.5)
    if not (out / "train_state.json").exists():
        proc.kill()
        pytest.fail(f"no state saved by the first epoch's end (status {proc.wait()}): {proc.stderr.read()[-2000:]}")
    time.sleep(1.0)
    # a --resume typed while the run goes on was a second trainer writing into the same folder
    log = (out / "metrics.jsonl").read_text()
    with pytest.raises(RunInUse, match="is being trained by another process"):
        train(_config(scenes, out, cache), resume=True)
    assert (out / "metrics.jsonl").read_text().startswith(log)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "--resume" in err
    assert "stopping after this step to save the run" in err  # said when pressed, not after the step
    progress = json.loads((out / "train_state.json").read_text())["progress"]
    assert progress["step_in_epoch"] > 0 and (out / "best" / "model.safetensors").exists()
    resume = [*cmd[:cmd.index("--epochs") + 1], str(progress["epoch"] + 1),
              *cmd[cmd.index("--epochs") + 2:], "--resume"]
    done = subprocess.run(resume, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming" in done.stdout
    # how best/ was chosen, where the run ends (only its card said)
    assert re.search(r"best checkpoint: \S+/best \(selected by validation BLEU-4 \d\.\d{4}, epoch \d+\)", done.stdout)
    final = json.loads((out / "train_state.json").read_text())["progress"]
    assert final["epoch"] == progress["epoch"] + 1 and final["step_in_epoch"] == 0


def test_grouped_epochs_visit_every_caption_once_with_an_images_captions_together(scenes, tmp_path, cache):
    images = load_karpathy(scenes, splits=("train",))
    vocab = Vocabulary.build([ref for im in images for ref in im.references])
    grouped = XEPhase(_config(scenes, tmp_path, cache, group_by_image=True), None, vocab, None, images, "cpu")
    order = grouped.epoch_order(0)
    assert sorted(order.tolist()) == list(range(grouped.size))  # every (image, caption) pair exactly once
    keys = [grouped.pairs[i][0] for i in order]
    runs = [key for j, key in enumerate(keys) if j == 0 or keys[j - 1] != key]
    assert len(runs) == len(images) == len(set(runs))  # each image's captions form one consecutive run
    assert runs != [im.key for im in images]  # in a shuffled image order, different every epoch
    assert [grouped.pairs[i][0] for i in grouped.epoch_order(1)] != keys
    # a pair names its image and which of the image's references it is (what --attention-supervision looks up)
    for pair in range(grouped.size):
        key, index = grouped.reference_of(pair)
        image = next(im for im in images if im.key == key)
        assert grouped.pairs[pair] == (key, vocab.encode(image.references[index], grouped.cfg.max_train_len))
    assert {grouped.reference_of(pair)[1] for pair in range(grouped.size)} == set(
        range(max(len(im.references) for im in images)))
    plain = XEPhase(_config(scenes, tmp_path, cache), None, vocab, None, images, "cpu")
    assert len({plain.pairs[i][0] for i in plain.epoch_order(0)[:5]}) > 1  # default: pairs shuffled one by one


def test_the_runs_seed_draws_its_data_order_and_the_same_seed_draws_it_again():
    """An epoch's order is seeded by (seed, epoch) (``Phase.epoch_order``): the same seed gives a resumed run the same
    batches, and another ``--seed`` another order; seeded by the epoch alone, every seed trained on the same batches,
    so runs meant to differ in their data order (to gauge a result's spread) differed only in their weights."""
    vocab = Vocabulary(["a", "b"])
    images = [CaptionedImage(i, Path(f"{i}.jpg"), "train", [["a"], ["b"]]) for i in range(20)]

    def order(seed, epoch):
        return XEPhase(_config("data", "run", "cache", seed=seed), None, vocab, None, images, "cpu").epoch_order(epoch)

    assert order(1, 0).tolist() == order(1, 0).tolist()
    assert order(1, 0).tolist() != order(2, 0).tolist()
    assert order(1, 1).tolist() != order(2, 1).tolist()


def test_an_epoch_of_captions_shuffled_one_by_one_visits_every_caption_once():
    """Without ``--group-by-image`` an epoch is a permutation of all (image, caption) pairs (``Phase.epoch_order``): a
    pair left out of it, the last one say, would never be trained on, in any epoch, and no loss would show it."""
    vocab = Vocabulary(["a", "b"])
    images = [CaptionedImage(i, Path(f"{i}.jpg"), "train", [["a"], ["b"], ["a", "b"]][: 1 + i % 3]) for i in range(7)]
    phase = XEPhase(_config("data", "run", "cache"), None, vocab, None, images, "cpu")
    assert phase.size == 13
    for epoch in range(3):
        assert sorted(phase.epoch_order(epoch).tolist()) == list(range(phase.size)), epoch


def test_each_epoch_trains_on_its_own_shuffle_of_the_data(scenes, tmp_path, cache, monkeypatch):
    """Every epoch takes its batches in the order its phase draws for that epoch: with the first epoch's order
    reused, each epoch met the same batches in the same sequence, and the model learnt the order's quirks."""
    _scripted_validation(monkeypatch, [0.5, 0.6])
    run = prepare_run(_config(scenes, tmp_path / "run", cache, train_limit=8, val_limit=2))  # 3 steps an epoch
    batches = []
    before_each_step(run, lambda shard, global_batch: batches.append(global_batch.tolist()))
    fit(run)
    steps = run.steps_per_epoch
    taken = [sum(batches[epoch * steps:(epoch + 1) * steps], []) for epoch in range(2)]
    assert taken == [run.phase.epoch_order(epoch).tolist() for epoch in range(2)]
    assert taken[0] != taken[1]


def test_each_epoch_samples_at_its_own_scheduled_rate_and_logs_its_last_steps_losses(scenes, tmp_path, cache,
                                                                                      monkeypatch):
    """Scheduled sampling's probability rises at the start of the epoch the schedule gives it (one epoch early, the
    first epoch already fed the model its own words), and an epoch's record holds the losses of its last step
    (``EpochLog``), not of its first one: with the first, a falling loss looked flat across the epochs."""
    _scripted_validation(monkeypatch, [0.5, 0.6])
    # 8 photos × 5 captions in batches of 16: 3 steps an epoch; +0.05 every epoch
    run = prepare_run(_config(scenes, tmp_path / "run", cache, train_limit=8, val_limit=2, ss_increase=0.05,
                              ss_every=1))
    step, rates, losses = run.trainer, [], []

    def noted(*args):
        rates.append(run.phase.ss_prob)
        loss, logs, tokens = step(*args)
        losses.append({k: round(float(v), 4) for k, v in logs.items()})
        return loss, logs, tokens

    run.trainer = noted
    fit(run)
    assert rates == [0.0] * 3 + [0.05] * 3
    history = run.progress.history
    assert [{k: row[k] for k in losses[0]} for row in history] == [losses[2], losses[5]]
    assert losses[2] != losses[0]  # the first step's losses differ, or the check above proved nothing


@pytest.mark.parametrize("arch, args", [("aoanet", dict(d_model=32, embed_dim=32, ffn_dim=64, heads=4,
                                                        refine_layers=2)),
                                        ("xtransformer", dict(dim=32, channel_dim=16, ffn_dim=64, encoder_layers=2,
                                                              decoder_layers=2)),
                                        ("area-transformer", dict(d_model=32, n_heads=4, ffn_dim=64, caption_area=2)),
                                        ("sat", SMALL)])
def test_captions_sharing_an_image_get_the_same_log_probs_as_when_it_is_encoded_per_caption(arch, args):
    torch.manual_seed(0)
    model = create(arch, vocab_size=17, feat_dim=12, **args).eval()
    images = VisualBatch.from_features(torch.randn(2, 9, 12))
    rows = torch.tensor([0, 0, 1, 0, 1])
    captions = torch.randint(3, 17, (5, 6))
    per_caption = VisualBatch.from_features(images.feats[rows])
    shared, _ = model.forward_xe(images, captions, rows=rows)
    expected, _ = model.forward_xe(per_caption, captions)
    torch.testing.assert_close(shared, expected)


def test_another_architecture_starts_from_a_checkpoint_whose_weights_it_fits(scenes, tmp_path, cache):
    soft = train(_config(scenes, tmp_path / "soft", cache, epochs=1))
    hard = train(_config(scenes, tmp_path / "hard", cache, epochs=1, lr=0.0, model="sat-hard",
                         model_args={}, init=str(soft)))
    soft_weights, hard_weights = load_checkpoint(soft).model.state_dict(), load_checkpoint(hard).model.state_dict()
    hard_sizes, soft_sizes = load_checkpoint(hard).model.hparams, load_checkpoint(soft).model.hparams
    assert load_checkpoint(hard).model.arch == "sat-hard"
    assert {k: hard_sizes[k] for k in ("embed_dim", "hidden_dim", "attn_dim")} == \
        {k: soft_sizes[k] for k in ("embed_dim", "hidden_dim", "attn_dim")}  # the soft model's sizes, adopted
    assert set(soft_weights) - set(hard_weights) == {"gate.weight", "gate.bias"}  # the β gate, dropped
    assert all(torch.equal(hard_weights[k], soft_weights[k]) for k in hard_weights if not k.startswith("baseline"))
    # the card names what the warm start began from and counts its training time
    card = write_card(hard, {}).read_text()
    assert f"- Started from `{soft}`: sat, epoch 1 of its xe run (its best)" in card
    assert "with the runs it started from" in card
    with pytest.raises(ValueError, match=r"cannot initialise .*no weights of the right shape"):
        train(_config(scenes, tmp_path / "aoa", cache, epochs=1, model="aoanet", model_args={}, init=str(soft)))


def test_extend_vocab_appends_the_datas_new_words_and_keeps_the_trained_rows(scenes, tmp_path, cache):
    # a checkpoint that knows only the frequent words (min_count), then the data's others appended
    few = train(_config(scenes, tmp_path / "few", cache, epochs=1, min_count=150))  # keeps 2 of 51 words
    more = train(_config(scenes, tmp_path / "more", cache, epochs=1, lr=0.0, init=str(few), extend_vocab=True))
    old, new = load_checkpoint(few), load_checkpoint(more)
    assert len(new.vocab) > len(old.vocab) and new.vocab.itos[: len(old.vocab)] == old.vocab.itos
    for key in ("embed.weight", "out_word.weight", "out_word.bias"):
        grown, trained = new.model.state_dict()[key], old.model.state_dict()[key]
        assert grown.shape[0] == len(new.vocab) and torch.equal(grown[: len(old.vocab)], trained)


def test_a_warm_start_adopts_the_checkpoints_vocabulary_sizes_encoder_features_and_lineage(tmp_path):
    """What ``--init`` takes from its checkpoint, without training: its vocabulary (one built from the new data's
    words gave the checkpoint's rows to other words, in silence where the count agreed), its sizes with the
    command's ``--set`` values over them, its encoder and the features it was trained on unless the command names
    others, ``--extend-vocab``'s new words once each after its own, and for the card what it began from in turn."""
    vocab = Vocabulary(["a", "red", "circle"])
    torch.manual_seed(0)
    model = create("sat", vocab_size=len(vocab), feat_dim=16, **SMALL)
    first = {"checkpoint": "runs/first/best", "arch": "sat", "epochs": 3, "started_from": None}
    trained = TrainConfig(out="runs/second", features="regions:/data/boxes").to_json()
    path = save_checkpoint(tmp_path / "ckpt", model, vocab, EncoderSpec(image_size=96),
                           {"phase": "xe", "history": [{}, {}], "best_epoch": 2, "train_config": trained,
                            "train_seconds": 42.0, "started_from": first, "dataset": "data/dataset_flickr8k.json"})
    init = load_checkpoint(path)

    cfg = adopt_init(TrainConfig(out="run", init=str(path), model_args={"dropout": 0.1}), init)
    assert cfg.model == "sat" and cfg.model_args["dropout"] == 0.1 and cfg.model_args["hidden_dim"] == 48
    assert EncoderSpec.of(cfg.encoder).image_size == 96 and cfg.features == "regions:/data/boxes"
    assert adopt_init(TrainConfig(out="run", init=str(path), features="grid"), init).features == "grid"

    photos = [CaptionedImage(1, Path("p.jpg"), "train", [["a", "blue", "square"], ["a", "red", "square"]])]
    assert choose_vocab(TrainConfig(out="run", init=str(path)), None, init, photos).itos == vocab.itos
    extended = choose_vocab(TrainConfig(out="run", init=str(path), extend_vocab=True), None, init, photos)
    assert extended.itos == vocab.itos + ["square", "blue"]

    began = lineage(str(path), init)
    assert (began["arch"], began["epochs"], began["best_epoch"], began["started_from"]) == ("sat", 2, 2, first)
    # the card says which phase the checkpoint ended and counts its training time with the run's own
    assert (began["phase"], began["train_seconds"]) == ("xe", 42.0)
    # and which data set it was trained on: the card's "Started from … on `DATASET`" (lost, it read "on `None`")
    assert began["dataset"] == "data/dataset_flickr8k.json"


def _saved_small_sat(folder):
    """A small soft SAT over three words, saved after XE into ``folder``: a warm start's checkpoint (vocab, path)."""
    vocab = Vocabulary(["a", "red", "circle"])
    torch.manual_seed(0)
    return vocab, save_checkpoint(folder, create("sat", vocab_size=len(vocab), feat_dim=16, **SMALL), vocab,
                                  EncoderSpec(image_size=96), {"phase": "xe"})


def test_a_warm_start_into_another_architecture_keeps_only_the_sizes_it_takes_and_never_the_data_sizes(tmp_path):
    """SAT-hard from a soft SAT: the sizes both take are adopted, SAT's own options (its doubly stochastic weight λ)
    are left out, or building SAT-hard would fail on them; the vocabulary and feature sizes are the new run's (its
    vocabulary may be extended, its features another source), so they are never adopted."""
    vocab, path = _saved_small_sat(tmp_path / "ckpt")
    init = load_checkpoint(path)
    same = adopt_init(TrainConfig(out="run", init=str(path)), init)
    assert not {"vocab_size", "feat_dim"} & set(same.model_args) and same.model_args["doubly_stochastic"] == 1.0
    hard = adopt_init(TrainConfig(out="run", init=str(path), model="sat-hard"), init)
    assert hard.model == "sat-hard" and {k: hard.model_args[k] for k in SMALL} == SMALL
    assert not {"gate", "output", "doubly_stochastic", "vocab_size", "feat_dim"} & set(hard.model_args)
    assert create("sat-hard", vocab_size=len(vocab) + 1, feat_dim=8, **hard.model_args).hparams["hidden_dim"] == 48


def test_init_weights_fill_an_extended_vocabulary_and_a_related_architecture_and_refuse_other_shapes(tmp_path,
                                                                                                      capsys):
    """Without training: ``--extend-vocab``'s rows are the checkpoint's for its words and the new model's fresh ones
    for the appended words; SAT-hard takes a soft SAT's weights, keeps its own REINFORCE baseline (a buffer the
    checkpoint lacks) and names the β gate it drops; an embedding of another width is refused by name, not left to
    fail inside ``torch.cat``."""
    vocab, path = _saved_small_sat(tmp_path / "ckpt")
    init, n = load_checkpoint(path), len(vocab)
    trained = init.model.state_dict()

    grown = create("sat", vocab_size=n + 2, feat_dim=16, **SMALL)
    fresh = {k: v.clone() for k, v in grown.state_dict().items()}
    load_init_weights(grown, init, str(path))
    for key in ("embed.weight", "out_word.weight", "out_word.bias"):
        weights = grown.state_dict()[key]
        assert torch.equal(weights[:n], trained[key]) and torch.equal(weights[n:], fresh[key][n:])
    assert torch.equal(grown.state_dict()["init_h.weight"], trained["init_h.weight"])

    capsys.readouterr()
    hard = create("sat-hard", vocab_size=n, feat_dim=16, **SMALL)
    hard.baseline.fill_(0.25)
    load_init_weights(hard, init, str(path))
    assert float(hard.baseline) == 0.25 and torch.equal(hard.state_dict()["embed.weight"], trained["embed.weight"])
    assert f"--init {path}: sat weights ShowAttendTellHard has no use for: gate.bias, gate.weight" in \
        capsys.readouterr().out

    wider = create("sat", vocab_size=n + 2, feat_dim=16, **{**SMALL, "embed_dim": 40})
    with pytest.raises(ValueError, match=r"cannot initialise ShowAttendTell: no weights of the right shape .*embed"):
        load_init_weights(wider, init, str(path))


def test_a_refused_warm_start_names_every_misfit_weight_or_says_it_names_only_the_first_eight(tmp_path):
    """The refusal is what a user reads to choose the ``--set`` sizes that fit the checkpoint: up to eight misfit
    weights are all named, with nothing after them; more are cut at eight and end in "…", so a user does not take
    the first eight for all of them (the ellipsis shown for fewer than eight, and none for more, passed every
    test)."""
    vocab, path = _saved_small_sat(tmp_path / "ckpt")
    init = load_checkpoint(path)
    seven = "embed.weight, lstm.weight_ih, out_h.bias, out_h.weight, out_word.weight, out_z.bias, out_z.weight"
    wider, taller = ({**SMALL, "embed_dim": 40}, {**SMALL, "hidden_dim": 40})
    with pytest.raises(ValueError, match=rf"no weights of the right shape for {re.escape(seven)}$"):
        load_init_weights(create("sat", vocab_size=len(vocab), feat_dim=16, **wider), init, "ckpt")
    with pytest.raises(ValueError) as refused:
        load_init_weights(create("sat", vocab_size=len(vocab), feat_dim=16, **taller), init, "ckpt")
    named = str(refused.value).split("no weights of the right shape for ")[1]
    assert named.endswith(" …") and len(named.removesuffix(" …").split(", ")) == 8


def test_a_warm_starts_vocabulary_encoder_and_lineage_where_the_run_or_the_checkpoint_is_unusual(tmp_path):
    """A resumed run's vocabulary is the one it saved (its rows are trained to those words), whatever its --init
    checkpoint or its data would give now; --extend-vocab may add no word; an --encoder other than the checkpoint's
    is refused; and a checkpoint whose meta lacks its train config (one saved in code) names no command in the
    lineage."""
    vocab, path = _saved_small_sat(tmp_path / "ckpt")
    init = load_checkpoint(path)
    photos = [CaptionedImage(1, Path("p.jpg"), "train", [["a", "blue", "square"]])]
    saved = {"vocab": Vocabulary(["a", "red", "circle", "green", "square"]).to_json()}
    for cfg, given in ((TrainConfig(out="run", init=str(path), extend_vocab=True), init),
                       (TrainConfig(out="run", min_count=1), None)):
        assert choose_vocab(cfg, saved, given, photos).itos == Vocabulary.from_json(saved["vocab"]).itos
    # --extend-vocab with a --min-count that keeps none of the data's words: the checkpoint's words, no error
    extend = TrainConfig(out="run", init=str(path), extend_vocab=True, min_count=5)
    assert choose_vocab(extend, None, init, photos).itos == vocab.itos
    # the encoder the checkpoint was trained with is the run's: another one given is refused, the same one taken
    with pytest.raises(ValueError, match="--encoder differs from the encoder"):
        adopt_init(TrainConfig(out="run", init=str(path), encoder={"image_size": 128}), init)
    assert EncoderSpec.of(adopt_init(TrainConfig(out="run", init=str(path), encoder={"image_size": 96}),
                                     init).encoder).image_size == 96
    began = lineage(str(path), init)
    assert (began["command"], began["epochs"], began["started_from"]) == (None, 0, None)


def test_resume_says_which_given_values_the_runs_recipe_overrides(scenes, tmp_path, cache, capsys):
    saved = _config(scenes, tmp_path / "run", cache, model="sat")
    capsys.readouterr()
    merged = merge_resume(_config(scenes, tmp_path / "run", cache, model="xlan", epochs=4),
                           json.loads(json.dumps(saved.to_json())), 0)
    assert merged.model == saved.model and merged.epochs == 4
    assert "ignored: model='xlan' (the run's: 'sat')" in capsys.readouterr().out


def test_resume_changes_only_what_the_command_gave(scenes, tmp_path, cache):
    """``captioner train --out RUN --resume`` without --epochs keeps the run's epochs (and early stopping, the
    recipe's); what belongs to the process (--max-steps, threads, device) is the command's, given or not."""
    saved = _config(scenes, tmp_path / "run", cache, model="sat", epochs=2, early_stop=5, max_steps=3)
    command = _config(scenes, tmp_path / "run", cache, model="sat", epochs=20, early_stop=0)  # the defaults
    merged = merge_resume(command, json.loads(json.dumps(saved.to_json())), 0, explicit={"out"})
    assert (merged.epochs, merged.early_stop, merged.max_steps) == (2, 5, None)
    longer = merge_resume(command, json.loads(json.dumps(saved.to_json())), 0, explicit={"out", "epochs"})
    assert longer.epochs == 20
    # what may change on resume does, when given: early stopping turned off, snapshots and log records more often
    given = _config(scenes, tmp_path / "run", cache, model="sat", early_stop=0, checkpoint_every=7, log_every=3)
    changed = merge_resume(given, json.loads(json.dumps(saved.to_json())), 0,
                           explicit={"out", "early_stop", "checkpoint_every", "log_every"})
    assert (changed.early_stop, changed.checkpoint_every, changed.log_every, changed.epochs) == (0, 7, 3, 2)


def test_a_resume_runs_on_this_processs_device_threads_and_progress_whatever_the_run_had(scenes, tmp_path, cache):
    """What belongs to the process is the command's, given or not: a GPU run resumed on a CPU machine asked for the
    GPU it had, and a run started with --threads 4 or --no-progress kept them on a machine that wants others."""
    saved = _config(scenes, tmp_path / "run", cache, device="cuda", threads=4, progress=False)
    command = _config(scenes, tmp_path / "run", cache, device="cpu", threads=None, progress=True)
    for explicit in ({"out"}, None):
        merged = merge_resume(command, json.loads(json.dumps(saved.to_json())), 0, explicit=explicit)
        assert (merged.device, merged.threads, merged.progress) == ("cpu", None, True), explicit


def test_a_run_trains_on_the_threads_its_command_asks_for(scenes, tmp_path, cache, monkeypatch):
    """``captioner train --threads 2`` (a shared machine, a container's CPU quota): the run set no thread count of
    its own, so torch took every core whatever the command said, and no test noticed (the commands' tests stand in
    for ``device.set_threads``, which the training loop imports under its own name)."""
    threads = []

    class BeforeTheDevice(Exception):
        pass

    def no_device(device):
        raise BeforeTheDevice(device)

    monkeypatch.setattr(loop, "set_threads", threads.append)
    monkeypatch.setattr(loop, "init_distributed", no_device)  # the threads are set first: nothing more is needed
    with pytest.raises(BeforeTheDevice):
        prepare_run(_config(scenes, tmp_path / "run", cache, threads=2))
    assert threads == [2]


def test_a_resume_that_changes_the_drop_factor_of_a_drop_already_passed_is_refused(scenes, tmp_path, cache):
    """``--lr-drop-factor`` is part of the schedule the finished epochs were trained with: the same drop after epoch
    1 given a factor of 0.1 where the run's was 0.5 changes epoch 2's rate, and is refused like a new drop there."""
    saved = json.loads(json.dumps(_config(scenes, tmp_path / "run", cache, lr_drops=[1], lr_drop_factor=0.5).to_json()))
    command = _config(scenes, tmp_path / "run", cache, lr_drops=[1], lr_drop_factor=0.1)
    with pytest.raises(ValueError, match="epoch 2, which this run has already trained"):
        merge_resume(command, saved, 2, explicit={"out", "lr_drops", "lr_drop_factor"})
    assert merge_resume(command, saved, 1, explicit={"out", "lr_drops", "lr_drop_factor"}).lr_drop_factor == 0.1


def test_resume_does_not_call_a_given_value_equal_to_the_runs_ignored(scenes, tmp_path, cache, capsys):
    # a command repeating the run's own recipe value (its --model) changes nothing, so nothing is said ignored
    saved = _config(scenes, tmp_path / "run", cache, model="sat")
    capsys.readouterr()
    merge_resume(_config(scenes, tmp_path / "run", cache, model="sat"), json.loads(json.dumps(saved.to_json())), 0,
                 explicit={"out", "model"})
    assert "ignored" not in capsys.readouterr().out


def test_a_learning_rate_given_on_resume_is_said_ignored_and_the_runs_kept(scenes, tmp_path, cache, capsys):
    """The learning rate is the recipe's, not one of what a resume may change: taken from ``--resume --lr``, the
    epochs still to come were trained at a rate no run of the recipe had (or a run one epoch in was refused, told
    that its --lr-drop schedule changed)."""
    saved = json.loads(json.dumps(_config(scenes, tmp_path / "run", cache).to_json()))
    capsys.readouterr()
    merged = merge_resume(_config(scenes, tmp_path / "run", cache, lr=1e-3), saved, 1, explicit={"out", "lr"})
    assert merged.lr == 3e-3
    assert "ignored: lr=0.001 (the run's: 0.003)" in capsys.readouterr().out


def test_a_runs_folder_named_by_another_path_is_not_said_ignored(scenes, tmp_path, cache, capsys, monkeypatch):
    """``--out`` names the run to resume, not a value of its recipe: a run started with ``--out run`` and resumed as
    ``--out /abs/run`` (from another folder, or by a path of its own) was told its --out had been ignored."""
    monkeypatch.chdir(tmp_path)
    saved = json.loads(json.dumps(_config(scenes, "run", cache).to_json()))
    capsys.readouterr()
    merge_resume(_config(scenes, tmp_path / "run", cache), saved, 0, explicit={"out"})
    assert "ignored" not in capsys.readouterr().out


def test_a_moved_data_location_that_does_not_exist_either_is_not_taken(scenes, tmp_path, cache, monkeypatch):
    """The command's place replaces the run's gone one only where it exists: a mistyped one is said ignored, and the
    run keeps its own (so its error names the place the run had)."""
    monkeypatch.chdir(tmp_path)
    saved = _config(scenes, tmp_path / "run", cache, image_root=str(tmp_path / "gone"))
    merged = merge_resume(_config(scenes, tmp_path / "run", cache, image_root="typo"),
                          json.loads(json.dumps(saved.to_json())), 0, explicit={"out", "image_root"})
    assert merged.image_root == str(tmp_path / "gone")


def test_a_run_whose_photo_folder_moved_resumes_from_where_the_command_says_recorded_absolute(scenes, tmp_path,
                                                                                           cache, monkeypatch):
    """``--image-root`` moves like ``--dataset`` (the photos on another disk than the captions), and a moved place
    given relative is recorded absolute: a later resume reads the run's relative paths from the folder the run was
    started in, not this one."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "photos").mkdir()
    saved = _config(scenes, tmp_path / "run", cache, image_root=str(tmp_path / "gone"))
    merged = merge_resume(_config(scenes, tmp_path / "run", cache, image_root="photos"),
                          json.loads(json.dumps(saved.to_json())), 0, explicit={"out", "image_root"})
    assert merged.image_root == str((tmp_path / "photos").resolve())


def test_a_resume_keeps_the_runs_learning_rate_drops_unless_the_command_adds_some(scenes, tmp_path, cache):
    """Only drops the command gives replace the run's: a command without any (a config built in code, where
    ``explicit`` is None and every option counts as given) or one that does not name --lr-drop keeps the run's
    schedule for the epochs still to come."""
    saved = json.loads(json.dumps(_config(scenes, tmp_path / "run", cache, lr_drops=[5], lr_drop_factor=0.5).to_json()))
    for command, explicit in ((_config(scenes, tmp_path / "run", cache), None),
                              (_config(scenes, tmp_path / "run", cache, lr_drops=[3]), {"out"})):
        merged = merge_resume(command, saved, 0, explicit=explicit)
        assert (merged.lr_drops, merged.lr_drop_factor) == ([5], 0.5)
    added = merge_resume(_config(scenes, tmp_path / "run", cache, lr_drops=[5, 8], lr_drop_factor=0.5), saved, 0,
                         explicit={"out", "lr_drops"})
    assert added.lr_drops == [5, 8]


def test_a_resume_that_names_no_data_set_keeps_the_runs_though_the_default_one_is_here(scenes, tmp_path, cache,
                                                                                    monkeypatch, capsys):
    """A command without --dataset holds the default, ``.cache/scenes``: it names no data set, so a run whose own is
    gone is not moved onto the default one found in this folder, and a run whose own is here hears of no ignored
    one; nor does a command that names the run's data set by another path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "scenes").symlink_to(scenes.parent)
    command = TrainConfig(out=str(tmp_path / "run"))
    for explicit in ({"out"}, None):
        for dataset in (scenes, tmp_path / "gone" / scenes.name):
            saved = _config(dataset, tmp_path / "run", cache)
            merged = merge_resume(command, json.loads(json.dumps(saved.to_json())), 0, explicit=explicit)
            assert merged.dataset == str(dataset) and capsys.readouterr().out == "", (explicit, dataset)
    # the run's own data set named by its folder, where the run recorded its file: the same data, not another
    saved = _config(scenes, tmp_path / "run", cache)
    merge_resume(_config(scenes.parent, tmp_path / "run", cache), json.loads(json.dumps(saved.to_json())), 0,
                 explicit={"out", "dataset"})
    assert capsys.readouterr().out == ""


def test_a_scene_checkpoints_card_names_its_data_alike_once_the_data_set_is_gone(tmp_path):
    """A scene checkpoint records its data set's header at train time, so its card's Data line (the generator's
    version and the command that draws the set again) does not depend on the set being here when the card is
    written."""
    dataset = generate(tmp_path / "scenes", {"train": 16, "val": 4, "test": 0, "heldout": 0}, seed=11, progress=False)
    described = describe_dataset(read_dataset_header(dataset))
    best = train(_config(dataset, tmp_path / "run", tmp_path / "features", epochs=1, batch_size=8))
    card = write_card(best, {}).read_text()
    assert f"- Data: {described}: `{dataset}`" in card
    shutil.rmtree(tmp_path / "scenes")
    assert write_card(best, {}).read_text() == card


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_xe_loss_is_the_token_mean_over_non_pad_targets_with_label_smoothing_towards_uniform(eps):
    logprobs = torch.log_softmax(torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)), -1)
    logprobs.requires_grad_()
    targets = torch.tensor([[4, 2, 0], [1, 3, 2]])  # pad id 0: one padded position
    terms = [(1 - eps) * -logprobs[b, t, targets[b, t]] + eps * -logprobs[b, t].mean()
             for b in range(2) for t in range(3) if targets[b, t] != 0]
    expected = torch.stack(terms).sum() / 5
    loss = xe_loss(logprobs, targets, pad_id=0, label_smoothing=eps)
    torch.testing.assert_close(loss, expected)
    # and its gradient: the smoothing term pulls every word's log-probability up, not only the value's
    torch.testing.assert_close(torch.autograd.grad(loss, logprobs)[0], torch.autograd.grad(expected, logprobs)[0])


def test_a_runs_label_smoothing_reaches_its_xe_loss(scenes, tmp_path, cache):
    """The xe phase passes --label-smoothing (AoANet's recipe: 0.2) to its loss: the same batch through the same
    weights costs another XE with it than without it (dropped, a recipe's smoothing went unused, in silence)."""
    run = prepare_run(_config(scenes, tmp_path / "run", cache, train_limit=8, val_limit=2, label_smoothing=0.2,
                              model_args={**SMALL, "dropout": 0.0}))
    plain = XEPhase(replace(run.cfg, label_smoothing=0.0), run.model, run.phase.vocab, run.store, run.phase.images,
                    "cpu")
    batch = run.phase.epoch_order(0)[:16]
    smoothed, unsmoothed = run.phase.loss(batch).logs["xe"], plain.loss(batch).logs["xe"]
    assert smoothed != pytest.approx(unsmoothed, rel=1e-3)


def test_a_ranks_auxiliary_losses_are_weighted_by_its_share_of_the_global_batchs_captions():
    """Under DDP a rank's loss is scaled so that the ranks' mean is the global batch's: the XE by the rank's share
    of the target tokens, an auxiliary term (SAT's doubly stochastic penalty, a mean over captions) by its share of
    the captions, here 3 of 5 on the first of two ranks: 3 · 2 / 5 = 1.2 times the term.  On one process both
    are their plain sum (a doubled XE went unseen: Adam barely feels the scale, but gradient clipping does)."""
    vocab = Vocabulary(["a", "b"])
    images = [CaptionedImage(i, Path(f"{i}.jpg"), "train", [["a", "b"][: 1 + (i > 0)]]) for i in range(5)]
    model = SimpleNamespace(forward_xe=lambda vis, targets, ss, rows: (
        torch.log_softmax(torch.zeros(*targets.shape, len(vocab)), -1), {"penalty": torch.tensor(1.0)}))
    store = SimpleNamespace(batch=lambda keys: torch.zeros(len(keys), 1))
    phase = XEPhase(_config("data", "run", "cache"), model, vocab, store, images, "cpu")
    alone = phase.loss([0, 1, 2, 3, 4], [0, 1, 2, 3, 4])  # one process: the loss itself, unweighted
    assert alone.loss.item() == pytest.approx(alone.logs["xe"] + 1.0)
    phase.world = 2
    out = phase.loss([0, 1, 2], [0, 1, 2, 3, 4])
    # targets with EOS: 2 for the first caption, 3 for each other; the rank holds 8 of the 14 tokens
    assert out.loss.item() == pytest.approx(out.logs["xe"] * 8 * 2 / 14 + 1.2)


def test_every_auxiliary_term_the_model_returns_is_added_to_the_loss():
    """SAT-hard's model returns its REINFORCE and entropy terms beside the doubly stochastic penalty, and
    ``--attention-supervision`` adds its own to SAT's penalty: the step minimises each of them.  Were only the first
    term added, the others would still be logged, and the run would seem to train on them while it did not."""
    vocab = Vocabulary(["a", "b"])
    images = [CaptionedImage(i, Path(f"{i}.jpg"), "train", [["a", "b"]]) for i in range(3)]
    terms = {"penalty": 1.0, "reinforce": 0.25, "attention_supervision": 2.0}

    def forward_xe(vis, targets, ss, rows):
        aux = {name: torch.tensor(value) for name, value in terms.items()}
        return torch.log_softmax(torch.zeros(*targets.shape, len(vocab)), -1), aux

    model = SimpleNamespace(forward_xe=forward_xe)
    phase = XEPhase(_config("data", "run", "cache"), model, vocab, keys_store(), images, "cpu")
    out = phase.loss([0, 1, 2])
    assert out.logs == pytest.approx({"xe": out.logs["xe"], **terms})
    assert out.loss.item() == pytest.approx(out.logs["xe"] + 3.25)


def test_each_caption_of_a_batch_reads_its_own_images_row():
    """A batch's distinct images are read and encoded once, each caption pointing at its image's row: in a batch of
    pairs of interleaved images (a shuffled epoch), no caption may be paired with another photo."""
    vocab = Vocabulary(["a", "b"])
    images = [CaptionedImage(i, Path(f"{i}.jpg"), "train", [["a"], ["b"]]) for i in range(3)]
    read = {}

    def forward_xe(vis, targets, ss, rows):
        read["keys"] = [vis[row] for row in rows.tolist()]  # the store below hands back the keys as the batch
        return torch.log_softmax(torch.zeros(*targets.shape, len(vocab)), -1), {}

    store = keys_store()
    phase = XEPhase(_config("data", "run", "cache"), SimpleNamespace(forward_xe=forward_xe), vocab, store, images,
                    "cpu")
    batch = [5, 0, 4, 2, 1]  # pairs of images 2, 0, 2, 1, 0
    phase.loss(batch)
    assert read["keys"] == [phase.pairs[i][0] for i in batch]


def test_a_batch_is_taught_at_the_epochs_scheduled_sampling_rate():
    """The loop sets the phase's scheduled-sampling probability each epoch (Bengio et al. 2015, as AoANet uses it);
    the phase hands it to the model's teacher-forced pass.  The loop's own test reads the rate off the phase, so a
    phase that always taught with the ground truth passed it."""
    vocab = Vocabulary(["a", "b"])
    images = [CaptionedImage(i, Path(f"{i}.jpg"), "train", [["a", "b"]]) for i in range(2)]
    rates = []

    def forward_xe(vis, targets, ss, rows):
        rates.append(ss)
        return torch.log_softmax(torch.zeros(*targets.shape, len(vocab)), -1), {}

    phase = XEPhase(_config("data", "run", "cache"), SimpleNamespace(forward_xe=forward_xe), vocab, keys_store(),
                    images, "cpu")
    phase.ss_prob = 0.25
    phase.loss([0, 1])
    assert rates == [0.25]


def test_the_module_ddp_wraps_holds_the_models_and_the_fine_tuned_stages_parameters():
    """DistributedDataParallel averages the gradients of the parameters its module holds: the model's, and those of
    the fine-tuned encoder stages, whose copies on the ranks would otherwise drift apart (no DDP test fine-tunes)."""
    model, tail = torch.nn.Linear(2, 2), torch.nn.Linear(3, 3)
    module = PhaseModule(model, SimpleNamespace(), tail)
    assert {id(p) for p in module.parameters()} == {id(p) for p in [*model.parameters(), *tail.parameters()]}


def test_the_module_ddp_wraps_hands_the_phase_this_ranks_share_and_the_whole_batch():
    """A rank's loss is weighted by its share of the global batch (``Phase.loss``): the module DDP calls must pass the
    whole batch on, not the rank's share again (each rank's loss then counted as the whole batch's, ``world`` times
    too heavy) nor nothing (no weighting at all); one process never tells the two apart."""
    seen = []

    def loss(batch, global_batch=None):
        seen.append((batch, global_batch))
        return SimpleNamespace(loss=torch.tensor(1.5), logs={"xe": 1.5}, tokens=7)

    module = PhaseModule(torch.nn.Linear(2, 2), SimpleNamespace(loss=loss))
    assert module([3, 1], [3, 1, 4, 0]) == (torch.tensor(1.5), {"xe": 1.5}, 7)
    assert seen == [([3, 1], [3, 1, 4, 0])]


def test_a_registered_phase_is_the_one_phase_names_and_knows_its_own_name(monkeypatch):
    """``--phase`` looks the phase up in :data:`PHASES` under the name :func:`register_phase` gave it, and the class
    carries that name (``Phase.name``), which a library caller or a phase of a plugin reads to say which phase a run
    trains."""
    assert (PHASES["xe"], PHASES["scst"]) == (XEPhase, SCSTPhase)
    assert (XEPhase.name, SCSTPhase.name) == ("xe", "scst")
    monkeypatch.setitem(PHASES, "probe", None)  # taken out again after the test

    @register_phase("probe")
    class ProbePhase(Phase):
        pass

    assert PHASES["probe"] is ProbePhase and ProbePhase.name == "probe"


def test_the_xe_of_bfloat16_log_probs_is_taken_in_float32():
    """Under bfloat16 autocast (on CPU too) a model's log-probabilities come out in bfloat16; the phase takes their
    XE in float32, whose logged value and gradient keep the digits a bfloat16 mean rounds away."""
    vocab = Vocabulary(["a", "b"])
    images = [CaptionedImage(i, Path(f"{i}.jpg"), "train", [["a", "b", "a"], ["b"]]) for i in range(3)]
    logprobs = torch.log_softmax(torch.randn(6, 4, len(vocab), generator=torch.Generator().manual_seed(0)), -1)
    model = SimpleNamespace(forward_xe=lambda vis, targets, ss, rows: (logprobs[:, :targets.shape[1]].bfloat16(), {}))
    store = keys_store()
    phase = XEPhase(_config("data", "run", "cache"), model, vocab, store, images, "cpu")
    out = phase.loss(range(6))
    targets = torch.tensor([ids + [vocab.pad_id] * (4 - len(ids)) for _, ids in phase.pairs])
    expected = xe_loss(logprobs.bfloat16().float(), targets, vocab.pad_id)
    assert out.loss.dtype == torch.float32 and out.logs["xe"] == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("mode, expected", [("norm", [-0.3, -0.4]), ("value", [-0.5, -0.5])])
def test_an_optimiser_step_clips_the_gradient_by_its_norm_or_each_value(mode, expected):
    weight = torch.nn.Parameter(torch.zeros(2))
    run = SimpleNamespace(cfg=SimpleNamespace(grad_clip=0.5, grad_clip_mode=mode), scaler=None,
                          optimizer=torch.optim.SGD([weight], lr=1.0), dist=SimpleNamespace(any=bool))
    _optimizer_step(run, (torch.tensor([30.0, 40.0]) * weight).sum())  # gradient (30, 40): norm 50
    torch.testing.assert_close(weight.detach(), torch.tensor(expected))


def test_a_scaled_step_clips_the_true_gradient_and_skips_an_overflow_halving_the_scale():
    """Under fp16's gradient scaler the clip applies to the unscaled gradient (clipped while scaled by 1024, the
    step was 1024 times too small), and the scaler is updated after each step: an overflowing step is skipped and
    the scale halved, or every later step overflowed as well."""
    weight = torch.nn.Parameter(torch.zeros(2))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    run = SimpleNamespace(cfg=SimpleNamespace(grad_clip=0.5, grad_clip_mode="norm"), scaler=scaler,
                          optimizer=torch.optim.SGD([weight], lr=1.0))
    _optimizer_step(run, (torch.tensor([30.0, 40.0]) * weight).sum())  # gradient (30, 40): norm 50
    torch.testing.assert_close(weight.detach(), torch.tensor([-0.3, -0.4]))
    _optimizer_step(run, (torch.tensor([float("inf"), 40.0]) * weight).sum())
    torch.testing.assert_close(weight.detach(), torch.tensor([-0.3, -0.4]))
    assert scaler.get_scale() == 512.0


def test_a_step_another_rank_found_diverged_is_not_taken_on_this_rank_either():
    """Under torchrun each rank's loss is its own share's: a rank whose loss and gradients are finite stops with the
    rank whose are not (``dist.any``), before the update, rather than step on alone and wait for the stopped rank in
    the next step's collective for ever."""
    asked = []
    weight = torch.nn.Parameter(torch.zeros(2))
    cfg, optimizer = SimpleNamespace(grad_clip=0.0, grad_clip_mode="norm"), torch.optim.SGD([weight], lr=1.0)
    dist = SimpleNamespace(any=lambda flag: asked.append(flag) or True)  # another rank's loss was NaN
    run = SimpleNamespace(cfg=cfg, optimizer=optimizer, dist=dist, scaler=None, progress=Progress(), run_dir="run")
    with pytest.raises(TrainingDiverged, match="^another rank's loss or gradients stopped being a number at epoch 1, "
                                               "step 1, and the run stopped before the update"):
        _optimizer_step(run, (torch.tensor([30.0, 40.0]) * weight).sum())  # not "the loss became 0.0"
    assert asked == [False]  # this rank's own step was finite
    assert torch.equal(weight.detach(), torch.zeros(2))


@pytest.mark.parametrize("scaled, grad_clip, mode, norms", [
    (False, 0.0, "norm", 1), (False, 0.5, "value", 1),  # the divergence check reads it
    (True, 0.5, "norm", 1),  # the clip reads it
    (True, 0.5, "value", 0), (True, 0.0, "norm", 0),  # nothing reads it: the scaler skips a step that overflows
])
def test_an_optimiser_step_takes_the_gradients_norm_only_where_something_reads_it(monkeypatch, scaled, grad_clip,
                                                                                     mode, norms):
    """The total norm is one more pass over every gradient: a float16 run clipping by value, or not clipping, has
    no divergence check and no clip by norm to read it."""
    taken = []
    total_norm = torch.nn.utils.get_total_norm
    monkeypatch.setattr(torch.nn.utils, "get_total_norm",
                        lambda *args, **kw: taken.append(1) or total_norm(*args, **kw))
    weight = torch.nn.Parameter(torch.zeros(2))
    run = SimpleNamespace(cfg=SimpleNamespace(grad_clip=grad_clip, grad_clip_mode=mode),
                          scaler=torch.amp.GradScaler("cpu") if scaled else None,
                          optimizer=torch.optim.SGD([weight], lr=1.0), dist=SimpleNamespace(any=bool))
    _optimizer_step(run, (torch.tensor([30.0, 40.0]) * weight).sum())
    assert len(taken) == norms and weight.detach().abs().sum() > 0


def test_validation_captions_the_val_split_with_the_runs_beam_and_length(monkeypatch):
    """--val-beam and --max-decode-len reach the captions validation scores (every run in the tests validated with
    the default greedy decoding, so a beam given for validation went unused in silence), and the epoch's record
    carries their scores."""
    seen = {}

    def caption_dataset(model, vocab, images, store, beam, max_len, device):
        seen.update(images=images, beam=beam, max_len=max_len)
        return ["a red circle"] * len(images)

    monkeypatch.setattr(loop, "caption_dataset", caption_dataset)
    monkeypatch.setattr(loop, "score_dataset", lambda captions, images, metrics: {"BLEU-4": 0.25, "CIDEr-D": 0.5})
    val_images = [SimpleNamespace(key="a"), SimpleNamespace(key="b")]
    run = SimpleNamespace(dist=SimpleNamespace(is_main=True, from_main=lambda scores: scores), model=None, vocab=None,
                          val_images=val_images, store=None, cfg=SimpleNamespace(val_beam=3, max_decode_len=7),
                          device=torch.device("cpu"), progress=SimpleNamespace(global_step=12), elapsed=lambda: 1.0)
    record = loop._validate(run, 1, 1e-3, {"xe": 2.0})
    assert seen == {"images": val_images, "beam": 3, "max_len": 7}
    assert (record.epoch, record.step, record.scores) == (2, 12, {"BLEU-4": 0.25, "CIDEr-D": 0.5})


def test_validation_records_every_measure_a_run_can_select_by(scenes, monkeypatch):
    """``--select-metric`` offers BLEU-1 to 4, CIDEr-D and, on scenes, ``objects_named``, as "what validation
    measures": an epoch's record holds each (scored BLEU alone, a run selecting on CIDEr-D, every model's default
    but SAT's, met a KeyError at its first epoch's end; the other tests of validation stand in for its scoring)."""
    val_images = load_karpathy(scenes, splits=("val",))[:3]
    monkeypatch.setattr(loop, "caption_dataset", lambda model, vocab, images, store, beam, max_len, device: {
        im.image_id: im.references[0] for im in images})
    run = SimpleNamespace(dist=SimpleNamespace(is_main=True, from_main=lambda scores: scores), model=None, vocab=None,
                          val_images=val_images, store=None, cfg=SimpleNamespace(val_beam=1, max_decode_len=7),
                          device=torch.device("cpu"), progress=SimpleNamespace(global_step=3), elapsed=lambda: 1.0)
    record = loop._validate(run, 0, 1e-3, {"xe": 2.0})
    assert {"BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "CIDEr-D", "objects_named"} <= set(record.scores)


def test_a_runs_clock_adds_this_sessions_time_to_what_its_earlier_sessions_trained(monkeypatch):
    """``elapsed`` is the seconds of the saved sessions plus this one's, to 0.1 s: a resumed run's card reported only
    the time since its last resume."""
    run = SimpleNamespace(progress=SimpleNamespace(train_seconds=90.0), started=100.0)
    monkeypatch.setattr(loop, "time", SimpleNamespace(time=lambda: 112.34))  # 12.34 s since this session began
    assert loop.Run.elapsed(run) == 102.3


def test_a_folder_another_trainer_holds_is_refused_before_anything_is_written(scenes, tmp_path, cache):
    """The one-trainer lock, without a second process: a folder held (as a running ``train`` holds its ``--out``)
    refuses the run, which writes nothing into it; a new folder is held as well, not only one that existed."""
    out = tmp_path / "run"
    with held_alone(out, FolderInUse("held by a running train")):
        with pytest.raises(RunInUse, match="is being trained by another process"):
            train(_config(scenes, out, cache, train_limit=8, val_limit=2, max_steps=1))
        assert out.is_dir() and not any(out.iterdir())
    train(_config(scenes, out, cache, train_limit=8, val_limit=2, max_steps=1))  # free again once let go
    assert (out / "train_state.json").exists()


def test_only_the_main_rank_holds_the_run_folder(tmp_path, monkeypatch):
    """Under torchrun rank 0 holds ``--out`` and the other ranks follow it: were every rank to take the lock, each
    rank after the first was refused as "another process" while rank 0 trained."""
    out = tmp_path / "run"
    with held_alone(out, FolderInUse("held by rank 0")):
        monkeypatch.setattr(loop, "distributed_rank", lambda: 1)
        with loop._sole_trainer(out):  # no RunInUse
            pass
        monkeypatch.setattr(loop, "distributed_rank", lambda: 0)
        with pytest.raises(RunInUse):
            with loop._sole_trainer(out):
                pass


class _RankOfTwo(DistContext):
    """Rank ``rank`` of a two-process run, played by this one process: each collective answers with its own value,
    and the rank trains the whole global batch (what the loop does with the rank and the world is all that shows)."""

    def shard(self, batch):
        return batch

    def barrier(self):
        pass

    def any(self, flag):
        return bool(flag)

    def from_main(self, obj):
        return obj

    def gather(self, obj):
        return [obj]


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_only_rank_0_logs_steps_and_it_counts_every_ranks_tokens(scenes, tmp_path, cache, monkeypatch,
                                                                              rank):
    """A step record's ``tokens_per_s`` is the whole run's throughput: each rank trains its share of the global
    batch, so rank 0's tokens count ``world`` times (the one-process tests read the same rate either way), and the
    other ranks write no record (every rank appending to ``metrics.jsonl`` logged each step twice) and save no state
    (rank 0 saves every rank's: a second writer of ``train_state.json`` could remove the tensor file rank 0's JSON
    names, and its state held only its own random streams)."""
    run = prepare_run(_config(scenes, tmp_path / "run", cache, train_limit=8, val_limit=2, max_steps=1, log_every=1))
    run.dist = _RankOfTwo(rank=rank, world=2)
    clock = itertools.count(1000.0)  # one second a reading: the first step takes one second
    monkeypatch.setattr(loop, "time", SimpleNamespace(time=lambda: float(next(clock))))
    step, tokens = run.trainer, []

    def noted(*args):
        loss, logs, batch_tokens = step(*args)
        tokens.append(batch_tokens)
        return loss, logs, batch_tokens

    run.trainer = noted
    fit(run)
    log = tmp_path / "run" / "metrics.jsonl"
    if rank == 1:
        assert not log.exists() or not log.read_text()
        assert not (tmp_path / "run" / "train_state.json").exists()  # max_steps reached mid-epoch: rank 0 saves
        return
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert tokens[0] > 0 and record["tokens_per_s"] == 2 * tokens[0]


def test_a_stop_asked_of_another_rank_stops_this_one_after_the_same_step(scenes, tmp_path, cache, monkeypatch):
    """A SIGTERM sent to one worker (a scheduler's, a kill) reaches that rank alone, and each rank asks the others
    after every step (``dist.any``): all of them stop after the same step, the main rank saves it and the run says it
    was interrupted. A rank that checked only its own flag trained on alone (to wait for the stopped rank in its next
    collective) or, once out of the epoch, ended as if its run had finished."""
    monkeypatch.setattr(loop, "_stop_if_diverged", lambda run, loss, norm: None)  # it asks the ranks too: its own test

    class SignalledElsewhere(_RankOfTwo):
        def any(self, flag):
            return True  # the other rank was stopped

    run = prepare_run(_config(scenes, tmp_path / "run", cache, train_limit=8, val_limit=2))  # 3 steps an epoch
    run.dist = SignalledElsewhere(rank=0, world=2)
    with pytest.raises(TrainingInterrupted, match="interrupted at epoch 1, step 1;"):
        fit(run)
    progress = json.loads((tmp_path / "run" / "train_state.json").read_text())["progress"]
    assert (progress["epoch"], progress["step_in_epoch"], progress["global_step"]) == (0, 1, 1)


def test_a_resumed_rank_draws_on_from_the_random_stream_its_state_put_back(scenes, tmp_path, cache, monkeypatch):
    """A rank of a resumed torchrun run goes on from the random stream the run's state gave it back (rank 0 saves
    every rank's): seeded afresh after that, as a new run's ranks are, each resume drew the dropout masks and SCST's
    samples of the run's first steps again, and a resumed run was not the run trained straight."""
    train(_config(scenes, tmp_path / "run", cache, train_limit=8, val_limit=2, max_steps=1))
    monkeypatch.setattr(loop, "init_distributed", lambda device: (_RankOfTwo(rank=1, world=2), "cpu"))
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", lambda module, **options: module)
    restored, restore = [], loop.restore

    def noted(*args):
        progress = restore(*args)
        restored.append(torch.get_rng_state())
        return progress

    monkeypatch.setattr(loop, "restore", noted)
    run = prepare_run(_config(scenes, tmp_path / "run", cache, train_limit=8, val_limit=2, max_steps=2), resume=True)
    assert run.dist.active and run.progress.global_step == 1 and len(restored) == 1
    assert torch.equal(torch.get_rng_state(), restored[0])


def test_rank_0_opens_the_feature_store_first_and_alone_draws_its_progress(monkeypatch):
    """Under torchrun rank 0 extracts what a cold feature cache lacks while the other ranks wait at a barrier, and
    they then open the finished store without bars of their own: ranks that opened it first each extracted every
    photo again into the same cache folder (the tests' ranks share a cache filled beforehand, where it never
    showed), and each rank drew its own bars over rank 0's."""
    events = []

    def open_feature_store(*args, progress, **options):
        events.append(("open", progress))
        return "store"

    monkeypatch.setattr(loop, "open_feature_store", open_feature_store)
    cfg = _config("data", "run", "cache", progress=True)
    for rank, expected in [(0, [("open", True), "barrier", "barrier"]), (1, ["barrier", ("open", False), "barrier"])]:
        events.clear()
        ctx = SimpleNamespace(is_main=rank == 0, barrier=lambda: events.append("barrier"))
        assert loop._open_store(cfg, EncoderSpec(image_size=96), [], [], ctx, torch.device("cpu")) == ("store", None)
        assert events == expected, rank


def test_best_is_saved_only_on_a_strictly_better_score_and_early_stop_counts_from_it(tmp_path, monkeypatch):
    saved = []
    monkeypatch.setattr(loop, "_encoder_files", lambda run: (None, {}))
    monkeypatch.setattr(loop, "save_checkpoint", lambda path, model, vocab, spec, meta, files: saved.append(
        (path.name, meta.get("best_epoch"))))
    run = SimpleNamespace(progress=Progress(), cfg=SimpleNamespace(early_stop=2), select="CIDEr-D",
                          dist=SimpleNamespace(is_main=True), run_dir=tmp_path, meta={}, model=None, vocab=None,
                          schedules=SimpleNamespace(plateau=None), elapsed=lambda: 0.0)
    stopped = []
    for epoch, score in enumerate([0.5, 0.7, 0.7, 0.6], 1):
        loop._end_epoch(run, EpochLog(epoch, 10 * epoch, 1e-3, {"xe": 1.0}, {"CIDEr-D": score, "BLEU-4": 0.1}, 0.0))
        stopped.append(run.progress.stopped_early)
    assert [best for name, best in saved if name == "best"] == [1, 2]  # a tie (epoch 3) is no improvement
    assert [name for name, _ in saved].count("last") == 4
    assert (run.progress.best_epoch, run.progress.best_score, run.progress.epoch) == (2, 0.7, 4)
    assert stopped == [False, False, False, True]  # two epochs without a better score after epoch 2


def test_each_checkpoint_carries_the_runs_history_time_and_its_own_epochs_scores(tmp_path, monkeypatch):
    """The meta of ``last/`` and ``best/`` (what the model card and ``captioner plot`` read) holds the run's
    validation history up to that epoch and its training time, and ``best/`` the scores of the epoch it keeps."""
    saved = []
    monkeypatch.setattr(loop, "_encoder_files", lambda run: (None, {}))
    monkeypatch.setattr(loop, "save_checkpoint", lambda path, model, vocab, spec, meta, files: saved.append(
        (path.name, [row["epoch"] for row in meta["history"]], meta["train_seconds"], meta.get("val_scores"))))
    run = SimpleNamespace(progress=Progress(), cfg=SimpleNamespace(early_stop=0), select="CIDEr-D",
                          dist=SimpleNamespace(is_main=True), run_dir=tmp_path, meta={}, model=None, vocab=None,
                          schedules=SimpleNamespace(plateau=None), elapsed=lambda: 42.5)
    for epoch, score in enumerate([0.5, 0.7, 0.6], 1):
        loop._end_epoch(run, EpochLog(epoch, 10 * epoch, 1e-3, {"xe": 1.0}, {"CIDEr-D": score, "BLEU-4": 0.1}, 0.0))
    assert [(name, epochs, seconds) for name, epochs, seconds, _ in saved] == [
        ("last", [1], 42.5), ("best", [1], 42.5), ("last", [1, 2], 42.5), ("best", [1, 2], 42.5),
        ("last", [1, 2, 3], 42.5)]
    assert [(scores["epoch"], scores["CIDEr-D"]) for name, _, _, scores in saved if name == "best"] == \
        [(1, 0.5), (2, 0.7)]


def _end_epochs_run(tmp_path, monkeypatch, *, select, is_main=True, early_stop=0):
    """A run for :func:`loop._end_epoch` alone, whose checkpoints are noted (folder, best epoch, measure) rather than
    written; returns it and the notes."""
    saved = []
    monkeypatch.setattr(loop, "_encoder_files", lambda run: (None, {}))
    monkeypatch.setattr(loop, "save_checkpoint", lambda path, model, vocab, spec, meta, files: saved.append(
        (path.name, meta.get("best_epoch"), meta.get("selected_by"))))
    run = SimpleNamespace(progress=Progress(), cfg=SimpleNamespace(early_stop=early_stop), select=select,
                          dist=SimpleNamespace(is_main=is_main), run_dir=tmp_path, meta={}, model=None, vocab=None,
                          schedules=SimpleNamespace(plateau=None), elapsed=lambda: 0.0)
    return run, saved


def test_best_follows_the_runs_own_selection_measure_where_the_measures_disagree(tmp_path, monkeypatch):
    """SAT selects on BLEU-4 (docs/decisions.md, "Flickr8k: which stage ships"), other models on CIDEr-D, and
    ``--select-metric`` on what it names: every other test scored all measures alike, so best/ picked on CIDEr-D
    whatever the run selected by, while its meta still said BLEU-4, went unseen."""
    run, saved = _end_epochs_run(tmp_path, monkeypatch, select="BLEU-4")
    for epoch, (bleu, cider) in enumerate([(0.2, 0.9), (0.3, 0.5), (0.25, 1.2)], 1):
        loop._end_epoch(run, EpochLog(epoch, 10 * epoch, 1e-3, {"xe": 1.0}, {"BLEU-4": bleu, "CIDEr-D": cider}, 0.0))
    assert [(best, by) for name, best, by in saved if name == "best"] == [(1, "BLEU-4"), (2, "BLEU-4")]
    assert (run.progress.best_epoch, run.progress.best_score) == (2, 0.3)


def test_a_rank_that_writes_no_checkpoint_keeps_the_same_best_epoch_and_stops_early_with_rank_0(tmp_path,
                                                                                              monkeypatch):
    """Under torchrun only rank 0 writes best/ and last/, but every rank keeps the best score and epoch: early
    stopping counts from them on each rank, and a rank that counted from epoch 0 stopped while rank 0 trained on
    (its next collective then waited for good)."""
    run, saved = _end_epochs_run(tmp_path, monkeypatch, select="CIDEr-D", is_main=False, early_stop=2)
    stopped = []
    for epoch, score in enumerate([0.5, 0.7, 0.6, 0.6], 1):
        loop._end_epoch(run, EpochLog(epoch, 10 * epoch, 1e-3, {"xe": 1.0}, {"CIDEr-D": score}, 0.0))
        stopped.append(run.progress.stopped_early)
    assert saved == []
    assert (run.progress.best_epoch, run.progress.best_score) == (2, 0.7)
    assert stopped == [False, False, False, True]


def test_an_epochs_history_row_is_its_log_record_without_the_kind(tmp_path, monkeypatch):
    """The history a state and each checkpoint keep (what ``captioner plot`` and the card read) holds the epoch's
    log records as ``metrics.jsonl`` has them, less their ``kind``: only a three-epoch run on the whole data set,
    left out of quick runs, compared the two."""
    run, _ = _end_epochs_run(tmp_path, monkeypatch, select="CIDEr-D")
    loop._end_epoch(run, EpochLog(1, 10, 1e-3, {"xe": 1.0}, {"CIDEr-D": 0.5}, 2.0))
    (logged,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged.pop("kind") == "epoch" and run.progress.history == [logged]


def test_an_epochs_end_prints_its_row_and_hands_the_plateau_this_epochs_score(tmp_path, monkeypatch, capsys):
    """The main rank prints each epoch's row (its scores, losses and rate: all a run says between progress bars), and
    the plateau decay is fed the epoch's own score, not the best so far, which never falls and so would count an
    epoch that scored worse as one that held level (no test ran a plateau through a score that fell)."""
    run, _ = _end_epochs_run(tmp_path, monkeypatch, select="CIDEr-D")
    fed = []
    run.schedules = SimpleNamespace(plateau=SimpleNamespace(update=fed.append))
    for epoch, score in enumerate([0.5, 0.7, 0.6], 1):
        loop._end_epoch(run, EpochLog(epoch, 10 * epoch, 1e-3, {"xe": 1.0}, {"CIDEr-D": score}, 2.0))
    assert fed == [0.5, 0.7, 0.6]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == run.progress.history and [row["epoch"] for row in printed] == [1, 2, 3]
