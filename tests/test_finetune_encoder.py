"""Fine-tuning the encoder's last stages (``captioner train --finetune-stages``): the tail over cached features is
the frozen network before training, and what a run trains is what serving, evaluation and storage rewrites use."""

import hashlib
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load, load_file, save_file

from captioner.models.checkpoint import convert_storage, load_checkpoint, write_manifest
from captioner.models.data.datasets import load_captioned
from captioner.models.data.features import _cache_name, extract_features, find_covering_store
from captioner.models.data.stores import TunedStore
from captioner.models.encoder import EncoderSpec, EncoderTail, GridEncoder, weights_sha256
from captioner.models.evaluation.card import _encoder_state, write_card
from captioner.models.export.onnx import GraphSpec, export_identity, export_visual_encoder, visual_encoder_key
from captioner.models.export.sessions import VisualSession
from captioner.models.inference import torch_runtime
from captioner.models.protocol import VisualBatch
from captioner.models.training import TrainConfig, fit, loop, prepare_run, train
from captioner.service import runtime as runtime_module
from captioner.service.onnx_exports import unprepared

from .conftest import before_each_step, module_folder

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = EncoderSpec(image_size=128)
SMALL = dict(embed_dim=32, hidden_dim=48, attn_dim=32, dropout=0.3)


@pytest.fixture(scope="module")
def frozen():
    return GridEncoder(SPEC)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("features")


def _config(scenes, out, cache, **overrides):
    cfg = dict(dataset=str(scenes), out=str(out), model_args=SMALL, cache_dir=str(cache), epochs=2, batch_size=16,
               lr=3e-3, progress=False, encoder={"image_size": 128}, finetune_stages=1, encoder_lr_factor=1.0)
    cfg.update(overrides)
    return TrainConfig(**cfg)


@pytest.mark.parametrize("stages", [1, 2])
def test_an_untrained_tail_over_features_cut_before_it_is_the_frozen_encoder(frozen, stages):
    torch.manual_seed(0)
    pixels = torch.randn(2, 3, 128, 128)
    cut = GridEncoder(replace(SPEC, stop_stages=stages))
    early = cut(pixels)
    # stage 6 (192-d) is on the final 4×4 grid; stage 5 (112-d) is on the stride-16 grid, 8×8 at 128 px
    assert early.shape == ((2, 16, 192) if stages == 1 else (2, 64, 112)) and cut.feat_dim == early.shape[-1]
    tail = EncoderTail(frozen, stages)
    assert all(p.requires_grad for p in tail.parameters())
    torch.testing.assert_close(tail(early), frozen(pixels), atol=1e-4, rtol=1e-4)


def test_the_tail_passes_gradients_and_its_state_names_the_networks_own_weights(frozen):
    tail = EncoderTail(frozen, 1)
    state = tail.tuned_state()
    assert state and all(key.startswith("blocks.6.") for key in state)
    assert set(state) <= set(frozen.net.state_dict())
    feats = torch.randn(2, 16, 192, requires_grad=True)
    tail(feats).sum().backward()
    assert feats.grad is not None and all(p.grad is not None for p in tail.parameters())


class OnesStore:
    """An inner store of cached 192-d features, all ones, on the CPU as a cache read from disk is."""

    feat_dim = 192

    def batch(self, keys):
        return VisualBatch.from_features(torch.ones(len(keys), 16, 192))


def test_a_tuned_store_runs_the_tail_over_the_inner_stores_features(frozen):
    tail = EncoderTail(frozen, 1)
    vis = TunedStore(OnesStore(), tail).batch(["a", "b"])
    assert vis.feats.shape == (2, 16, 320) and vis.mask.all()
    torch.testing.assert_close(vis.feats, tail(torch.ones(2, 16, 192)))


def test_a_tuned_store_hands_the_cached_features_to_the_device_of_the_tuned_stages(frozen):
    """The feature cache is read on the CPU while ``--finetune-stages`` trains its stages on the run's device (a GPU):
    the store moves each batch to where the stages' weights are, or every fine-tuning run on a GPU stops at its first
    step on a device mismatch.  The meta device stands in for the GPU, so this runs on any machine."""
    tail = EncoderTail(frozen, 1).to("meta")
    vis = TunedStore(OnesStore(), tail).batch(["a", "b"])
    assert vis.feats.device.type == "meta" and vis.mask.device.type == "meta" and vis.feats.shape == (2, 16, 320)


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="layer=blocks"):
        EncoderSpec(layer="hypercolumn", stop_stages=1)
    with pytest.raises(ValueError, match="stop_stages"):
        EncoderSpec(stop_stages=7)
    for stages in (0, 7):  # 7: every stage, none left for a cache
        with pytest.raises(ValueError, match="fine-tune 1"):
            EncoderTail(GridEncoder(SPEC), stages)


@pytest.fixture(scope="module")
def tuned_best(request, scenes, cache, tmp_path_factory):
    """The best/ of a tiny run with its last stage fine-tuned (at the decoder's rate, so the stage moves)."""
    return train(_config(scenes, module_folder(request, tmp_path_factory, "tuned") / "run", cache))


def test_a_run_trains_the_stage_and_its_checkpoint_serves_the_trained_weights(tuned_best, tmp_path, frozen):
    best = tuned_best
    config = json.loads((best / "config.json").read_text())
    assert config["encoder"]["tuned_weights"] == "encoder_tuned.safetensors"  # relative: the folder can move
    assert "stop_stages" not in config["encoder"]  # serving computes the whole network
    tuned = load_file(best / "encoder_tuned.safetensors")
    ckpt = load_checkpoint(best)
    served = GridEncoder(ckpt.encoder)
    pixels = torch.randn(1, 3, 128, 128)
    # what training validated with: the trained tail over the cached stage-6 features
    tail = EncoderTail(frozen, 1)
    tail.load_tuned_state(tuned)
    trained = tail(GridEncoder(replace(SPEC, stop_stages=1))(pixels))
    torch.testing.assert_close(served(pixels), trained, atol=1e-4, rtol=1e-4)
    assert (served(pixels) - frozen(pixels)).abs().max() > 1e-2, "the fine-tuned stage did not move"
    # a float16 copy elsewhere carries the stage's file and names it relative to its own folder
    copy = convert_storage(best, "float16", tmp_path / "half")
    assert json.loads((copy / "config.json").read_text())["encoder"]["tuned_weights"] == "encoder_tuned.safetensors"
    assert load_checkpoint(copy).encoder.tuned_weights == str((copy / "encoder_tuned.safetensors").resolve())


def test_the_onnx_encoder_of_a_tuned_checkpoint_computes_the_trained_stage(tuned_best, tmp_path, frozen):
    spec = load_checkpoint(tuned_best).encoder
    assert visual_encoder_key(spec) != visual_encoder_key(SPEC)  # never the frozen network's cached export
    path = export_visual_encoder(spec, tmp_path)
    pixels = torch.randn(2, 3, 128, 128)
    torch.testing.assert_close(VisualSession(path, "cpu", 1)(pixels), GridEncoder(spec)(pixels), atol=1e-3,
                               rtol=1e-3)


def test_an_export_is_stale_once_the_tuned_stage_changes_though_the_decoder_did_not(tuned_best, tmp_path):
    """The model's own ``encoder.onnx`` holds the fine-tuned CNN, and the check set's reference captions come from
    it: an export made before the stage's file changed (the decoder's weights untouched, the manifest resealed) is
    stale, is listed as still to prepare, and is made again, rather than serving the old stage under the name."""
    weights, onnx_dir = tmp_path / "weights", tmp_path / "onnx"
    shutil.copytree(tuned_best, weights / "a")
    settings = dict(device_name="cpu", default_backend="auto", onnx_dir=onnx_dir, threads=1)
    assert runtime_module.load_runtimes(weights, [], **settings)["a"].backend == "onnx"
    assert unprepared(weights, [], onnx_dir=onnx_dir) == []
    first = GraphSpec.load(onnx_dir / "a").checksum
    # current under the identity it was made from (the CNN's file in it): the next start makes nothing again
    written = {path.name: path.stat().st_mtime_ns for path in (onnx_dir / "a").iterdir()}
    assert runtime_module.load_runtimes(weights, [], **settings)["a"].backend == "onnx"
    assert {path.name: path.stat().st_mtime_ns for path in (onnx_dir / "a").iterdir()} == written

    stage = weights / "a" / "encoder_tuned.safetensors"
    save_file({key: value * 1.5 for key, value in load_file(stage).items()}, stage)
    write_manifest(weights / "a")
    ckpt = load_checkpoint(weights / "a")
    assert export_identity(ckpt.checksum, ckpt.encoder) != first  # the decoder's own checksum did not change
    assert unprepared(weights, [], onnx_dir=onnx_dir) == ["a"]
    assert runtime_module.load_runtimes(weights, [], **settings)["a"].backend == "onnx"
    assert GraphSpec.load(onnx_dir / "a").checksum == export_identity(ckpt.checksum, ckpt.encoder)
    assert unprepared(weights, [], onnx_dir=onnx_dir) == []


def test_an_encoder_that_names_no_weights_file_keeps_the_checksum_as_its_export_identity():
    """Exports made before the identity covered the encoder's files stay current for the checkpoints without any
    (every shipped checkpoint but the fine-tuned X-LAN)."""
    assert export_identity("0" * 64, SPEC) == "0" * 64


def test_resume_continues_the_fine_tuned_stage_exactly(scenes, tmp_path, cache):
    train(_config(scenes, tmp_path / "straight", cache))
    train(_config(scenes, tmp_path / "resumed", cache, max_steps=20))  # stops inside epoch 2 (15 steps an epoch)
    train(_config(scenes, tmp_path / "resumed", cache), resume=True)
    for name in ("model.safetensors", "encoder_tuned.safetensors"):
        a, b = (load_file(tmp_path / run / "last" / name) for run in ("straight", "resumed"))
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], msg=f"{name}: {key} differs after resume")


def test_the_tuned_stages_step_at_the_encoder_lr_factor_times_the_decoders_rate(scenes, tmp_path, cache):
    """``--encoder-lr-factor`` scales the stages' rate at every step, where the schedule sets each group's rate
    anew: set without it, the pretrained stages took the steps of a decoder trained from scratch."""
    run = prepare_run(_config(scenes, tmp_path / "run", cache, encoder_lr_factor=0.1, max_steps=2, train_limit=8,
                              val_limit=2))
    rates = []
    before_each_step(run, lambda *_: rates.append([group["lr"] for group in run.optimizer.param_groups]))
    fit(run)
    assert rates == [pytest.approx([3e-3, 3e-4])] * 2


def test_fine_tuning_needs_the_grid_encoder(scenes, tmp_path, cache):
    with pytest.raises(ValueError, match="--finetune-stages"):
        train(_config(scenes, tmp_path / "run", cache, features="regions:/nowhere"))


def test_a_warm_start_from_a_tuned_checkpoint_keeps_its_stages(scenes, tmp_path, cache, tuned_best):
    frozen_run = train(_config(scenes, tmp_path / "next", cache, epochs=1, encoder={}, init=str(tuned_best),
                               finetune_stages=0))
    carried = load_file(frozen_run / "encoder_tuned.safetensors")
    original = load_file(tuned_best / "encoder_tuned.safetensors")
    assert carried.keys() == original.keys() and all(torch.equal(carried[k], original[k]) for k in carried)
    assert "the fine-tuned stages of the checkpoint it started from" in write_card(frozen_run, {}).read_text()
    assert "its last stage fine-tuned by this run" in write_card(tuned_best, {}).read_text()


def test_a_cards_encoder_line_counts_the_stages_this_run_fine_tuned():
    """The tiny runs above tune one stage; a run with ``--finetune-stages 2`` tuned two, and a card saying "its last
    stage" would hide half of what the run changed in the encoder."""
    tuned = {"tuned_weights": "encoder_tuned.safetensors"}
    two, one = (_encoder_state(tuned, {"train_config": {"finetune_stages": n}}) for n in (2, 1))
    assert two == "ImageNet weights, its last 2 stages fine-tuned by this run: `encoder_tuned.safetensors`"
    assert one == "ImageNet weights, its last stage fine-tuned by this run: `encoder_tuned.safetensors`"


def test_a_warm_start_that_tunes_on_saves_the_stages_it_trained_over_those_its_init_brought(tmp_path):
    """A run with both ``--init`` of a tuned checkpoint and ``--finetune-stages`` carries the weights it trained: the
    init's file only fills in the stages this run did not tune (the test above tunes nothing further)."""
    brought = tmp_path / "init_tuned.safetensors"
    save_file({"stage.w": torch.zeros(2), "earlier.w": torch.full((2,), 3.0)}, brought)
    run = SimpleNamespace(spec=EncoderSpec(tuned_weights=str(brought)),
                          tail=SimpleNamespace(tuned_state=lambda: {"stage.w": torch.ones(2)}))
    spec, files = loop._encoder_files(run)
    carried = load(files[spec.tuned_weights])
    assert spec.tuned_weights == loop.TUNED_WEIGHTS and set(carried) == {"stage.w", "earlier.w"}
    assert torch.equal(carried["stage.w"], torch.ones(2)) and torch.equal(carried["earlier.w"], torch.full((2,), 3.0))


def test_the_models_endpoint_names_the_tuned_stages_by_file_not_by_the_servers_path(tuned_best):
    runtime = torch_runtime(tuned_best, "cpu")
    assert runtime.info().encoder["tuned_weights"] == "encoder_tuned.safetensors"
    assert Path(runtime.spec.tuned_weights).is_absolute()  # what the runtime itself loads from


def test_a_feature_store_of_tuned_stages_is_found_again_only_while_their_file_is_unchanged(scenes, tuned_best,
                                                                                          tmp_path):
    copy = shutil.copytree(tuned_best, tmp_path / "ckpt")
    spec = load_checkpoint(copy).encoder
    images = load_captioned(str(scenes), None, ("val",))[:3]
    extract_features(images, spec, tmp_path / "cache", progress=False)
    keys = [im.key for im in images[:2]]
    assert find_covering_store(tmp_path / "cache", spec, keys) is not None
    tuned = load_file(copy / "encoder_tuned.safetensors")
    save_file({k: v + 1.0 for k, v in tuned.items()}, copy / "encoder_tuned.safetensors")  # best/ rewritten in place
    assert find_covering_store(tmp_path / "cache", spec, keys) is None


@pytest.mark.parametrize("field", ["tuned_weights", "weights"])
@pytest.mark.parametrize("edit", ["rewritten in place", "another file put at its path"])
def test_a_weights_file_is_known_by_its_content_to_the_feature_cache_and_the_onnx_export(tmp_path, field, edit):
    """One identity, the file's sha256, names every weights file of a spec (fine-tuned stages, a local ImageNet file)
    in both caches: an edit that keeps the file's size and modification time (an in-place rewrite, a copy with
    ``cp -p``) or another file put at the same path makes a new feature store and a new export. The export's key
    used to be a local ImageNet file's size and mtime, and the feature cache's name its path alone, so both kept
    serving the old network."""
    path = tmp_path / "encoder.safetensors"
    path.write_bytes(b"first weights")
    spec = EncoderSpec(**{field: str(path)})
    written = path.stat()
    keys = visual_encoder_key(spec), _cache_name(spec, ["photo.jpg"])
    if edit == "rewritten in place":
        path.write_bytes(b"other weights")  # as many bytes
    else:
        (tmp_path / "other.safetensors").write_bytes(b"other weights")
        os.replace(tmp_path / "other.safetensors", path)
    os.utime(path, ns=(written.st_atime_ns, written.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (written.st_size, written.st_mtime_ns)
    assert visual_encoder_key(spec) != keys[0], "the export of the old weights would be served"
    assert _cache_name(spec, ["photo.jpg"]) != keys[1], "the features of the old weights would be reused"
    path.write_bytes(b"first weights")  # the first content back: its caches again
    assert (visual_encoder_key(spec), _cache_name(spec, ["photo.jpg"])) == keys
    # the same bytes at another path (a checkpoint moved or mounted elsewhere): the same export and features, where
    # the CNN was exported again beside the first (the ONNX audit)
    (tmp_path / "moved").mkdir()
    os.replace(path, tmp_path / "moved" / path.name)
    moved = EncoderSpec(**{field: str(tmp_path / "moved" / path.name)})
    assert (visual_encoder_key(moved), _cache_name(moved, ["photo.jpg"])) == keys


def test_weights_sha256_names_each_weights_file_of_a_spec_and_no_other(tmp_path):
    (tmp_path / "imagenet.pth").write_bytes(b"imagenet")
    (tmp_path / "tuned.safetensors").write_bytes(b"tuned")
    spec = EncoderSpec(weights=str(tmp_path / "imagenet.pth"), tuned_weights=str(tmp_path / "tuned.safetensors"))
    assert weights_sha256(spec) == {"weights": hashlib.sha256(b"imagenet").hexdigest(),
                                    "tuned_weights": hashlib.sha256(b"tuned").hexdigest()}
    assert weights_sha256(EncoderSpec()) == {}  # the packaged weights
    assert weights_sha256(EncoderSpec(backbone="resnet18", layer="layer4", weights="random")) == {}
    missing = EncoderSpec(weights=str(tmp_path / "gone.pth"))
    with pytest.raises(FileNotFoundError):
        weights_sha256(missing)
    assert weights_sha256(missing, missing_ok=True) == {"weights": ""}
    # a missing ImageNet file stops nothing after it: the fine-tuned stages are still named by their content, which
    # the export identity (``missing_ok``) keys on
    both = replace(missing, tuned_weights=str(tmp_path / "tuned.safetensors"))
    tuned = hashlib.sha256(b"tuned").hexdigest()
    assert weights_sha256(both, missing_ok=True) == {"weights": "", "tuned_weights": tuned}


def test_a_tuned_weights_file_that_holds_no_stage_of_this_encoder_is_refused(tmp_path):
    """Every tensor must name one of the network's, with its shape: an empty file, another layout's name or another
    width would leave ImageNet's weights serving under a fine-tuned checkpoint's name."""
    width = GridEncoder(SPEC).net.state_dict()["blocks.6.0.conv_pw.weight"].shape
    for name, state in [("empty", {}), ("foreign", {"blocks.9.0.conv_pw.weight": torch.zeros(width)}),
                        ("misshapen", {"blocks.6.0.conv_pw.weight": torch.zeros(1)})]:
        save_file(state, tmp_path / f"{name}.safetensors")
        with pytest.raises(ValueError, match="does not hold stages of this encoder"):
            GridEncoder(replace(SPEC, tuned_weights=str(tmp_path / f"{name}.safetensors")))


def test_a_tuned_weights_file_that_is_missing_is_named_as_the_specs_tuned_weights(tmp_path):
    """A folder, or a file that is gone, is said to be the fine-tuned stages' file (the field that names it), not
    only an OS error about a path."""
    for path in (tmp_path / "gone.safetensors", tmp_path):
        with pytest.raises(FileNotFoundError, match=r"fine-tuned encoder weights .* not found \(EncoderSpec.tuned_w"):
            GridEncoder(replace(SPEC, tuned_weights=str(path)))


def test_a_tails_state_loads_back_only_whole(frozen):
    tail = EncoderTail(frozen, 1)
    state = tail.tuned_state()
    with pytest.raises(RuntimeError, match="Missing key"):
        tail.load_tuned_state(dict(list(state.items())[1:]))
    with pytest.raises(RuntimeError, match="Unexpected key"):
        tail.load_tuned_state({**state, "blocks.6.9.conv_pw.weight": torch.zeros(1)})
