"""The training configuration (models/training/config.py): each option's bound refused one step past it and accepted
at it, the intervals as mathematics writes them, lists checked item by item, and saved records read back."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from captioner.models.training.config import BELOW_ONE, NOT_NEGATIVE, POSITIVE, PROBABILITY, Interval, Progress, \
    TrainConfig, check_values

from .conftest import cli_error

#: the least value of each count; 0 where the help says what 0 means ("off", "only at an epoch's end")
LEAST = {"finetune_stages": 0, "epochs": 1, "batch_size": 1, "lr_drops": 1, "lr_decay_every": 0, "lr_decay_start": 0,
         "warmup_steps": 0, "noam_dim": 1, "plateau_patience": 1, "ss_every": 1, "ss_start": 0, "min_count": 1,
         "max_train_len": 1, "max_decode_len": 1, "scst_samples": 1, "val_beam": 1, "val_limit": 1,
         "train_limit": 1, "early_stop": 0, "threads": 1, "max_steps": 1, "checkpoint_every": 0, "log_every": 0}
#: the interval of each number, and a value just inside and just outside each of its ends
WITHIN = {"encoder_lr_factor": "[0, inf)", "lr": "[0, inf)", "adam_betas": "[0, 1)", "adam_eps": "(0, inf)",
          "lr_drop_factor": "(0, inf)", "lr_decay_factor": "(0, inf)", "noam_factor": "(0, inf)",
          "plateau_factor": "[0, 1)", "ss_increase": "[0, 1]", "ss_max": "[0, 1]", "grad_clip": "[0, inf)",
          "label_smoothing": "[0, 1)", "attention_supervision_weight": "[0, inf)"}
ACCEPTED = {"[0, inf)": [0.0, 1e9], "(0, inf)": [1e-12, 1e9], "[0, 1)": [0.0, 0.999], "[0, 1]": [0.0, 1.0]}
REFUSED = {"[0, inf)": [-1e-12, math.inf, math.nan], "(0, inf)": [0.0, math.inf], "[0, 1)": [-1e-12, 1.0],
           "[0, 1]": [-1e-12, 1.0 + 1e-9]}


def _flag(name: str) -> str:
    return {"lr_drops": "--lr-drop", "model_args": "--set"}.get(name, "--" + name.replace("_", "-"))


def _with(name: str, value) -> TrainConfig:
    default = getattr(TrainConfig(out="x"), name)
    return TrainConfig(out="x", **{name: [*default[:1], value] if isinstance(default, list) else value})


@pytest.mark.parametrize("name, least", sorted(LEAST.items()))
def test_each_count_is_refused_one_below_its_least_and_accepted_at_it(name, least):
    check_values(_with(name, least))
    with pytest.raises(ValueError, match=f"^{_flag(name)} must be at least {least}, got {least - 1}$"):
        check_values(_with(name, least - 1))


@pytest.mark.parametrize("name, interval", sorted(WITHIN.items()))
def test_each_number_is_refused_just_outside_its_interval_and_accepted_at_its_ends(name, interval):
    for value in ACCEPTED[interval]:
        check_values(_with(name, value))
    for value in REFUSED[interval]:
        with pytest.raises(ValueError, match=f"^{_flag(name)} must lie in {re.escape(interval)}, got "):
            check_values(_with(name, value))


def test_every_bounded_option_is_listed_here():
    bounded = {field.name for field in dataclasses.fields(TrainConfig)
               if "least" in field.metadata or "within" in field.metadata}
    assert bounded == set(LEAST) | set(WITHIN)


def test_the_intervals_are_written_and_hold_as_mathematics_writes_them():
    assert [str(i) for i in (POSITIVE, NOT_NEGATIVE, PROBABILITY, BELOW_ONE)] == \
        ["(0, inf)", "[0, inf)", "[0, 1]", "[0, 1)"]
    closed, open_ = Interval(-1.5, 2.0, low_open=False, high_open=False), Interval(-1.5, 2.0, True, True)
    assert (str(closed), str(open_)) == ("[-1.5, 2]", "(-1.5, 2)")
    assert [closed.holds(v) for v in (-1.5, 2.0, -1.6, 2.1, math.nan)] == [True, True, False, False, False]
    assert [open_.holds(v) for v in (-1.5, 2.0, -1.4, 1.9)] == [False, False, True, True]


def test_none_and_booleans_are_not_counted_and_every_item_of_a_list_is_checked():
    check_values(TrainConfig(out="x", val_limit=None, max_steps=None, progress=False, group_by_image=True))
    with pytest.raises(ValueError, match=r"^--adam-betas must lie in \[0, 1\), got 1.0$"):
        check_values(TrainConfig(out="x", adam_betas=[0.9, 1.0]))
    with pytest.raises(ValueError, match="^--lr-drop must be at least 1, got 0$"):
        check_values(TrainConfig(out="x", lr_drops=[3, 5, 0]))
    # the first item too, not only the last
    with pytest.raises(ValueError, match="^--lr-drop must be at least 1, got 0$"):
        check_values(TrainConfig(out="x", lr_drops=[0, 3]))
    with pytest.raises(ValueError, match=r"^--adam-betas must lie in \[0, 1\), got -0.5$"):
        check_values(TrainConfig(out="x", adam_betas=[-0.5, 0.999]))


def test_a_saved_record_reads_back_with_later_fields_defaulted_and_unknown_ones_dropped():
    cfg = TrainConfig(out="runs/a", lr=1e-3, lr_drops=[4], precision="bf16")
    assert cfg.precision == "bfloat16"  # a saved run's old name reads as today's
    assert TrainConfig.from_json({**cfg.to_json(), "retired_option": 1}) == cfg
    saved = {k: v for k, v in cfg.to_json().items() if k != "log_every"}  # written before the option existed
    assert TrainConfig.from_json(saved).log_every == TrainConfig(out="x").log_every
    progress = Progress.from_json({"epoch": 3, "global_step": 30, "gone": True})
    assert progress == Progress(epoch=3, global_step=30) and progress.to_json()["history"] == []


def test_the_command_asks_for_out(capsys):
    assert "the following arguments are required: --out" in cli_error(capsys, "train", "--epochs", "1")


def test_flags_are_off_unless_given_and_the_encoder_stays_frozen_by_default():
    # a flag that only turns a setting on (kind "true") could never turn it off again were it on by default
    cfg = TrainConfig(out="x")
    for field in dataclasses.fields(TrainConfig):
        if field.metadata.get("kind") in ("true", "false"):
            assert getattr(cfg, field.name) is (field.metadata["kind"] == "false"), field.name
    # README: images are encoded once by the frozen backbone; --finetune-stages at 0.25 of the rate by default
    assert (cfg.finetune_stages, cfg.encoder_lr_factor) == (0, 0.25)


def test_a_new_runs_first_validation_is_its_best_whatever_it_scores():
    # a first short epoch often scores a BLEU-4 or CIDEr-D of 0: it must still write best/ (a score beats the best
    # only when above it), so a new run's best starts below every score
    assert Progress().best_score < 0.0 and Progress.from_json({}).best_score < 0.0


def test_the_documented_lengths_beam_and_sample_count_are_the_defaults():
    # docs/decisions.md: training captions are cut to 16 words and decoding allows 20 steps ("Tokenizer and caption
    # length"), the runs log validation scores of greedy decoding ("The default checkpoint"); README: SCST samples 5
    # captions per image by default. No recipe restates them.
    cfg = TrainConfig(out="x")
    assert (cfg.max_train_len, cfg.max_decode_len, cfg.val_beam, cfg.scst_samples) == (16, 20, 1, 5)


def test_the_techniques_a_recipe_turns_on_are_off_by_default():
    """A recipe states only what its paper does (the SAT recipe says nothing of scheduled sampling, label smoothing,
    warm-up or decays), so each must be off unless a recipe or a flag turns it on; docs/decisions.md: the learning
    rate is "constant by default", and each `--lr-drop` multiplies it by `--lr-drop-factor` (0.1)."""
    cfg = TrainConfig(out="x")
    assert (cfg.ss_increase, cfg.label_smoothing, cfg.plateau_factor, cfg.warmup_steps, cfg.lr_decay_every,
            cfg.early_stop, cfg.lr_drops, cfg.attention_supervision) == (0.0, 0.0, 0.0, 0, 0, 0, [], None)
    assert cfg.lr_drop_factor == 0.1 and 0.0 < cfg.lr_decay_factor < 1.0  # a drop and a decay shrink the rate
    assert cfg.noam_factor == 1.0  # --warmup-steps alone: Vaswani et al.'s Eq. 3, which has no factor


def test_the_documented_vocabulary_scst_optimiser_and_supervision_defaults():
    """docs/decisions.md: words are kept "if they occur at least `--min-count` times (default 1 for the small scene
    vocabulary)", and gradients are clipped "by global norm" where the authors' code does not clip by value; README:
    SCST takes "the greedy caption's CIDEr-D as baseline" (`--scst-baseline mean` is the other), `--encoder-lr-factor`
    0.25 is "1e-4 against 4e-4" of the decoder's Adam, and `--attention-supervision-weight` is 1 by default.
    Each default is what `captioner train` does without a recipe (the default model, SAT, trained with Adam)."""
    cfg = TrainConfig(out="x")
    assert (cfg.min_count, cfg.scst_baseline, cfg.grad_clip_mode) == (1, "greedy", "norm")
    # and clipped at all: at the 5.0 the SAT recipe restates (0 turns clipping off, and a plain run, which names no
    # recipe, would then train unclipped, the norm mode above bound to nothing)
    assert cfg.grad_clip == 5.0
    assert (cfg.optimizer, cfg.lr, cfg.attention_supervision_weight) == ("adam", 4e-4, 1.0)
    assert cfg.augment == "none"  # README: mirror images are what `--augment hflip` asks for


def test_a_new_runs_progress_starts_at_its_first_step_with_no_time_trained():
    # fit() trains from progress.step_in_epoch, and the run's clock (its card's training time) adds
    # progress.train_seconds to this session's: a new run must skip no step and count no time it did not train
    progress = Progress()
    assert (progress.epoch, progress.step_in_epoch, progress.global_step) == (0, 0, 0)
    assert progress.train_seconds == 0.0 and progress.history == [] and not progress.stopped_early


def test_a_plain_run_trains_cross_entropy_and_the_recipes_sampling_and_decay_numbers_are_the_defaults():
    """README: SCST starts from a cross-entropy checkpoint (`--phase scst --init runs/xe/best`), so a run that names
    no phase trains XE. docs/decisions.md ("Paper recipes"): scheduled sampling is "capped at 0.5 (both codes)", the
    periodic decay is AoANet's ×0.8 and a plateau waits 3 validations (the X-LAN code); both recipes raise the sampling
    probability every 5 epochs (AoANet §3.4, X-LAN's INC_EVERY_EPOCH). A run that turns these on by flag alone gets
    the authors' numbers."""
    cfg = TrainConfig(out="x")
    assert cfg.phase == "xe"
    assert (cfg.ss_max, cfg.ss_every, cfg.lr_decay_factor, cfg.plateau_patience) == (0.5, 5, 0.8, 3)


@pytest.mark.parametrize("name, value, problem", [
    ("epochs", False, "must be a whole number, got false"),  # False counts as 0: a run that trains nothing
    ("epochs", "10", 'must be a whole number, got "10"'),
    ("epochs", 10.0, "must be a whole number, got 10.0"),
    ("lr", "4e-4", 'must be a number, got "4e-4"'),
    ("lr", True, "must be a number, got true"),
    ("group_by_image", 1, "must be true or false, got 1"),
    ("optimizer", 3, "must be text, got 3"),
    ("val_limit", "5", 'must be a whole number, got "5"'),
    ("model_args", [1], "must be a table, got [1]"),
    ("adam_betas", [0.9, "0.999"], 'must be a list, each item a number, got [0.9, "0.999"]'),
    ("lr_drops", 3, "must be a list, each item a whole number, got 3"),
    # no value where the field has no "none" (a saved config's `"epochs": null`, a caller's None): the bounds skip
    # None, so only the type check names it before any work
    ("epochs", None, "must be a whole number, got null"),
    ("optimizer", None, "must be text, got null"),
])
def test_a_value_not_of_its_fields_type_is_refused_as_a_recipe_writes_it(name, value, problem):
    """A recipe's TOML values reach the config unchecked by argparse: a string where a number belongs was a
    TypeError traceback from the bounds' comparison, and ``epochs = false`` passed as a run of no epochs."""
    with pytest.raises(ValueError, match=f"^{_flag(name)} {re.escape(problem)}$"):
        check_values(TrainConfig(out="x", **{name: value}))


def test_values_of_the_types_a_caller_in_code_hands_over_are_accepted(tmp_path):
    # a whole number for a rate (TOML's `lr = 1`), a path for a folder, tuples for lists, no value for an optional
    check_values(TrainConfig(out=tmp_path, dataset=tmp_path / "data", lr=1, adam_betas=(0.9, 0.98), lr_drops=(3, 5),
                             val_limit=None, model_args={"hidden": 8}))
    with pytest.raises(ValueError, match="^--lr-drop must be at least 1, got 0$"):  # a tuple's items are bounded too
        check_values(TrainConfig(out="x", lr_drops=(3, 0)))


def test_a_recipe_with_a_value_of_the_wrong_type_is_a_usage_error_before_anything_is_written(capsys, tmp_path):
    recipe = tmp_path / "mine.toml"
    recipe.write_text('epochs = "ten"\n')
    said = cli_error(capsys, "train", "--recipe", str(recipe), "--dataset", str(tmp_path), "--out",
                     str(tmp_path / "run"))
    assert said.endswith('error: --epochs must be a whole number, got "ten"') and not (tmp_path / "run").exists()
