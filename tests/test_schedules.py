"""Paper schedules against hand-computed values, and the recipes that use them."""

import argparse
import dataclasses
import json
import math
import shlex

import pytest

from captioner.models.cli.training import add_train_config_arguments, train_config_from_args
from captioner.models.training import TrainConfig, available_recipes, load_recipe
from captioner.models.training import recipes as recipes_module
from captioner.models.training.recipes import RECIPES_DIR, command_line, recipe_path
from captioner.models.training.schedules import NoamWarmup, PlateauDecay, ScheduledSampling, StepDecay, \
    build_schedules, learning_rate
from captioner.service.cli import build_parser


def test_step_decay_aoanet_every_3_epochs_by_0_8():
    # AoANet §3.4: 2e-4, ×0.8 every 3 epochs
    decay = StepDecay(2e-4, factor=0.8, every=3)
    expected = [2e-4, 2e-4, 2e-4, 1.6e-4, 1.6e-4, 1.6e-4, 1.28e-4, 1.28e-4, 1.28e-4, 1.024e-4]
    assert [decay(e) for e in range(10)] == pytest.approx(expected, rel=1e-12)


def test_step_decay_sparsecap_constant_then_0_99_per_epoch_and_milestones():
    decay = StepDecay(1e-4, factor=0.99, every=1, start=10)
    assert [decay(e) for e in (0, 9, 10, 11, 12)] == pytest.approx([1e-4, 1e-4, 1e-4, 0.99e-4, 0.9801e-4])
    dropped = StepDecay(3e-3, milestones=(1, 4), milestone_factor=0.5)
    assert [dropped(e) for e in range(6)] == pytest.approx([3e-3, 1.5e-3, 1.5e-3, 1.5e-3, 7.5e-4, 7.5e-4])


def test_noam_warmup_rises_linearly_peaks_then_decays_as_inverse_sqrt():
    noam = NoamWarmup(dim=1024, warmup=10_000)
    # f · d^-1/2 · min(s^-1/2, s · w^-3/2), computed by hand: 1/32 · 1e-6 = 3.125e-8 per warm-up step
    assert noam(1) == pytest.approx(1 / 32 * 10_000 ** -1.5)
    assert noam(5_000) == pytest.approx(5_000 / 32 * 1e-6)
    assert noam(10_000) == pytest.approx(1 / 32 / 100)  # the peak the X-LAN code reaches: 3.125e-4
    assert noam(40_000) == pytest.approx(1 / 32 / 200)  # 4× the steps → half the rate
    assert max(noam(s) for s in range(1, 30_000, 97)) <= noam(10_000)


def test_plateau_decay_halves_after_patience_checks_without_improvement_and_round_trips():
    plateau = PlateauDecay(factor=0.5, patience=3)
    scales = [plateau.update(s) for s in (1.0, 1.2, 1.1, 1.2, 1.15, 1.3, 1.3, 1.3, 1.3, 1.29, 1.3, 1.3)]
    # improvements at 1.0, 1.2, 1.3; then 3 checks without a gain (the equal 1.3s) → ×0.5, 3 more → ×0.25
    assert scales == [1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125]
    copy = PlateauDecay(factor=0.5, patience=3)
    copy.load_state_dict(plateau.state_dict())
    assert (copy.best, copy.bad_checks, copy.scale) == (1.3, 0, 0.125)
    fresh = PlateauDecay()
    fresh.load_state_dict(PlateauDecay().state_dict())  # JSON has no -inf: "no score yet" survives the round trip
    assert fresh.best == -math.inf


def test_plateau_decays_count_of_checks_without_a_gain_survives_a_resume():
    """A state saved after two of three checks without a gain resumes with that count: started again at 0, the
    resumed run waited three more validations for its decay, where the run trained straight decayed at the next."""
    plateau = PlateauDecay(factor=0.5, patience=3)
    for score in (1.0, 0.9, 0.9):
        plateau.update(score)
    resumed = PlateauDecay(factor=0.5, patience=3)
    resumed.load_state_dict(json.loads(json.dumps(plateau.state_dict())))
    assert resumed.bad_checks == 2
    assert resumed.update(0.9) == plateau.update(0.9) == 0.5


def test_a_best_score_of_zero_survives_a_resume():
    """An early validation can score exactly 0 (BLEU-4 before any 4-gram matches): read back as "no score yet", the
    resumed run counted its next 0 as a gain and decayed a validation later than the run trained straight."""
    plateau = PlateauDecay(factor=0.5, patience=2)
    for score in (0.0, 0.0):  # the best is 0, then one check without a gain
        plateau.update(score)
    resumed = PlateauDecay(factor=0.5, patience=2)
    resumed.load_state_dict(json.loads(json.dumps(plateau.state_dict())))
    assert (resumed.best, resumed.bad_checks) == (0.0, 1)
    assert resumed.update(0.0) == plateau.update(0.0) == 0.5


def test_a_plateau_state_without_a_score_yet_is_strict_json():
    """A snapshot before the first validation holds no best score: written as ``-Infinity``, train_state.json was
    no longer JSON to any reader but Python's."""
    assert json.loads(json.dumps(PlateauDecay().state_dict(), allow_nan=False))["best"] is None


def test_plateau_decay_never_goes_below_its_floor_and_a_gain_within_the_threshold_is_no_gain():
    floored = PlateauDecay(factor=0.5, patience=1, min_scale=0.3)
    assert [floored.update(s) for s in (1.0, 0.9, 0.9, 0.9)] == [1, 0.5, 0.3, 0.3]
    strict = PlateauDecay(factor=0.5, patience=1, threshold=0.1)
    assert [strict.update(s) for s in (1.0, 1.05, 1.2)] == [1, 0.5, 0.5]
    assert strict.best == 1.2


def test_scheduled_sampling_plus_0_05_every_5_epochs_capped_at_0_5():
    ss = ScheduledSampling(increase=0.05, every=5, start=0, cap=0.5)
    assert [ss(e) for e in (0, 4, 5, 9, 10, 24, 25, 49, 50, 120)] == pytest.approx(
        [0, 0, 0.05, 0.05, 0.1, 0.2, 0.25, 0.45, 0.5, 0.5])
    late = ScheduledSampling(increase=0.05, every=5, start=6)  # X-LAN's code starts at epoch 6
    assert [late(e) for e in (5, 6, 10, 11)] == pytest.approx([0, 0, 0, 0.05])
    assert ScheduledSampling()(30) == 0.0  # off by default


def test_config_schedules_combine_noam_epoch_decay_and_plateau():
    cfg = TrainConfig(out="x", lr=2e-4, lr_decay_every=3, lr_decay_factor=0.8, plateau_factor=0.5)
    schedules = build_schedules(cfg)
    assert schedules.learning_rate(3, 0) == pytest.approx(1.6e-4)
    for score in (1.0, 0.9, 0.9, 0.9):
        schedules.plateau.update(score)
    assert schedules.learning_rate(3, 0) == pytest.approx(0.8e-4)
    noam = TrainConfig(out="x", warmup_steps=100, noam_dim=64)
    assert learning_rate(noam, epoch=7, global_step=99) == pytest.approx(64 ** -0.5 * 100 ** -0.5)


def test_a_plateau_decay_scales_a_noam_warm_up_too():
    """The plateau's scale multiplies whichever base rate the run has: under a warm-up it was left out, and a run
    with both schedules never slowed down on a plateau."""
    cfg = TrainConfig(out="x", warmup_steps=100, noam_dim=64, plateau_factor=0.5, plateau_patience=1)
    schedules = build_schedules(cfg)
    for score in (1.0, 0.9):
        schedules.plateau.update(score)
    assert schedules.learning_rate(7, 99) == pytest.approx(0.5 * 64 ** -0.5 * 100 ** -0.5)


def test_a_configs_scheduled_sampling_and_noam_factor_reach_the_runs_schedules():
    """Each of --ss-increase, --ss-every, --ss-start, --ss-max and --noam-factor takes effect: X-LAN's sampling from
    epoch 6 (+0.05 every 5 epochs), capped here at 0.1, and a Noam rate twice the paper's."""
    cfg = TrainConfig(out="x", ss_increase=0.05, ss_every=5, ss_start=6, ss_max=0.1, warmup_steps=100, noam_dim=64,
                      noam_factor=2.0)
    schedules = build_schedules(cfg)
    assert [schedules.sampling(e) for e in (5, 10, 11, 16, 40)] == pytest.approx([0, 0, 0.05, 0.1, 0.1])
    assert learning_rate(cfg, epoch=0, global_step=99) == pytest.approx(2 * 64 ** -0.5 * 100 ** -0.5)


def test_a_configs_drop_factor_reaches_its_milestones():
    """--lr-drop-factor is the factor of each --lr-drop: a run asking for ×0.5 got StepDecay's own ×0.1."""
    cfg = TrainConfig(out="x", lr=1e-3, lr_drops=[2], lr_drop_factor=0.5)
    assert [learning_rate(cfg, e) for e in (1, 2, 3)] == pytest.approx([1e-3, 5e-4, 5e-4])


def test_the_sparsecap_recipes_decay_start_reaches_the_runs_schedule():
    """--lr-decay-start (SparseCap §4: "after the 10th epoch, the learning rate starts decaying") reaches the run's
    rate: left out of the schedule, a ``--recipe sparsecap`` run decayed ×0.99 from its first epoch on."""
    cfg = TrainConfig(out="x", **load_recipe("sparsecap"))
    assert cfg.lr_decay_start == 10
    assert [learning_rate(cfg, e) for e in (0, 9, 10, 11, 12)] == pytest.approx([1e-4, 1e-4, 1e-4, 0.99e-4, 0.9801e-4])


def test_the_rate_of_an_epoch_under_a_warm_up_is_its_first_steps_by_default():
    """``learning_rate(cfg, epoch)`` without a step is the rate of optimiser step 1 (global step 0)."""
    cfg = TrainConfig(out="x", warmup_steps=100, noam_dim=64)
    assert learning_rate(cfg, epoch=3) == pytest.approx(NoamWarmup(dim=64, warmup=100)(1))


def test_scheduled_sampling_every_0_epochs_counts_as_every_epoch():
    # the config refuses --ss-every 0; a schedule built in code with it rises each epoch rather than dividing by 0
    assert [ScheduledSampling(increase=0.05, every=0)(e) for e in (0, 1, 3)] == pytest.approx([0, 0.05, 0.15])


def test_the_schedules_are_immutable_values():
    """The epoch, warm-up and sampling schedules are pure functions of where training is: one shared between a run's
    parts cannot be changed by any of them."""
    for schedule in (StepDecay(1e-3), NoamWarmup(dim=64, warmup=10), ScheduledSampling()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            schedule.lr = 0.5


def test_every_recipe_loads_into_a_config_and_states_its_sources():
    assert set(available_recipes()) == {"sat", "sat-hard", "aoanet", "xlan", "xtransformer", "sparsecap",
                                        "area-transformer"}
    for name in available_recipes():
        cfg = TrainConfig(out="x", **load_recipe(name))
        assert cfg.recipe == name and cfg.model == name
        for line in recipe_path(name).read_text().splitlines():
            code = line.split("#")[0].strip()
            if "=" in code and any(ch.isdigit() for ch in code.split("=", 1)[1]):
                assert "#" in line, f"{name}: the number in {line!r} has no source comment"
    aoanet = load_recipe("aoanet")
    assert (aoanet["lr"], aoanet["lr_decay_every"], aoanet["lr_decay_factor"], aoanet["ss_increase"]) == \
        (2e-4, 3, 0.8, 0.05)
    scst = load_recipe("aoanet", "scst")
    assert (scst["lr"], scst["plateau_factor"], scst["phase"]) == (2e-5, 0.5, "scst")
    with pytest.raises(ValueError, match="no \\[scst\\] stage"):
        load_recipe("sparsecap", "scst")
    with pytest.raises(ValueError, match="unknown recipe"):
        load_recipe("nope")


def test_a_recipe_with_a_mistyped_setting_is_refused_naming_it(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('model = "sat"\n[xe]\nlearning_rate = 1e-4\n')
    with pytest.raises(ValueError, match=r"unknown setting\(s\) learning_rate"):
        load_recipe(str(path))


def test_cli_flags_override_single_recipe_values():
    args = build_parser().parse_args(["train", "--recipe", "aoanet", "--out", "x", "--lr", "1e-3", "--set",
                                      "d_model=256", "--ss-every", "1", "--no-progress"])
    cfg = train_config_from_args(args)
    assert (cfg.lr, cfg.ss_every, cfg.lr_decay_every, cfg.label_smoothing) == (1e-3, 1, 3, 0.2)
    assert cfg.model_args == {"d_model": 256} and cfg.progress is False
    plain = train_config_from_args(build_parser().parse_args(["train", "--out", "y"]))
    assert plain == TrainConfig(out="y")  # no recipe, no flags: exactly the dataclass defaults


@pytest.mark.parametrize("argv", [
    ["--recipe", "aoanet", "--out", "runs/a", "--dataset", "d", "--set", "d_model=256", "--ss-every", "1",
     "--encoder", "layer=hypercolumn", "--encoder", "grid_stride=16", "--epochs", "2", "--threads", "1"],
    ["--recipe", "aoanet", "--phase", "scst", "--init", "runs/a/best", "--out", "runs/b", "--scst-baseline", "mean",
     "--lr", "0.0001", "--train-limit", "3000"],
    ["--recipe", "xlan", "--out", "runs/x", "--warmup-steps", "1000", "--group-by-image", "--adam-betas", "0.8", "0.9"],
    ["--model", "sat", "--out", "runs/s", "--lr-drop", "5", "--lr-drop", "7", "--attention", "tvmax", "--no-progress"],
    # values a shell would split: a folder with a space, a JSON list (the card's command is pasted into one)
    ["--model", "sat", "--dataset", "my photos/dataset.json", "--out", "runs/a b", "--set", "sizes=[1, 2]"],
])
def test_the_command_a_card_prints_gives_back_the_same_config(argv):
    def parse(args):
        parser = argparse.ArgumentParser()
        add_train_config_arguments(parser)
        parser.add_argument("--attention")
        return train_config_from_args(parser.parse_args(args))

    cfg = parse(argv)
    command = command_line(cfg.to_json())
    assert command.startswith("captioner train ")
    again = parse(shlex.split(command)[2:])
    assert again.to_json() == {**cfg.to_json(), "progress": True}  # how a run is watched is not part of it


def test_the_command_a_card_prints_names_only_what_differs_from_the_recipe():
    """A card's command is the recipe and the run's overrides: every value the recipe sets, listed again as a flag,
    hid the one change the run made among a dozen that are the paper's."""
    cfg = TrainConfig(out="runs/a", dataset="d", **{**load_recipe("aoanet"), "lr": 1e-3})
    assert command_line(cfg.to_json()) == "captioner train --recipe aoanet --dataset d --out runs/a --lr 0.001"


def test_the_command_a_card_prints_sets_only_the_model_args_the_run_changed_written_as_json():
    """The recipe's own model args (the area Transformer's sizes) are not listed again, and a changed value is
    written as ``--set`` reads it back, in JSON (``true``, not Python's ``True``)."""
    recipe = load_recipe("area-transformer")
    cfg = TrainConfig(out="runs/a", dataset="d", **{**recipe, "model_args": {**recipe["model_args"], "dropout": 0.3,
                                                                              "pre_norm": True}})
    assert command_line(cfg.to_json()) == ("captioner train --recipe area-transformer --dataset d --out runs/a "
                                           "--set dropout=0.3 --set pre_norm=true")


def test_a_recipe_files_phase_key_picks_its_stage_whose_model_args_win_over_the_shared_ones(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('model = "sat"\nphase = "scst"\n[model_args]\ndropout = 0.5\nhidden_dim = 64\n'
                    '[xe]\nlr = 1e-3\n[scst]\nlr = 2e-5\n[scst.model_args]\ndropout = 0.0\n')
    assert load_recipe(str(path)) == {"model": "sat", "lr": 2e-5, "model_args": {"dropout": 0.0, "hidden_dim": 64},
                                      "recipe": str(path), "phase": "scst"}
    assert load_recipe(str(path), "xe")["model_args"] == {"dropout": 0.5, "hidden_dim": 64}
    # a recipe without stage tables: its keys serve every stage
    path.write_text('model = "sat"\nlr = 1e-3\n')
    assert load_recipe(str(path), "scst") == {"model": "sat", "lr": 1e-3, "recipe": str(path), "phase": "scst"}


def test_a_file_in_the_working_folder_named_like_a_recipe_is_not_read_as_it(tmp_path, monkeypatch):
    """Only a ``.toml`` path is a recipe file of one's own: ``--recipe sat`` in a folder holding a file ``sat``
    (a run's log, say) is still the shipped recipe."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sat").write_text("not a recipe")
    assert recipe_path("sat") == RECIPES_DIR / "sat.toml"


def test_a_recipe_files_own_phase_key_only_picks_the_stage_when_none_is_asked_for(tmp_path):
    """``phase = "scst"`` in a recipe file is its default stage: ``--phase xe`` still trains XE, and the config says
    so (were the file's key to win, the XE stage's values would be trained and recorded as an SCST run's)."""
    path = tmp_path / "mine.toml"
    path.write_text('model = "sat"\nphase = "scst"\n[xe]\nlr = 1e-3\n[scst]\nlr = 2e-5\n')
    assert load_recipe(str(path), "xe") == {"model": "sat", "lr": 1e-3, "recipe": str(path), "phase": "xe"}


def test_a_recipe_file_of_ones_own_that_does_not_exist_is_an_unknown_recipe(tmp_path):
    # a mistyped path is a usage error listing the shipped recipes, not an OSError from reading a file that is not there
    with pytest.raises(ValueError, match="unknown recipe .*mine.toml.*; choose from .*aoanet"):
        load_recipe(str(tmp_path / "mine.toml"))


def test_the_command_a_card_prints_leaves_out_how_the_run_was_watched():
    """How often a run logged and saved its state, and whether it drew progress bars, do not change what it trained:
    a card's command lists only what does."""
    cfg = TrainConfig(out="runs/a", dataset="d", log_every=5, checkpoint_every=50, progress=False, lr=1e-3)
    assert command_line(cfg.to_json()) == "captioner train --dataset d --out runs/a --lr 0.001"


def _run_of_its_own_recipe(tmp_path):
    """A run's config from a recipe file of the user's own (not a shipped one) setting two values: (path, config)."""
    path = tmp_path / "mine.toml"
    path.write_text('lr = 2e-3\nepochs = 7\n')
    return path, TrainConfig(out="runs/a", dataset="d", **load_recipe(str(path)))


def test_the_command_of_a_run_whose_own_recipe_file_is_gone_names_every_value_it_set(tmp_path):
    """A card written after the run's own ``.toml`` recipe was moved away cannot say "the recipe, and then these":
    it names no recipe (pasted, the command would fail on it) and lists each value the recipe had set."""
    path, cfg = _run_of_its_own_recipe(tmp_path)
    path.unlink()
    assert command_line(cfg.to_json()) == "captioner train --dataset d --out runs/a --epochs 7 --lr 0.002"


def test_a_recipes_stage_table_wins_over_its_shared_keys(tmp_path):
    # the shared keys serve every stage, and a stage that sets one itself says otherwise for that stage alone
    path = tmp_path / "mine.toml"
    path.write_text('model = "sat"\nlr = 1e-3\nepochs = 20\n[scst]\nlr = 2e-5\n')
    assert load_recipe(str(path), "scst") == {"model": "sat", "lr": 2e-5, "epochs": 20, "recipe": str(path),
                                              "phase": "scst"}


def test_the_command_of_a_run_without_a_recipe_names_its_phase():
    cfg = TrainConfig(out="runs/b", dataset="d", phase="scst")
    assert command_line(cfg.to_json()) == "captioner train --phase scst --dataset d --out runs/b"


def test_a_card_for_a_run_whose_own_recipe_file_cannot_be_read_still_gets_its_command(tmp_path, monkeypatch):
    """A recipe file that is there but cannot be read (no permission, a failing disk) is an OSError: the card still
    names every value the run set, as for a file that is gone, rather than fail to be written."""
    path, cfg = _run_of_its_own_recipe(tmp_path)

    def unreadable(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(recipes_module, "read_text_file", unreadable)
    assert command_line(cfg.to_json()) == "captioner train --dataset d --out runs/a --epochs 7 --lr 0.002"
