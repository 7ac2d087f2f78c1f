"""Crash safety: checkpoints carry a sha256 manifest that loading verifies (torn, foreign and altered files are
refused, naming the file), files respect the umask, and a real training process killed with SIGKILL at a random
moment resumes losing at most one checkpoint interval, never leaving a torn checkpoint."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from skimage import data

from captioner.models import files as files_module
from captioner.models.checkpoint import CheckpointError, load_checkpoint, remove_debris, save_checkpoint, write_manifest
from captioner.models.encoder import EncoderSpec
from captioner.models.training import TrainConfig, train
from captioner.models.training.state import STATE_JSON, STATE_TENSORS, load_state, restore_optimizer_state, \
    save_state
from captioner.models.vocab import Vocabulary
from captioner.service.cli import main

from .conftest import DEFAULT_CHECKPOINT
from .test_compare import IMAGES, write_dataset

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = Vocabulary([f"w{i}" for i in range(19)])


def test_torn_foreign_and_altered_files_are_refused_naming_the_file(tmp_path, tiny_sat):
    a = save_checkpoint(tmp_path / "a", tiny_sat, VOCAB, EncoderSpec())
    b = save_checkpoint(tmp_path / "b", tiny_sat, VOCAB, EncoderSpec(image_size=128))
    assert sorted(p.name for p in a.iterdir()) == ["config.json", "manifest.json", "model.safetensors", "vocab.json"]
    load_checkpoint(a)

    weights = (a / "model.safetensors").read_bytes()
    (a / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # torn: a write cut short
    with pytest.raises(CheckpointError, match="model.safetensors does not match its sha256"):
        load_checkpoint(a)
    (a / "model.safetensors").write_bytes(weights)
    (a / "config.json").write_bytes((b / "config.json").read_bytes())  # foreign: another checkpoint's file
    with pytest.raises(CheckpointError, match="config.json does not match"):
        load_checkpoint(a)
    assert load_checkpoint(a, verify=False).encoder.image_size == 128  # the caller may opt out, knowingly
    (a / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json.*captioner manifest"):
        load_checkpoint(a)
    write_manifest(a)  # what `captioner manifest` does for files one trusts
    assert load_checkpoint(a).encoder.image_size == 128

    saved = {"progress": {"global_step": 3}, "model": {"w": torch.ones(4)}}
    save_state(tmp_path, saved)
    (tensors,) = tmp_path.glob("train_state.*.safetensors")
    tensors.write_bytes(tensors.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="refusing to resume"):
        load_state(tmp_path)


@pytest.mark.parametrize("unlisted", ["model.safetensors", "config.json", "vocab.json"])
def test_a_manifest_that_leaves_out_a_file_a_checkpoint_needs_is_refused(tmp_path, tiny_sat, unlisted):
    """An entry dropped from the manifest would let that file (another checkpoint's config, say) load unverified."""
    a = save_checkpoint(tmp_path / "a", tiny_sat, VOCAB, EncoderSpec())
    manifest = json.loads((a / "manifest.json").read_text())
    del manifest["files"][unlisted]
    (a / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"does not list {unlisted}"):
        load_checkpoint(a)


def test_each_state_save_replaces_the_previous_tensor_file_and_clears_a_killed_writers_debris(tmp_path):
    save_state(tmp_path, {"progress": {"global_step": 1}, "model": {"w": torch.zeros(2)}})
    (tmp_path / ".train_state.json.tmp-0badf00d").write_text("{")  # a writer killed before its rename
    save_state(tmp_path, {"progress": {"global_step": 2}, "model": {"w": torch.ones(2)}})
    (tensors,) = tmp_path.glob("train_state.*.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["train_state.json", tensors.name])
    assert load_state(tmp_path)["progress"]["global_step"] == 2


def test_a_state_keeps_each_tensor_of_its_lists_apart(tmp_path):
    """Tensors in a list (each rank's random streams, ``rng_ranks``) are named by their place in it: named alike,
    every rank resumed with one rank's stream."""
    save_state(tmp_path, {"progress": {"global_step": 1}, "rng_ranks": [{"torch": torch.zeros(3)},
                                                                       {"torch": torch.ones(3)}]})
    ranks = load_state(tmp_path)["rng_ranks"]
    assert [rank["torch"].tolist() for rank in ranks] == [[0.0] * 3, [1.0] * 3]


def test_a_state_of_nested_lists_and_dicts_of_tensors_reads_back_equal(tmp_path):
    """Every tensor's name spells its whole path with a separator at each level: run together, the first list's
    twelfth item (``1`` then ``1``) and the twelfth list's first (``11``) would share a name, and one would be lost."""
    grid = [[torch.tensor([10.0 * row + col]) for col in range(12)] for row in range(12)]
    state = {"progress": {"global_step": 1}, "grid": grid, "mixed": [{"a": [torch.zeros(2), {"b": torch.ones(1)}]}],
             "plain": [1, [2, "three"], {"four": None}]}
    save_state(tmp_path, state)
    loaded = load_state(tmp_path)
    assert [[float(t) for t in row] for row in loaded["grid"]] == [[float(t) for t in row] for row in grid]
    assert loaded["plain"] == state["plain"]
    (mixed,) = loaded["mixed"]
    assert torch.equal(mixed["a"][0], torch.zeros(2)) and torch.equal(mixed["a"][1]["b"], torch.ones(1))


def test_a_state_keeps_apart_dict_keys_that_run_together(tmp_path):
    """A dict's keys are named with a separator too: without it ``{"ab": ...}`` and ``{"a": {"b": ...}}`` (or an
    optimizer's parameter 1's ``1x`` and parameter 11's ``x``) would share a name, and one tensor would be lost."""
    save_state(tmp_path, {"progress": {"global_step": 1}, "ab": torch.zeros(2), "a": {"b": torch.ones(2)}})
    loaded = load_state(tmp_path)
    assert torch.equal(loaded["ab"], torch.zeros(2)) and torch.equal(loaded["a"]["b"], torch.ones(2))


def test_a_state_holding_a_tuple_of_tensors_saves_and_reads_them_back_as_a_list(tmp_path):
    # JSON has no tuple: a tuple's tensors are split out as a list's are (left inside it, the save failed on a
    # tensor that JSON cannot hold)
    save_state(tmp_path, {"progress": {"global_step": 1}, "rng": {"cuda": (torch.zeros(3), torch.ones(3))}})
    assert [t.tolist() for t in load_state(tmp_path)["rng"]["cuda"]] == [[0.0] * 3, [1.0] * 3]


def test_an_optimizers_state_read_back_from_a_saved_state_puts_back_its_moments(tmp_path):
    """JSON keeps the optimizer's parameter ids as text; with the ids left as text ``load_state_dict`` matches none of
    the parameters and a resumed run starts Adam's moments from zero, in silence."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adam([weight], lr=0.1)
    weight.sum().backward()
    optimizer.step()
    save_state(tmp_path, {"progress": {"global_step": 1}, "optimizer": optimizer.state_dict()})
    resumed = torch.nn.Parameter(torch.ones(3))
    fresh = torch.optim.Adam([resumed], lr=0.1)
    fresh.load_state_dict(restore_optimizer_state(load_state(tmp_path)["optimizer"]))
    # keyed by the parameter itself (an id left as text is kept under that text, where no step looks)
    assert torch.equal(fresh.state[resumed]["exp_avg"], optimizer.state[weight]["exp_avg"])


def test_a_state_whose_tensor_file_is_gone_is_refused_naming_it(tmp_path):
    save_state(tmp_path, {"progress": {"global_step": 1}, "model": {"w": torch.ones(2)}})
    (tensors,) = tmp_path.glob("train_state.*.safetensors")
    tensors.unlink()
    with pytest.raises(CheckpointError, match=f"{tensors}, named by {STATE_JSON}, is missing"):
        load_state(tmp_path)


def test_a_states_commit_is_flushed_to_disk(tmp_path, monkeypatch):
    """The JSON's rename is the commit point: its bytes unflushed, a machine crash after the rename could leave an
    empty ``train_state.json`` naming no tensors, and the run with nothing to resume from."""
    synced, real_fsync = [], os.fsync
    monkeypatch.setattr(files_module.os, "fsync", lambda fd: synced.append(os.fstat(fd).st_ino) or real_fsync(fd))
    save_state(tmp_path, {"progress": {"global_step": 1}, "model": {"w": torch.ones(2)}})
    assert (tmp_path / STATE_JSON).stat().st_ino in synced  # the file renamed into place keeps its inode


def test_a_state_holding_a_transposed_tensor_and_a_parameter_saves_and_reads_back_equal(tmp_path):
    """safetensors refuses a non-contiguous tensor (an optimizer's moment of a transposed weight, say): the state
    stores a contiguous copy rather than failing the save."""
    transposed, parameter = torch.arange(12.0).reshape(3, 4).t(), torch.nn.Parameter(torch.ones(2))
    save_state(tmp_path, {"progress": {"global_step": 1}, "optimizer": {"m": transposed, "p": parameter}})
    loaded = load_state(tmp_path)["optimizer"]
    assert torch.equal(loaded["m"], transposed) and torch.equal(loaded["p"], torch.ones(2))


def test_a_state_in_the_single_file_layout_of_older_runs_still_resumes_and_its_next_save_replaces_it(tmp_path):
    """Runs saved before the state's JSON named its tensor file kept the tensors in ``train_state.safetensors``, with
    no reference to it in the JSON: such a state loads, and the next save leaves the new layout alone."""
    save_state(tmp_path, {"progress": {"global_step": 1}, "model": {"w": torch.ones(2)}})
    skeleton = json.loads((tmp_path / STATE_JSON).read_text())
    os.replace(tmp_path / skeleton.pop("__tensors__")["file"], tmp_path / STATE_TENSORS)
    (tmp_path / STATE_JSON).write_text(json.dumps(skeleton))
    state = load_state(tmp_path)
    assert state["progress"]["global_step"] == 1 and torch.equal(state["model"]["w"], torch.ones(2))
    save_state(tmp_path, {"progress": {"global_step": 2}, "model": {"w": torch.zeros(2)}})
    assert not (tmp_path / STATE_TENSORS).exists() and load_state(tmp_path)["progress"]["global_step"] == 2


def test_a_save_killed_between_renames_is_recovered(tmp_path, tiny_sat):
    """Where folders cannot be swapped atomically, the old checkpoint is renamed aside before the new one moves in;
    a crash between the two renames leaves it as .NAME.old and a half-written .NAME.tmp-* folder."""
    path = save_checkpoint(tmp_path / "last", tiny_sat, VOCAB, EncoderSpec(image_size=128))
    os.replace(path, tmp_path / ".last.old")
    torn = tmp_path / ".last.tmp-0badf00d"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"\0" * 10)
    remove_debris(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]
    assert load_checkpoint(path).encoder.image_size == 128
    # a crash after the second rename: the new checkpoint is in place and the old one, still set aside, is removed
    (tmp_path / ".last.old").mkdir()
    (tmp_path / ".last.old" / "model.safetensors").write_bytes(b"\0" * 10)
    remove_debris(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]
    assert load_checkpoint(path).encoder.image_size == 128


@pytest.mark.parametrize("name", ["best", "last"])
def test_a_resume_puts_back_the_checkpoint_a_save_killed_between_renames_set_aside(scenes, tmp_path, name):
    """A run killed while it replaced best/ or last/ (between the two renames) left it only as ``.best.old`` or
    ``.last.old``; the resume puts it back before it trains, not only at the next save, which for best/ comes only
    with a better epoch (never, for a run that has passed its best): its checkpoint was missing while its state said
    it had one.  Both folders: the resume cleared only best/'s debris, and last/ stayed missing until the epoch's
    end (for ever, had the run been stopped before it)."""
    out = tmp_path / "run"
    cfg = dict(dataset=str(scenes), out=str(out), cache_dir=str(tmp_path / "features"), encoder={"image_size": 96},
               model_args=dict(embed_dim=16, hidden_dim=24, attn_dim=16), train_limit=8, val_limit=2, batch_size=16,
               epochs=2, progress=False, threads=1)
    train(TrainConfig(**cfg, max_steps=4))  # 3 steps an epoch: epoch 1 saved best/ and last/, then one step of 2
    os.replace(out / name, out / f".{name}.old")
    (out / f".{name}.tmp-0badf00d").mkdir()  # the new checkpoint, half written
    train(TrainConfig(**cfg, max_steps=5), resume=True)  # still inside epoch 2: no checkpoint is saved
    assert load_checkpoint(out / name).meta["history"][-1]["epoch"] == 1
    assert not list(out.glob(f".{name}*"))


def test_saved_files_respect_the_umask(tmp_path, tiny_sat):
    old = os.umask(0o022)
    try:
        path = save_checkpoint(tmp_path / "ckpt", tiny_sat, VOCAB, EncoderSpec())
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o755  # a service running as another user can list and read it
    for file in path.iterdir():
        assert file.stat().st_mode & 0o777 == 0o644, file.name


def _cli(scenes, cache, out, *extra):
    return [sys.executable, "-m", "captioner.service.cli", "train", "--dataset", str(scenes), "--out", str(out),
            "--cache-dir", str(cache), "--encoder", "image_size=96", "--set", "embed_dim=16", "--set", "hidden_dim=24",
            "--set", "attn_dim=16", "--set", "dropout=0.2", "--train-limit", "8", "--val-limit", "2",
            "--batch-size", "4", "--lr", "3e-3", "--epochs", "2", "--checkpoint-every", "3", "--log-every", "1",
            "--threads", "1", "--no-progress", *extra]


def _steps_logged(out) -> int:
    metrics = out / "metrics.jsonl"
    return metrics.read_text().count('"kind": "step"') if metrics.exists() else 0


def test_sigkill_at_a_random_moment_loses_at_most_one_interval_and_resumes_exactly(scenes, tmp_path):
    cache, out = tmp_path / "features", tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the uninterrupted run first (it also fills the feature cache): 8 images × 5 captions = 10 steps an epoch
    straight = subprocess.run(_cli(scenes, cache, tmp_path / "straight"), capture_output=True, text=True, env=env,
                              timeout=300)
    assert straight.returncode == 0, straight.stderr[-2000:]

    proc = subprocess.Popen(_cli(scenes, cache, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    # the moment is drawn in steps, not seconds, so that a fast machine does not finish the 20 steps first
    draw = random.Random()  # a new moment each run; printed, so that a failing one can be looked into
    target, pause, deadline = draw.randint(4, 17), draw.uniform(0.0, 0.2), time.time() + 120
    print(f"the kill: {pause:.3f} s after step {target} was logged")  # pytest shows it when the test fails
    while time.time() < deadline and proc.poll() is None and _steps_logged(out) < target:
        time.sleep(0.02)
    time.sleep(pause)  # anywhere: mid-step, mid-snapshot, mid-validation, mid-save
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    if proc.returncode == 0:
        pytest.skip("the run finished before the kill (an unusually fast machine)")

    lines = (out / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines[:-1]]  # the last line may be torn
    saved = load_state(out)  # never torn: the state loads (its sha256 verified)
    assert saved is not None
    lost = max(steps, default=0) - saved["progress"]["global_step"]
    assert lost <= 3, f"lost {lost} steps, more than one checkpoint interval (3)"
    for name in ("best", "last"):
        if (out / name).exists():
            load_checkpoint(out / name)  # every checkpoint that exists is whole

    resumed = subprocess.run([*_cli(scenes, cache, out), "--resume"], capture_output=True, text=True, env=env,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = load_file(tmp_path / "straight" / "last" / "model.safetensors")
    b = load_file(out / "last" / "model.safetensors")
    for key in a:  # an exact resume: the same data order, dropout masks and updates as without the kill
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=f"{key} differs after kill and resume")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, 21))  # no step logged twice
    assert not list(out.glob(".*tmp-*")), "temporary files of the killed run were left behind"


def _captioner_on_a_full_disk(argv: list[str], limit_bytes: int) -> subprocess.CompletedProcess:
    """``captioner ARGV`` in a process that cannot write past byte ``limit_bytes`` of a file (RLIMIT_FSIZE: the
    write fails with EFBIG, as one fails with ENOSPC on a full disk)."""
    code = ("import resource, signal\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit_bytes}, {limit_bytes}))\n"
            "from captioner.service.cli import main\n"
            f"main({argv!r})")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_a_card_written_on_a_full_disk_leaves_the_checkpoint_loadable_with_its_previous_card(tmp_path, tiny_sat):
    """The card is listed in the manifest: written in place, a card cut short (or a crash before the manifest was
    rewritten) left a checkpoint every later load refused."""
    ckpt = save_checkpoint(tmp_path / "ckpt", tiny_sat, VOCAB, EncoderSpec(), meta={"dataset": "scenes.json"})
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"beam_size": 3, "test": {"images": 10, "BLEU-4": 0.25, "CIDEr-D": 1.5}}))
    main(["card", str(ckpt), "--report", str(report)])
    card = (ckpt / "MODEL_CARD.md").read_text()
    load_checkpoint(ckpt)

    failed = _captioner_on_a_full_disk(["card", str(ckpt), "--report", str(report), "--title", "Renamed"],
                                       len(card) // 2)
    assert failed.returncode == 2 and "File too large" in failed.stderr, failed.stderr[-2000:]
    load_checkpoint(ckpt)  # verified against its manifest
    assert (ckpt / "MODEL_CARD.md").read_text() == card
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_report_written_on_a_full_disk_leaves_the_previous_report_whole(tmp_path):
    """``captioner compare --output`` (and eval's, and the decoding search's): a report someone waited for is replaced
    whole or not at all; written in place, a failed write had already emptied the previous one."""
    data = write_dataset(tmp_path / "scenes").parent
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "report.json"
    a.write_text(json.dumps([{"image_id": im.image_id, "caption": " ".join(im.references[0])} for im in IMAGES]))
    b.write_text(json.dumps([{"image_id": im.image_id, "caption": "a red circle"} for im in IMAGES]))
    main(["compare", str(a), str(b), "--dataset", str(data), "--output", str(out)])
    before = out.read_text()

    failed = _captioner_on_a_full_disk(["compare", str(b), str(a), "--dataset", str(data), "--output", str(out)],
                                       len(before) // 2)
    assert failed.returncode == 2 and "File too large" in failed.stderr, failed.stderr[-2000:]
    assert out.read_text() == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_an_overlay_written_on_a_full_disk_leaves_the_previous_figure_whole(tmp_path):
    """``captioner caption --overlay``: Pillow wrote the figure in place, so a failed write had already cut the
    previous one short."""
    photo, figure = tmp_path / "cat.jpg", tmp_path / "figure.png"
    Image.fromarray(data.chelsea()).save(photo)
    main(["caption", str(photo), "--checkpoint", str(DEFAULT_CHECKPOINT), "--overlay", str(figure),
          "--mode", "grid_blocks"])
    before = figure.read_bytes()

    failed = _captioner_on_a_full_disk(["caption", str(photo), "--checkpoint", str(DEFAULT_CHECKPOINT),
                                        "--overlay", str(figure)], len(before) // 2)
    assert failed.returncode == 2 and "File too large" in failed.stderr, failed.stderr[-2000:]
    assert figure.read_bytes() == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
