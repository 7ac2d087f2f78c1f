"""The package used from Python, as a library user's audit used it: the mistakes a notebook makes (a path for a
list, a numpy array for an image, a beam of 0, "cuda" on a machine without one) are refused by name before any
work, where they were tracebacks from deep inside PIL, PyTorch or the beam search."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from skimage import data

from captioner.models.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from captioner.models.decoding import DecodingRules, beam_search
from captioner.models.inference import torch_runtime
from captioner.models.pipeline import Pipeline
from captioner.models.protocol import VisualBatch

from .serving_helpers import TINY_SPEC, VOCAB, shared_encoder, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("library") / "tiny"
    save_checkpoint(path, tiny_model("sat"), VOCAB, TINY_SPEC)
    return path


@pytest.fixture(scope="module")
def pipeline(folder):
    return Pipeline(folder, device="auto")  # "auto" was PyTorch's "Expected one of cpu, cuda, …" error


def test_a_numpy_array_is_an_image_and_other_objects_are_named(pipeline):
    cat = data.chelsea()
    from_array, from_pil = pipeline([cat, Image.fromarray(cat)])
    assert from_array.hypothesis.token_ids == from_pil.hypothesis.token_ids
    np.testing.assert_allclose(from_array.attention, from_pil.attention)
    # the rows, one per token, where the README's example says they are
    assert from_array.attention.shape == (len(from_array.tokens), len(from_array.geometry.boxes))
    np.testing.assert_allclose(from_array.attention.sum(1), 1.0, atol=1e-5)
    with pytest.raises(TypeError, match="HxW, HxWx3 or HxWx4 uint8, got float64"):
        pipeline([cat / 255.0])
    with pytest.raises(TypeError, match="got Tensor"):
        pipeline([torch.from_numpy(cat)])


def test_each_caption_of_a_batch_lies_on_its_own_photo(pipeline):
    """The photos of one call run through the network as one batch of equal inputs; each result's geometry is still
    that of its own photo, in the order given (a wide, a tall and a square one): its size, and its last cell's box
    reaching that photo's far corner."""
    wide = data.chelsea()  # 451 × 300
    results = pipeline([wide, wide.transpose(1, 0, 2), data.astronaut()])
    sizes = [(451, 300), (300, 451), (512, 512)]
    assert [result.geometry.image_size for result in results] == sizes
    for result, size in zip(results, sizes, strict=True):
        np.testing.assert_allclose(result.geometry.boxes[-1][2:], size)


def test_a_single_image_for_the_list_and_an_empty_list(pipeline, tmp_path):
    photo = tmp_path / "cat.jpg"
    Image.fromarray(data.chelsea()).save(photo)
    with pytest.raises(TypeError, match=r"a list of images: pipeline\(\[image\]\)"):
        pipeline(str(photo))  # was captioned letter by letter: "cannot identify … image in /"
    assert pipeline([]) == []


@pytest.mark.parametrize("single", ["path", "bytes", "pil", "array"])
def test_each_kind_of_single_image_for_the_list_is_refused(pipeline, tmp_path, single):
    photo = tmp_path / "cat.png"
    Image.fromarray(data.chelsea()).save(photo)
    image = {"path": photo, "bytes": photo.read_bytes(), "pil": Image.open(photo), "array": data.chelsea()}[single]
    with pytest.raises(TypeError, match=r"^Pipeline captions a list of images: pipeline\(\[image\]\)$"):
        pipeline(image)


def test_a_call_searches_three_beams_of_twenty_steps_under_the_checkpoints_rules_unless_told(pipeline, monkeypatch):
    """The defaults of ``captioner caption`` and of the README's example; the rules are those the checkpoint was
    tuned to (``captioner tune-decoding``), or those given."""
    searched = []
    caption = pipeline.runtime.caption

    def caption_and_record(batch, beam_size, max_len, rules):
        searched.append((len(batch), beam_size, max_len, rules))
        return caption(batch, beam_size, max_len, rules)

    monkeypatch.setattr(pipeline.runtime, "caption", caption_and_record)
    monkeypatch.setitem(pipeline.ckpt.meta, "decoding", {"block_trigrams": True})
    assert pipeline.ckpt is pipeline.runtime.ckpt
    pipeline([data.astronaut(), data.chelsea()])
    given = DecodingRules(block_doubled_words=True)
    pipeline([data.astronaut()], beam_size=2, max_len=5, rules=given)
    assert searched == [(2, 3, 20, DecodingRules(block_trigrams=True)), (1, 2, 5, given)]


@pytest.mark.parametrize("options,message", [
    (dict(beam_size=0), "beam_size must be a whole number of at least 1, got 0"),
    (dict(beam_size=-1), "beam_size .* got -1"),
    (dict(beam_size="3"), "beam_size .* got '3'"),
    (dict(beam_size=2.5), "beam_size .* got 2.5"),
    (dict(max_len=0), "max_len must be a whole number of at least 1, got 0"),
    (dict(rules={"length_penalty": 0.5}), "rules must be DecodingRules"),
])
def test_decoding_options_are_refused_by_name(pipeline, options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        pipeline([data.astronaut()], **options)
    assert pipeline([data.astronaut()], beam_size=2, max_len=4, rules=DecodingRules(block_trigrams=True))


def test_each_result_carries_the_rules_it_was_decoded_with(pipeline):
    """A result records its decoding rules (the service's answer reports them): those given, else the checkpoint's
    own, for every image of the batch, not the search's defaults."""
    given = DecodingRules(length_penalty=0.7, block_trigrams=True)
    results = pipeline([data.astronaut(), data.chelsea()], beam_size=2, max_len=4, rules=given)
    assert [result.rules for result in results] == [given, given]


def test_captions_name_the_model_they_came_from(pipeline, folder):
    """A library user's results say which model made them: a runtime is named after its checkpoint folder, unless
    ``torch_runtime`` is given a name (as the service names each model it serves)."""
    (result,) = pipeline([data.astronaut()], beam_size=1, max_len=3)
    assert result.model == folder.name == "tiny"
    assert torch_runtime(folder, name="mine").name == "mine"


def test_a_runtimes_description_counts_every_parameter_and_is_read_only(folder):
    """``GET /models``' ``parameters`` is the model's size: a loaded model is not trained, so which of its parameters
    would take gradients (here a frozen embedding) changes nothing in it."""
    ckpt = load_checkpoint(folder)
    total = sum(p.numel() for p in ckpt.model.parameters())
    next(ckpt.model.parameters()).requires_grad_(False)
    info = torch_runtime(ckpt).info()
    assert info.parameters == total
    # a photo is captioned on the grid, every mode draws it but area_topk, which needs a model that attends over areas
    assert info.heatmap_modes == ["grid_smooth", "grid_blocks", "region_sum", "top1_box"]
    # described once and handed to every caller (``GET /models`` and the library): no caller can change it for the next
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.parameters = 0


def test_a_runtimes_description_names_the_data_set_its_checkpoint_was_trained_on(folder):
    """``GET /models``' ``trained_on`` (what the model card cites) is the checkpoint's own record, and says so where
    a checkpoint records none: a description naming no data set would leave a user unable to tell a model trained
    on photographs from one trained on the generated scenes."""
    assert torch_runtime(folder).info().trained_on == "not recorded"
    ckpt = load_checkpoint(folder)
    ckpt.meta["trained_on"] = "Flickr8k (Hodosh et al., 2013), train split"
    assert torch_runtime(ckpt).info().trained_on == "Flickr8k (Hodosh et al., 2013), train split"


def test_a_runtimes_description_offers_the_decoding_rules_its_checkpoint_was_tuned_to(folder):
    """``GET /models``' ``decoding`` is what a request gets unless it names its own rules: the checkpoint's, chosen
    on validation by ``captioner tune-decoding``. The demo page and clients show and send these defaults: a
    description of no rules would tell them the model decodes without the rules every caption of it is given."""
    assert torch_runtime(folder).info().decoding == dataclasses.asdict(DecodingRules())
    ckpt = load_checkpoint(folder)
    ckpt.meta["decoding"] = {"length_penalty": 0.8, "block_trigrams": True}
    tuned = DecodingRules(length_penalty=0.8, block_trigrams=True)
    assert torch_runtime(ckpt).info().decoding == dataclasses.asdict(tuned) != dataclasses.asdict(DecodingRules())


def test_a_result_names_its_checkpoint_folder_apart_from_the_model_named_after_its_run(tmp_path):
    """A run's ``best`` is served as the run's model (``runs/sat/best`` → ``sat``), while a result's ``checkpoint``
    is the folder it came from (the service answers its name, ``best``): which of a run's checkpoints, ``best`` or
    ``last``, captioned is only told by it."""
    best = tmp_path / "sat" / "best"
    save_checkpoint(best, tiny_model("sat"), VOCAB, TINY_SPEC)
    runtime = torch_runtime(best)
    (result,) = runtime.caption([runtime.prepare(Image.new("RGB", (64, 48)))], beam_size=1, max_len=3)
    assert result.model == "sat" and Path(result.checkpoint).name == "best"


def test_a_runtime_of_a_checkpoint_trained_on_regions_is_refused_before_it_captions_a_photo(folder):
    """A photo gives grid features: ``torch_runtime`` refuses a region checkpoint by name, rather than handing back
    a runtime whose captions would read visual items the model was never trained on."""
    ckpt = load_checkpoint(folder)
    regions = Checkpoint(ckpt.model, ckpt.vocab, ckpt.encoder, meta={"train_config": {"features": "regions:feats"}})
    with pytest.raises(CheckpointError, match="trained on region features"):
        torch_runtime(regions)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA GPU")
def test_a_gpu_this_machine_lacks_is_said_in_one_line(folder):
    for load in (lambda: Pipeline(folder, device="cuda"), lambda: load_checkpoint(folder, "cuda")):
        with pytest.raises(ValueError, match="no CUDA GPU is available"):
            load()


def test_the_encoder_takes_a_batch_of_float_pixels():
    encoder = shared_encoder()
    side = encoder.spec.image_size
    with pytest.raises(ValueError, match=rf"\[batch, 3, height, width\] float pixels .*got \[3, {side}, {side}\]"):
        encoder(torch.rand(3, side, side))  # came back as [channels, w, h]: neither the layout nor an error
    with pytest.raises(ValueError, match="torch.uint8"):
        encoder(torch.zeros(1, 3, side, side, dtype=torch.uint8))
    assert encoder(torch.rand(2, 3, side, side)).shape[0] == 2


def test_a_batch_made_from_features_has_its_mask_on_the_features_device():
    """A library caller's GPU features get a GPU mask: one made on the default device (the CPU) would fail the first
    masked attention on a GPU.  The meta device stands in for another device, so no GPU is needed to hold it."""
    batch = VisualBatch.from_features(torch.empty(2, 9, 32, device="meta"))
    assert batch.mask.device.type == "meta" and batch.mask.shape == (2, 9) and batch.mask.dtype == torch.bool


def test_features_of_another_shape_or_width_are_refused_by_name():
    model = tiny_model("sat")
    with pytest.raises(ValueError, match=r"\[batch, items, channels\] .*got \[64, 32\]"):
        VisualBatch.from_features(torch.rand(64, 32))  # one image's features, without the batch axis
    with pytest.raises(ValueError, match=r"\[batch, items\] mask, got \[2, 9, 32\] and \[2, 8\]"):
        VisualBatch(torch.rand(2, 9, 32), torch.ones(2, 8, dtype=torch.bool))  # a mask cut to another count
    for width in (model.feat_dim + 1, model.feat_dim - 1):  # wider or narrower: another encoder's either way
        wrong_width = VisualBatch.from_features(torch.rand(2, 9, width))
        with pytest.raises(ValueError, match=rf"sat takes {model.feat_dim}-channel features, got {width}"):
            beam_search(model, wrong_width)
    wrong_width = VisualBatch.from_features(torch.rand(2, 9, model.feat_dim + 1))
    with pytest.raises(ValueError, match="channel features"):
        model.forward_xe(wrong_width, torch.ones(2, 3, dtype=torch.long))
