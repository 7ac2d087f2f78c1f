"""What a user meets at `captioner train`, `eval` and `tune-decoding`: nonsense numbers, foreign `--out` folders,
logs of killed starts, Ctrl-C before training, malformed data sets; and at the commands that write checkpoints,
figures and reports over what is already there (docs/decisions.md, "Training and evaluation commands, audited")."""

import json
import os
import shutil
import signal
import threading

import numpy as np
import pytest
import torch

from captioner.models import training
from captioner.models.checkpoint import load_checkpoint, recorded_checksum, save_checkpoint
from captioner.models.data.datasets import load_captioned
from captioner.models.data.features import extract_features, find_covering_store, photo_file_bytes
from captioner.models.data.karpathy import load_karpathy
from captioner.models.data.scenes import generate
from captioner.models.encoder import EncoderSpec
from captioner.models.protocol import AttnRecord, Captioner
from captioner.models.registry import MODELS
from captioner.models.sat import ShowAttendTell
from captioner.models.sparsecap import SparseCap
from captioner.models.training import TrainConfig, TrainingInterrupted, fit, loop, prepare_run, train
from captioner.models.training.config import Progress
from captioner.models.training.distributed import DistContext
from captioner.models.training.resume import read_from, restore
from captioner.service.cli import main

from .conftest import DEFAULT_CHECKPOINT, ROOT, before_each_step, saved_linear_run
from .serving_helpers import TINY_SPEC, VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(embed_dim=16, hidden_dim=24, attn_dim=16, dropout=0.0)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("features")


def _config(scenes, out, cache, **overrides):
    cfg = dict(dataset=str(scenes), out=str(out), model_args=SMALL, cache_dir=str(cache), epochs=1, batch_size=8,
               progress=False, encoder={"image_size": 96}, train_limit=8, val_limit=2, threads=1)
    cfg.update(overrides)
    return TrainConfig(**cfg)


def _argv(scenes, out, cache, *extra):
    return ["train", "--dataset", str(scenes), "--out", str(out), "--cache-dir", str(cache), "--encoder",
            "image_size=96", "--set", "embed_dim=16", "--set", "hidden_dim=24", "--set", "attn_dim=16",
            "--train-limit", "8", "--val-limit", "2", "--threads", "1", "--no-progress", *extra]


def _main(argv) -> None:
    main(argv)


def _fails(capsys, argv, status=2) -> str:
    with pytest.raises(SystemExit) as stopped:
        _main(argv)
    assert stopped.value.code == status, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


def test_nonsense_counts_are_usage_errors_before_any_work(scenes, tmp_path, cache, capsys):
    # before: --batch-size 0 was a ZeroDivisionError, -3 and --epochs 0 "succeeded" with an untrained or no model,
    # --max-steps 0 trained everything, --val-beam / --max-decode-len 0 failed in the first validation
    for option, value in [("--epochs", "0"), ("--epochs", "-1"), ("--batch-size", "0"), ("--batch-size", "-3"),
                          ("--val-beam", "0"), ("--max-decode-len", "0"), ("--max-steps", "0"),
                          ("--scst-samples", "0"), ("--checkpoint-every", "-1")]:
        err = _fails(capsys, _argv(scenes, tmp_path / "run", cache, option, value))
        assert f"argument {option}: must be at least" in err, (option, err)
    # numbers outside what they mean: a negative clip trained the model backwards (its loss rose, exit 0), label
    # smoothing of 2 or a probability of 2 trained on nonsense, --lr -1 was refused by the optimiser only after
    # every photo had been encoded
    for option, value, said in [("--grad-clip", "-5", "must lie in [0, inf)"), ("--label-smoothing", "2",
                                "must lie in [0, 1)"), ("--ss-increase", "2", "must lie in [0, 1]"),
                                ("--lr", "-1", "must lie in [0, inf)"), ("--lr", "nan", "must lie in [0, inf)"),
                                ("--adam-eps", "0", "must lie in (0, inf)"), ("--lr-drop", "-1", "must be at least 1"),
                                ("--adam-betas", "0.9 1.5", "must lie in [0, 1)"), ("--lr", "fast", "not a number")]:
        err = _fails(capsys, _argv(scenes, tmp_path / "run", cache, option, *value.split()))
        assert f"argument {option}: " in err and said in err, (option, err)
    assert not (tmp_path / "run").exists()
    # the same bounds hold for configs made in code or by a recipe, checked before the data is read
    with pytest.raises(ValueError, match=r"--grad-clip must lie in \[0, inf\), got -1"):
        train(_config(scenes, tmp_path / "coded", cache, grad_clip=-1.0))
    with pytest.raises(ValueError, match=r"--lr-drop must be at least 1, got 0"):
        train(_config(scenes, tmp_path / "coded", cache, lr_drops=[3, 0]))
    with pytest.raises(ValueError, match="--batch-size must be at least 1, got 0"):
        train(_config(scenes, tmp_path / "coded", cache, batch_size=0))
    with pytest.raises(ValueError, match="--scst-samples 2 or more"):
        train(_config(scenes, tmp_path / "coded", cache, phase="scst", init=str(DEFAULT_CHECKPOINT),
                      scst_baseline="mean", scst_samples=1, encoder={}))
    assert not (tmp_path / "coded").exists()


def test_a_model_or_option_that_cannot_be_trained_is_refused_before_the_data_is_read(scenes, tmp_path, capsys,
                                                                                     monkeypatch):
    """An unknown model or option failed after the features were extracted, a model without config() after its
    first epoch (at the save): each is a one-line error before any data is read."""
    def never(*args, **kwargs):
        raise AssertionError("the data was read")

    monkeypatch.setattr(training.loop, "load_captioned", never)
    cache = tmp_path / "cache"
    assert "unknown model 'nope'" in _fails(capsys, _argv(scenes, tmp_path / "a", cache, "--model", "nope"))
    assert "has no option 'hiden_dim'" in _fails(capsys, _argv(scenes, tmp_path / "b", cache, "--set", "hiden_dim=8"))

    class Forgetful(ShowAttendTell):  # a model whose config() forgets an argument
        def config(self):
            return {k: v for k, v in super().config().items() if k != "hidden_dim"}

    monkeypatch.setitem(MODELS, "forgetful", Forgetful)
    err = _fails(capsys, _argv(scenes, tmp_path / "c", cache, "--model", "forgetful"))
    assert "config() must return every constructor argument" in err

    class Unshaped(SparseCap):  # forgets an argument that changes no shape: its checkpoints would reload as softmax
        def config(self):
            return {k: v for k, v in super().config().items() if k != "attention"}

    monkeypatch.setitem(MODELS, "unshaped", Unshaped)
    err = _fails(capsys, _argv(scenes, tmp_path / "d", cache, "--model", "unshaped", "--attention", "sparsemax"))
    assert "config() must return every constructor argument" in err
    assert "an ensemble is not trained" in _fails(capsys, _argv(scenes, tmp_path / "e", cache, "--model", "ensemble"))
    assert not cache.exists()


def test_an_unknown_phase_or_fine_tuned_stages_over_region_features_are_refused_before_the_data_is_read(
        scenes, tmp_path, cache, monkeypatch):
    """A library caller's unknown phase failed as a ``KeyError`` once the features were extracted (the command line's
    choices never let one through), and ``--finetune-stages`` over region features, which have no grid encoder to
    tune, went on to read the data: both are refused by name first."""
    def never(*args, **kwargs):
        raise AssertionError("the data was read")

    monkeypatch.setattr(training.loop, "load_captioned", never)
    with pytest.raises(ValueError, match="unknown phase 'nope'; choose from scst, xe"):
        prepare_run(_config(scenes, tmp_path / "a", cache, phase="nope"))
    with pytest.raises(ValueError, match="--finetune-stages fine-tunes the grid encoder"):
        prepare_run(_config(scenes, tmp_path / "b", cache, finetune_stages=1, features="regions:/nowhere"))


def test_a_model_that_breaks_the_protocol_is_named_before_the_data_is_read(scenes, tmp_path, capsys, monkeypatch):
    """What a researcher adding a model meets (README, "Adding a model"): each of these trained, then failed with a
    Python error that named no rule: at the first load (no **ids), in reorder after an epoch (a state that is no
    tensor with rows), at the first save (no config() of its own: the protocol's raises NotImplementedError), or
    never (attention rows that are no distribution, served as they were)."""
    monkeypatch.setattr(training.loop, "load_captioned", lambda *a, **k: pytest.fail("the data was read"))

    class NoIds(ShowAttendTell):
        def __init__(self, vocab_size, feat_dim, embed_dim=16, hidden_dim=24, attn_dim=16, dropout=0.0):
            super().__init__(vocab_size, feat_dim, embed_dim, hidden_dim, attn_dim, dropout=dropout)

    class BareTensor(ShowAttendTell):
        def step(self, prev_tokens, state, enc):
            logprobs, state, attention = super().step(prev_tokens, state, enc)
            return logprobs, state, attention.primary

    class CountsInState(ShowAttendTell):
        def step(self, prev_tokens, state, enc):
            logprobs, state, attention = super().step(prev_tokens, state, enc)
            return logprobs, {**state, "steps": 1}, attention

    class OnesForRows(ShowAttendTell):
        def step(self, prev_tokens, state, enc):
            logprobs, state, attention = super().step(prev_tokens, state, enc)
            return logprobs, state, AttnRecord(torch.ones_like(attention.primary))

    class UniformOverPadding(ShowAttendTell):  # "uniform for a model that attends to nothing", padding included
        def step(self, prev_tokens, state, enc):
            logprobs, state, attention = super().step(prev_tokens, state, enc)
            return logprobs, state, AttnRecord(torch.full_like(attention.primary, 1 / attention.primary.shape[1]))

    class NoSizes(ShowAttendTell):
        def config(self):
            return {k: v for k, v in super().config().items() if k not in ("vocab_size", "feat_dim")}

    class NoConfig(ShowAttendTell):  # the protocol's own config(), as a model that never wrote one has
        config = Captioner.config

    for model, said in [(NoIds, "constructor must accept **ids"), (BareTensor, "must be an AttnRecord"),
                        (CountsInState, "step's state 'steps' must be a tensor with the (batch × beam) rows"),
                        (OnesForRows, "must be a distribution over the items"),
                        (UniformOverPadding, "must put no weight on masked items"),
                        (NoSizes, "config() must return every constructor argument"),
                        (NoConfig, "does not implement config()")]:
        monkeypatch.setitem(MODELS, "broken", model)
        err = _fails(capsys, ["train", "--dataset", str(scenes), "--out", str(tmp_path / "run"), "--model", "broken",
                              *(["--set", "embed_dim=16"] if model is not NoIds else [])])
        assert said in err and "models/protocol.py" in err, (model.__name__, err)
    assert not (tmp_path / "run").exists()


def test_the_protocol_probe_builds_the_model_with_the_vocabularys_own_special_ids(scenes, tmp_path, cache,
                                                                                  monkeypatch):
    """The probe before the data is read builds the model with the special ids training and every load hand it (the
    vocabulary's, which a checkpoint's ``special_ids`` records): probed with other ids (``bos_id`` equal to
    ``eos_id``, say) it checked a model that no run builds, and refused one whose constructor checks its ids."""
    built, create = [], loop.create

    def recording(name, **kwargs):
        built.append({key: kwargs[key] for key in ("pad_id", "bos_id", "eos_id") if key in kwargs})
        return create(name, **kwargs)

    monkeypatch.setattr(loop, "create", recording)
    loop._check_model(_config(scenes, tmp_path / "run", cache, model="sat"))
    vocabulary = {"pad_id": VOCAB.pad_id, "bos_id": VOCAB.bos_id, "eos_id": VOCAB.eos_id}
    assert vocabulary == {"pad_id": 0, "bos_id": 1, "eos_id": 2}
    probes = [ids for ids in built if ids]
    assert probes and all(ids == vocabulary for ids in probes), built


def test_extend_vocab_without_init_is_refused_before_the_data_is_read(scenes, tmp_path, cache, monkeypatch):
    """``--extend-vocab`` adds the data's new words to ``--init``'s vocabulary: without ``--init`` there is none to
    extend, and the run is refused by name before any data is read (only the warm start that extends had a test)."""
    monkeypatch.setattr(training.loop, "load_captioned", lambda *a, **k: pytest.fail("the data was read"))
    with pytest.raises(ValueError, match="--extend-vocab adds the data's new words to the vocabulary of --init"):
        prepare_run(_config(scenes, tmp_path / "run", cache, extend_vocab=True))


def test_a_model_option_of_the_wrong_kind_or_size_is_named(scenes, tmp_path, cache, capsys):
    # --set hidden_dim=abc was a TypeError traceback (exit 1), then PyTorch's words ("must be tuple of ints");
    # -5 blamed the model's code for reading tensor values
    for setting, said in [("hidden_dim=abc", "model 'sat': option 'hidden_dim' takes a whole number (default 1024), "
                                             "got 'abc'"),
                          ("dropout=abc", "model 'sat': option 'dropout' takes a number (default 0.5), got 'abc'"),
                          ("hidden_dim=-5", "negative dimension")]:
        err = _fails(capsys, _argv(scenes, tmp_path / "run", cache, "--set", setting))
        assert said in err and "meta device" not in err, (setting, err)
        assert ("--set hidden_dim=-5" in err) == (setting == "hidden_dim=-5")  # a size error quotes the settings
    assert not (tmp_path / "run").exists()


def test_out_that_holds_something_else_is_refused_before_training(scenes, tmp_path, cache, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert "is a file" in _fails(capsys, _argv(scenes, a_file, cache))
    assert a_file.read_text() == "mine"
    # a checkpoint folder given as --out (runs/sat/best for runs/sat) is not filled with a run
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    assert "is a checkpoint folder" in _fails(capsys, _argv(scenes, checkpoint, cache))
    assert sorted(p.name for p in checkpoint.iterdir()) == ["config.json"]
    # a best/ that is no checkpoint was refused only at the end of the first epoch, after the training
    foreign = tmp_path / "foreign"
    (foreign / "best").mkdir(parents=True)
    (foreign / "best" / "notes.txt").write_text("mine")
    assert "not a checkpoint folder" in _fails(capsys, _argv(scenes, foreign, cache))
    assert sorted(p.name for p in foreign.iterdir()) == ["best"]
    # a metrics.jsonl that is no run's log would have been appended to, and cut to nothing by a --resume
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("mine\n")
    assert "not a training log" in _fails(capsys, _argv(scenes, other, cache))
    assert (other / "metrics.jsonl").read_text() == "mine\n" and len(list(other.iterdir())) == 1


def test_a_trained_model_without_its_run_state_is_never_trained_over(scenes, tmp_path, cache, capsys):
    """A folder whose best/ (or last/) holds a checkpoint but which has no state to resume (a finished run whose
    train_state.* was removed, a checkpoint copied into best/): a new run replaced the model, its card and its log
    at its first validation, saying the folder held "a start that stopped before its first snapshot"."""
    for name in ("best", "last"):
        out = tmp_path / name
        shutil.copytree(DEFAULT_CHECKPOINT, out / name)
        (out / "metrics.jsonl").write_text(json.dumps({"kind": "epoch", "epoch": 1}) + "\n")
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        err = _fails(capsys, _argv(scenes, out, cache))
        assert f"holds a trained model ({name}/)" in err and "nothing was overwritten" in err, err
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_resume_where_there_is_no_run_is_an_error(scenes, tmp_path, cache, capsys):
    # a mistyped --out with --resume started a new run there (or failed on the default --dataset's scenes)
    for out in (tmp_path / "typo", tmp_path):
        err = _fails(capsys, _argv(scenes, out, cache, "--resume"))
        assert f"nothing to resume in {out}" in err and "drop --resume" in err, err
    assert not (tmp_path / "typo").exists()


def test_a_start_killed_before_its_first_snapshot_is_not_logged_twice(scenes, tmp_path, cache, capsys):
    out = tmp_path / "run"
    out.mkdir()
    # what `kill -9` leaves before the first --checkpoint-every snapshot: step records, a torn line, no state
    steps = [{"kind": "step", "epoch": 1, "step": n, "lr": 4e-4, "xe": 4.0} for n in (1, 2, 3)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps) + '{"kind": "st')
    train(_config(scenes, out, cache, log_every=1, max_steps=4))
    assert "starts afresh" in capsys.readouterr().out
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "step"] == [1, 2, 3, 4]  # was 1, 2, 3, 1, 2, 3, 4


def test_ctrl_c_while_the_run_is_prepared_is_one_line(scenes, tmp_path, cache, capsys, monkeypatch):
    def encoding_features(*args, **kwargs):
        raise KeyboardInterrupt  # what Ctrl-C raises while the frozen CNN encodes the photos

    monkeypatch.setattr(loop, "prepare_run", encoding_features)
    err = _fails(capsys, _argv(scenes, tmp_path / "run", cache), status=130)
    assert "interrupted before the first step" in err and "cached" in err
    assert not (tmp_path / "run").exists()


def test_a_kill_while_the_run_is_prepared_is_one_line_and_leaves_no_folder(scenes, tmp_path, cache, capsys,
                                                                           monkeypatch):
    # SIGTERM's default ended the process mid-extraction: no word, and an empty --out folder left behind
    def killed_while_encoding(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)

    def default(signum, frame):  # stands in for the default, which would end pytest itself
        raise RuntimeError("SIGTERM met the default handling")

    monkeypatch.setattr(loop, "open_feature_store", killed_while_encoding)  # the run's folder exists by then
    previous = signal.signal(signal.SIGTERM, default)
    try:
        err = _fails(capsys, _argv(scenes, tmp_path / "run", cache), status=130)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "interrupted before the first step" in err and not (tmp_path / "run").exists()


def test_malformed_karpathy_entries_are_named(tmp_path, capsys):
    for name, images in [("nosplit", [{"filename": "a.jpg", "sentences": []}]),
                         ("nosentences", [{"filename": "a.jpg", "split": "train"}]),
                         ("strings", [{"filename": "a.jpg", "split": "train", "sentences": ["a cat"]}]),
                         ("notalist", {"a.jpg": 1})]:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"images": images}))
        err = _fails(capsys, ["train", "--dataset", str(path), "--out", str(tmp_path / "run")])
        assert str(path) in err and ("image 0 is not a Karpathy-split entry" in err or "no 'images' list" in err), err
    assert not (tmp_path / "run").exists()
    # a photo listed twice: in two splits a test photo was trained on, in one it counted twice (the Flickr8k
    # loader refused both; the Karpathy one took them)
    for name, second in [("leak", "test"), ("twice", "train")]:
        path = tmp_path / f"{name}.json"
        entries = [{"filename": "a.jpg", "split": "train", "sentences": [{"raw": "a cat"}], "imgid": 0},
                   {"filename": "a.jpg", "split": second, "sentences": [{"raw": "a dog"}], "imgid": 1}]
        path.write_text(json.dumps({"images": entries}))
        err = _fails(capsys, ["train", "--dataset", str(path), "--out", str(tmp_path / "run")])
        assert "images 0 and 1 are the same photo" in err and "a.jpg" in err, err


def test_evaluation_options_are_checked_before_the_captioning(tmp_path, capsys):
    ckpt = str(DEFAULT_CHECKPOINT)
    err = _fails(capsys, ["tune-decoding", ckpt, "--length-penalties", "0", "9"])
    assert "length_penalty must lie in [0, 5], got 9.0" in err
    assert "does not exist" in _fails(capsys, ["tune-decoding", ckpt, "--output", str(tmp_path / "no" / "x.json")])
    assert "is a folder" in _fails(capsys, ["eval", ckpt, "--output", str(tmp_path)])
    assert "does not exist" in _fails(capsys, ["eval", ckpt, "--results-json", str(tmp_path / "no" / "r.json")])
    # a training run's folder where a checkpoint is wanted names the checkpoints it holds
    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    (run / "best" / "config.json").write_text("{}")
    assert f"give {run / 'best'}" in _fails(capsys, ["eval", str(run), "--dataset", str(tmp_path)])


def test_a_data_set_regenerated_in_place_is_encoded_again(tmp_path):
    spec, sizes = EncoderSpec(image_size=64), {"train": 3, "val": 1, "test": 0, "heldout": 0}
    generate(tmp_path / "scenes", sizes, seed=0, progress=False)
    images = load_captioned(tmp_path / "scenes", None, ("train",))
    before = extract_features(images, spec, tmp_path / "cache", progress=False)
    old = before.get([im.key for im in images]).numpy()
    everything = extract_features(load_captioned(tmp_path / "scenes"), spec, tmp_path / "cache", progress=False)
    # `captioner data generate` into the same folder with another seed: the same paths, other photos
    generate(tmp_path / "scenes", sizes, seed=1, progress=False)
    images = load_captioned(tmp_path / "scenes", None, ("train",))
    keys = [im.key for im in images]
    assert find_covering_store(tmp_path / "cache", spec, keys,
                               sizes=photo_file_bytes(images)) is None  # `everything` is stale too
    after = extract_features(images, spec, tmp_path / "cache", progress=False)
    assert after.folder == before.folder  # its own folder, encoded again (it served the old photos' features)
    assert not np.array_equal(after.get(keys).numpy(), old)
    assert everything.folder != after.folder
    assert extract_features(images, spec, tmp_path / "cache", progress=False, encoder=object()).folder == after.folder


def test_commands_never_write_over_a_checkpoint_or_their_own_input_unasked(tmp_path, capsys):
    trained = save_checkpoint(tmp_path / "trained", tiny_model("sat"), VOCAB, TINY_SPEC)
    other = save_checkpoint(tmp_path / "other", tiny_model("sparsecap"), VOCAB, TINY_SPEC)
    for argv in (["storage", str(trained), "float16", "--out", str(other)],
                 ["ensemble", str(other), str(trained), str(trained)]):
        err = _fails(capsys, argv)
        assert "already exists" in err and "pass --force" in err, argv
        assert load_checkpoint(other).model.arch == "sparsecap", argv  # untouched
    _main(["storage", str(trained), "float16", "--out", str(other), "--force"])
    assert load_checkpoint(other).storage == "float16"
    photo = tmp_path / "photo.png"
    photo.write_bytes(b"not read: the refusal comes first")
    assert "one of the command's inputs" in _fails(capsys, ["caption", str(photo), "--overlay", str(photo)])
    results = tmp_path / "captions.json"
    results.write_text("[]")
    assert "one of the command's inputs" in _fails(capsys, ["compare", str(results), str(results), "--output",
                                                            str(results)])
    assert results.read_text() == "[]"
    assert "give a picture's file name" in _fails(capsys, ["caption", str(photo), "--overlay",
                                                           str(tmp_path / "f.txt2")])


def test_a_split_the_data_set_does_not_have_is_an_error(scenes, tmp_path, capsys):
    err = _fails(capsys, ["data", "features", "--dataset", str(scenes), "--split", "nosuch", "--cache-dir",
                          str(tmp_path)])
    assert "no images in split 'nosuch'" in err


def test_a_run_resumes_from_another_folder(scenes, tmp_path, monkeypatch, capsys):
    # its relative --dataset and --cache-dir were read from the new folder: "dataset scenes/... does not exist"
    started, elsewhere = tmp_path / "started", tmp_path / "elsewhere"
    started.mkdir()
    elsewhere.mkdir()
    (started / "data").symlink_to(scenes.parent)
    monkeypatch.chdir(started)
    train(_config("data", "run", "cache", epochs=2, max_steps=1))
    monkeypatch.chdir(elsewhere)
    train(_config(".cache/scenes", started / "run", "cache", epochs=2), resume=True,
          explicit={"out", "epochs"})
    assert "its relative paths are read from there" in capsys.readouterr().out
    state = json.loads((started / "run" / "train_state.json").read_text())
    assert state["progress"]["epoch"] == 2 and not (elsewhere / "cache").exists()
    # the photos named by other strings (data/… then /…/started/data/…) were encoded again into a second store
    assert len(list((started / "cache").glob("*/index.json"))) == 1
    assert state["working_dir"] == str(started)  # the folder it was started in, not the last resume's


def test_a_resume_reads_the_runs_relative_paths_from_its_folder_and_only_from_another(tmp_path, monkeypatch, capsys):
    """``regions:DIR`` and ``entities:DIR`` name a folder after its kind: the folder is read from where the run was
    started, the kind kept; an absolute path stays.  Resumed in that folder, the config is the run's as saved, and
    nothing is said (rewritten there, its paths became absolute and the line claimed a move that never happened)."""
    started = tmp_path / "started"
    config = {"dataset": "data/dataset.json", "cache_dir": str(tmp_path / "cache"), "init": None, "lr": 1e-3,
              "features": "regions:boxes", "attention_supervision": "entities:entities"}
    saved = {"working_dir": str(started), "config": config}
    monkeypatch.chdir(tmp_path)
    assert read_from(saved, announce=True) == {
        **config, "dataset": str(started / "data" / "dataset.json"), "features": f"regions:{started / 'boxes'}",
        "attention_supervision": f"entities:{started / 'entities'}"}
    assert "its relative paths are read from there" in capsys.readouterr().out
    started.mkdir()
    monkeypatch.chdir(started)
    assert read_from(saved, announce=True) == config
    assert capsys.readouterr().out == ""
    # --init's checkpoint is read from there too
    monkeypatch.chdir(tmp_path)
    warm = {"working_dir": str(started), "config": {**config, "init": "runs/a/best"}}
    assert read_from(warm, announce=False)["init"] == str(started / "runs" / "a" / "best")


def test_a_resume_reads_a_relative_cache_from_the_runs_folder_and_says_so_only_when_asked(tmp_path, monkeypatch,
                                                                                          capsys):
    """``--cache-dir`` is a path the run read relative to its folder like the data set (encoded again elsewhere,
    otherwise); ``announce=False`` (every rank but the first) says nothing."""
    started = tmp_path / "started"
    saved = {"working_dir": str(started), "config": {"dataset": "/data/dataset.json", "cache_dir": ".cache/features"}}
    monkeypatch.chdir(tmp_path)
    assert read_from(saved, announce=False)["cache_dir"] == str(started / ".cache" / "features")
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("epoch, stopped_early, said", [
    (1, False, "resuming {run} at epoch 2, step 3"),
    (2, False, "{run} has finished (2 epochs): nothing to train; --epochs N with N > 2 continues it"),
    # early stopping is final (the loop never trains a run that stopped early on): no --epochs continues it
    (1, True, "{run} has finished (stopped early): nothing to train"),
])
def test_a_resume_says_the_epoch_and_step_it_goes_on_from_or_that_the_run_has_finished(tmp_path, capsys, epoch,
                                                                                       stopped_early, said):
    """The one line a resume prints: a run saved after one of its two epochs (and three steps into the next) goes on
    at epoch 2, step 3; a run that has trained all its epochs says so and how to continue it (it said it was
    resuming, or a run with epochs left was told it had finished); a run that stopped early says so, where it was
    told that a larger --epochs would continue it, which trained nothing."""
    progress = Progress(epoch=epoch, step_in_epoch=3, global_step=5 * epoch + 3, stopped_early=stopped_early)
    model, optimizer, saved = saved_linear_run(progress)
    capsys.readouterr()
    assert restore(saved, TrainConfig(out=str(tmp_path), epochs=2), tmp_path, DistContext(0, 1), model, None, optimizer,
                   None) == progress
    assert capsys.readouterr().out == said.format(run=tmp_path) + "\n"


def test_only_the_first_rank_says_where_a_resume_goes_on(tmp_path, capsys):
    # under torchrun every rank restores; the line is printed once, not once per process
    model, optimizer, saved = saved_linear_run(Progress(epoch=1, step_in_epoch=3, global_step=8))
    capsys.readouterr()
    restore(saved, TrainConfig(out=str(tmp_path), epochs=2), tmp_path, DistContext(1, 2), model, None, optimizer, None)
    assert capsys.readouterr().out == ""


def test_an_epoch_interrupted_after_its_last_step_still_reports_its_losses(scenes, tmp_path, cache):
    # the resumed run validated the epoch with the losses of a loop that had no step left to train: none
    cfg = _config(scenes, tmp_path / "run", cache, train_limit=16)  # two steps of 8 captions
    run = prepare_run(cfg)
    calls = []

    def interrupted_in_the_last_step(*args):
        calls.append(args)
        if len(calls) == run.steps_per_epoch:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the step finishes, and its state is saved

    before_each_step(run, interrupted_in_the_last_step)
    with pytest.raises(TrainingInterrupted, match=f"step {run.steps_per_epoch};"):
        fit(run)
    train(cfg, resume=True)
    (epoch,) = json.loads((tmp_path / "run" / "train_state.json").read_text())["progress"]["history"]
    assert {"xe", "doubly_stochastic"} <= set(epoch)
    # and the rate its steps were trained at: the resumed loop trains no step, so the rate comes from before it
    assert epoch["lr"] == cfg.lr


def _signalled_in_the_first_step(run, *signals):
    """Make ``run``'s first step send this process ``signals`` (as a user or a service manager would, while it
    trains); returns the list of the steps' calls."""
    calls = []

    def first_step_signalled(*args):
        calls.append(args)
        if len(calls) == 1:
            for sig in signals:
                os.kill(os.getpid(), sig)

    before_each_step(run, first_step_signalled)
    return calls


def _outer_handler(signum, frame):  # what the process had installed before the run (pytest's, a server's)
    raise RuntimeError(f"signal {signum} reached the handler the run replaced")


def test_sigterm_inside_an_epoch_stops_after_that_step_saves_it_and_gives_back_the_handlers(scenes, tmp_path,
                                                                                              cache):
    """SIGTERM (a service manager's or a cluster scheduler's stop) is honoured between steps like Ctrl-C, not at the
    epoch's end: an epoch of an hour went on to its end (or to the scheduler's SIGKILL) before it stopped, saved at
    the step the signal came in.  The handlers the run replaced are the process's again once it returns: with
    SIG_DFL in their place, a later Ctrl-C in a notebook or a server ended the whole process."""
    run = prepare_run(_config(scenes, tmp_path / "run", cache, epochs=2))
    assert run.steps_per_epoch >= 2
    calls = _signalled_in_the_first_step(run, signal.SIGTERM)
    previous = {sig: signal.signal(sig, _outer_handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(TrainingInterrupted, match="epoch 1, step 1;"):
            fit(run)
        assert {sig: signal.getsignal(sig) for sig in previous} == dict.fromkeys(previous, _outer_handler)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert len(calls) == 1
    progress = json.loads((tmp_path / "run" / "train_state.json").read_text())["progress"]
    assert (progress["epoch"], progress["step_in_epoch"], progress["global_step"]) == (0, 1, 1)


def test_a_second_ctrl_c_aborts_at_once_without_saving(scenes, tmp_path, cache):
    """The first Ctrl-C waits for the step (or a whole validation) to end, as the line it prints says; pressed
    again it aborts at once, saving nothing, and the process's own handlers are back."""
    run = prepare_run(_config(scenes, tmp_path / "run", cache))
    _signalled_in_the_first_step(run, signal.SIGINT, signal.SIGINT)
    previous = signal.signal(signal.SIGINT, _outer_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            fit(run)
        assert signal.getsignal(signal.SIGINT) is _outer_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not (tmp_path / "run" / "train_state.json").exists()


def test_a_run_trained_outside_the_main_thread_trains_with_the_processs_signal_handling(scenes, tmp_path, cache):
    """Python lets only the main thread install signal handlers: a library caller that trains in a worker thread (a
    notebook's background job, a web app's task) trains with the process's handling of Ctrl-C as it is, rather than
    failing before its first step with "signal only works in main thread"."""
    run = prepare_run(_config(scenes, tmp_path / "run", cache, max_steps=1))
    outcome = []

    def in_a_thread():
        try:
            outcome.append(fit(run))
        except Exception as exc:  # noted for the assertion: a thread's exception would otherwise only be printed
            outcome.append(exc)

    worker = threading.Thread(target=in_a_thread)
    worker.start()
    worker.join()
    assert outcome == [tmp_path / "run" / "best"]
    assert json.loads((tmp_path / "run" / "train_state.json").read_text())["progress"]["global_step"] == 1


def test_the_first_ctrl_c_is_answered_at_once_by_the_main_rank_alone(monkeypatch, capfd):
    """The line saying the run stops after this step is written when the signal comes, by rank 0 alone: torchrun
    hands the signal to every rank, each of which repeated it (and only a slow subprocess test, on one process, read
    the line at all)."""
    for rank, said in [(0, True), (1, False)]:
        monkeypatch.setattr(loop, "distributed_rank", lambda rank=rank: rank)
        flag = loop._StopFlag()
        flag._handle(signal.SIGINT, None)
        assert flag.raised
        assert ("stopping after this step to save the run" in capfd.readouterr().err) is said, rank


def test_a_run_that_fails_before_its_first_step_keeps_an_empty_out_folder_it_did_not_make(scenes, tmp_path, cache):
    """A failed start removes the empty ``--out`` folder it made itself, not one that was there before it (a mount
    point, a folder made with its permissions set): that one is the user's."""
    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(ValueError, match="METEOR"):
        train(_config(scenes, out, cache, select_metric="METEOR"))
    assert out.is_dir()
    with pytest.raises(ValueError, match="METEOR"):
        train(_config(scenes, tmp_path / "new", cache, select_metric="METEOR"))
    assert not (tmp_path / "new").exists()


def test_a_failed_start_keeps_a_new_out_folder_that_something_was_written_into(scenes, tmp_path, cache,
                                                                              monkeypatch):
    """Only an empty ``--out`` folder is removed after a failed start: one that was written into before the failure
    is kept with what it holds, and the failure is the one raised (removing it whole was an ``OSError`` "directory
    not empty" in its place)."""
    out = tmp_path / "new"

    def written_then_failed(*args, **kwargs):
        (out / "notes.txt").write_text("mine")
        raise ValueError("the features could not be read")

    monkeypatch.setattr(loop, "open_feature_store", written_then_failed)  # the run's folder exists by then
    with pytest.raises(ValueError, match="the features could not be read"):
        train(_config(scenes, out, cache))
    assert (out / "notes.txt").read_text() == "mine"


def test_a_card_is_never_written_from_another_checkpoints_report(tmp_path, capsys):
    # `captioner eval weights/sat --output r.json` then `captioner card runs/sat/best --report r.json` (the README's
    # two lines, run in order) printed weights/sat's scores on the card of runs/sat/best
    mine = shutil.copytree(ROOT / "weights" / "flickr8k" / "sat", tmp_path / "mine")
    report = json.loads((ROOT / "docs" / "results" / "flickr8k" / "sat.json").read_text())
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**report, "weights_sha256": recorded_checksum(DEFAULT_CHECKPOINT)}))
    err = _fails(capsys, ["card", str(mine), "--report", str(other)])
    assert f"{other} scores" in err and f"evaluate {mine} into the report first" in err, err
    shipped_card = ROOT / "weights" / "flickr8k" / "sat" / "MODEL_CARD.md"
    assert (mine / "MODEL_CARD.md").read_bytes() == shipped_card.read_bytes()
    own = tmp_path / "own.json"
    own.write_text(json.dumps({**report, "weights_sha256": recorded_checksum(mine)}))
    _main(["card", str(mine), "--report", str(own)])  # its own weights' report, and reports that predate the record
    _main(["card", str(mine), "--report", str(ROOT / "docs" / "results" / "flickr8k" / "sat.json")])


def test_encoding_without_progress_bars_says_how_far_it_is(tmp_path, capsys):
    # --no-progress ("for logs and CI") printed nothing while the photos were encoded: minutes of silence
    images = load_karpathy(generate(tmp_path, {"train": 5, "val": 1, "test": 1, "heldout": 1}, seed=1,
                                    progress=False))
    extract_features(images, EncoderSpec(image_size=96), tmp_path / "cache", progress=False, shard_size=3)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("encoding 8 images into ") and lines[1:] == [
        f"  {n} of 8 images encoded" for n in (3, 6, 8)]
    extract_features(images, EncoderSpec(image_size=96), tmp_path / "cache", progress=False, shard_size=3)
    assert capsys.readouterr().err == ""  # nothing to encode: nothing said


def test_a_mistyped_encoder_option_or_a_min_count_that_keeps_no_word_is_refused_before_encoding(scenes, tmp_path,
                                                                                              capsys):
    # a mistyped key was a TypeError traceback (exit 1), a mistyped value a TypeError or KeyError minutes into the
    # extraction, and a --min-count above every word's count trained a model of no words that captioned "<bos>"
    cache = tmp_path / "cache"
    for value, said in [("layr=blocks", "the encoder has no option 'layr'; its options: backbone, image_size"),
                        ("image_size=abc", "encoder image_size must be a whole number, got 'abc'"),
                        ("layer=hypercolum", "unknown encoder layer 'hypercolum' for efficientnet_lite0: blocks, head, "
                                             "hypercolumn")]:
        assert said in _fails(capsys, _argv(scenes, tmp_path / "run", cache, "--encoder", value)), value
    err = _fails(capsys, _argv(scenes, tmp_path / "run", cache, "--min-count", "100000"))
    assert "--min-count 100000 keeps none of the training captions'" in err and "distinct words" in err
    assert not (tmp_path / "run").exists() and not list(cache.glob("*/*.npy"))


@pytest.mark.parametrize("empty", ["train", "val"])
def test_a_data_set_with_an_empty_train_or_val_split_is_refused_by_name(scenes, tmp_path, cache, monkeypatch, empty):
    """Either split alone empty is refused before any work, naming both counts: only both empty were refused, and an
    empty val split met an IndexError, an empty train split a run that trains nothing."""
    real = loop.load_captioned

    def one_split_empty(dataset, image_root, splits, limit=None):
        return [] if splits == (empty,) else real(dataset, image_root, splits, limit=limit)

    monkeypatch.setattr(loop, "load_captioned", one_split_empty)
    with pytest.raises(ValueError, match="needs non-empty 'train' and 'val' splits"):
        prepare_run(_config(scenes, tmp_path / "run", cache))


def test_prepare_run_makes_a_new_run_folder_with_its_parents(scenes, tmp_path, cache):
    """:func:`prepare_run` (the library's way in, without :func:`train`'s lock) makes ``--out`` and the folders
    above it: a run prepared into ``runs/sat`` had no folder to save its state in."""
    out = tmp_path / "runs" / "sat"
    run = prepare_run(_config(scenes, out, cache, max_steps=1))
    assert out.is_dir()
    fit(run)
    assert (out / "train_state.json").exists()


def test_a_resume_takes_only_the_options_the_command_named(scenes, tmp_path, cache):
    """``explicit`` reaches the resume: an option the command did not name (here ``epochs``, which a resume may
    change) keeps the run's value, though the config passed holds another; without it, every value off the defaults
    counted as given."""
    out = tmp_path / "run"
    train(_config(scenes, out, cache, epochs=2, max_steps=1))
    train(_config(scenes, out, cache, epochs=3), resume=True, explicit={"out", "max_steps"})
    assert json.loads((out / "train_state.json").read_text())["progress"]["epoch"] == 2


def test_a_run_whose_data_moved_resumes_from_where_the_command_says(scenes, tmp_path, capsys):
    # the run's data set moved (another disk): the new --dataset was named as ignored, then the run failed on the old
    # path, and only an edit of train_state.json could resume it
    shutil.copytree(scenes.parent, tmp_path / "data")
    train(_config(tmp_path / "data", tmp_path / "run", tmp_path / "cache", epochs=2, max_steps=1))
    (tmp_path / "data").rename(tmp_path / "moved")
    capsys.readouterr()
    with pytest.raises(SystemExit):  # the command names what to pass, where it said only that the file is gone
        main(["train", "--out", str(tmp_path / "run"), "--resume", "--no-progress"])
    assert "--resume takes --dataset and --image-root naming where it is now" in capsys.readouterr().err
    train(_config(tmp_path / "moved", tmp_path / "run", tmp_path / "cache", epochs=2), resume=True,
          explicit={"out", "epochs", "dataset"})
    said = capsys.readouterr().out
    assert "the run's data has moved" in said and "ignored" not in said
    state = json.loads((tmp_path / "run" / "train_state.json").read_text())
    assert state["progress"]["epoch"] == 2
    assert state["config"]["dataset"].startswith(str((tmp_path / "moved").resolve()))
    # a data set that still exists is the run's recipe: another one given is named as ignored, as before
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "moved", other)
    train(_config(other, tmp_path / "run", tmp_path / "cache", epochs=2), resume=True,
          explicit={"out", "epochs", "dataset"})
    assert "ignored: dataset=" in capsys.readouterr().out
