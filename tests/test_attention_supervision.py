"""Supervised attention from phrase boxes (models/training/attention_supervision.py; Liu et al. 2017,
arXiv:1605.09553): the loss against a naive sum, the targets on photos whose boxes are known, the settings refused
before any work, and a run whose attention moves into the boxes."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import ExifTags, Image

from captioner.models.data.karpathy import CaptionedImage
from captioner.models.encoder import EncoderSpec
from captioner.models.training.attention_supervision import AttentionTargets, attention_supervision_loss, \
    checked_entities_folder, entities_attention_targets
from captioner.models.training.config import TrainConfig
from captioner.models.training.loop import train
from captioner.models.training.xe import XEPhase
from captioner.models.vocab import Vocabulary

from .entities_photos import circle_photos
from .model_checks import keys_store
from .test_cli import captioner

# tiny models: a second thread gains nothing, and on a busy machine waiting for it dominates (the supervised run
# took 12.5 s, not 6.1 s, beside two busy loops)
pytestmark = pytest.mark.usefixtures("one_thread")

CAPTION = ["a", "red", "circle", "on", "a", "plain", "background"]
#: (flickr id, the red circle's box on the 64×48 copy, its split)
PHOTOS = [("111", (0, 0, 32, 24), "train"), ("222", (32, 24, 64, 48), "train"), ("333", (32, 0, 64, 24), "train"),
          ("444", (0, 24, 32, 48), "val")]


def _photos(tmp_path):
    """Four photos, a red circle filling one quadrant of each (the circle boxed, the background a scene chain without
    a box), each with two of the Entities captions and one that Entities does not hold."""
    return circle_photos(tmp_path, PHOTOS, [CAPTION, ["one", "circle"], ["a", "circle", "not", "in", "entities"]])


# ---------------------------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------------------------
def _rows(batch=3, steps=4, items=6, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    alpha = torch.softmax(torch.randn(batch, steps, items, generator=generator, dtype=dtype), -1)
    beta = torch.rand(batch, steps, items, generator=generator, dtype=dtype)
    beta[beta < 0.4] = 0  # boxes leave cells out
    beta[..., 0] += 0.1  # no row is all zeros
    beta = beta / beta.sum(-1, keepdim=True)
    supervised = torch.rand(batch, steps, generator=generator) < 0.6
    supervised[0, 0] = True
    return alpha, beta, supervised


def test_loss_is_the_mean_kl_over_the_supervised_words():
    alpha, beta, supervised = _rows()
    terms = []
    for b in range(alpha.shape[0]):
        for t in range(alpha.shape[1]):
            if supervised[b, t]:
                terms.append(sum(float(beta[b, t, i]) * np.log(float(beta[b, t, i]) / float(alpha[b, t, i]))
                                 for i in range(alpha.shape[2]) if beta[b, t, i] > 0))
    assert float(attention_supervision_loss(alpha, beta, supervised)) == pytest.approx(np.mean(terms), rel=1e-5)


def test_loss_is_zero_at_the_target_positive_elsewhere_and_its_gradient_checks():
    alpha, beta, supervised = _rows()
    assert float(attention_supervision_loss(beta, beta, supervised)) == pytest.approx(0.0, abs=1e-6)
    assert float(attention_supervision_loss(alpha, beta, supervised)) > 0.05
    scores = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda s: attention_supervision_loss(torch.softmax(s, -1), beta, supervised), (scores,))


def test_a_batch_without_supervised_words_adds_zero_and_keeps_the_graph():
    alpha, beta, _ = _rows()
    scores = torch.randn(alpha.shape, requires_grad=True)
    loss = attention_supervision_loss(torch.softmax(scores, -1), beta, torch.zeros(alpha.shape[:2], dtype=torch.bool))
    loss.backward()
    assert float(loss.detach()) == 0.0 and scores.grad is not None and float(scores.grad.abs().sum()) == 0.0


def test_a_bfloat16_map_is_scored_in_float32():
    # bfloat16 keeps 8 bits of mantissa: its logarithms of β and α, subtracted, lose most of each term
    alpha, beta, supervised = _rows(dtype=torch.float32)
    alpha, beta = alpha.bfloat16(), beta.bfloat16()
    want = attention_supervision_loss(alpha.double(), beta.double(), supervised)
    got = attention_supervision_loss(alpha, beta, supervised)
    assert got.dtype == torch.float32 and float(got) == pytest.approx(float(want), rel=1e-5)


def test_sparse_maps_with_exact_zeros_give_a_finite_loss():
    alpha, beta, supervised = _rows(dtype=torch.float32)
    alpha = torch.where(beta > 0, torch.zeros_like(alpha), alpha)  # all mass outside the boxes: the worst case
    assert torch.isfinite(attention_supervision_loss(alpha, beta, supervised))


# ---------------------------------------------------------------------------------------------------------------
# The targets
# ---------------------------------------------------------------------------------------------------------------
def test_the_xe_phase_adds_the_term_times_its_weight(tmp_path):
    """The phase's term is ``--attention-supervision-weight`` times the KL of the steps' attention against their
    caption's target rows.  A run's falling log of the term did not hold it: the weight divided by the KL falls too,
    as training drives the KL up and the attention out of the boxes."""
    vocab = Vocabulary(["a", "b"])
    images = [CaptionedImage(i, tmp_path / f"{i}.jpg", "train", [["a", "b"]]) for i in range(2)]
    attention = torch.softmax(torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0)), -1)
    rates = []
    model = SimpleNamespace(forward_xe_attended=lambda vis, targets, ss, rows: (
        rates.append(ss) or torch.log_softmax(torch.zeros(*targets.shape, len(vocab)), -1), {}, attention))
    store = keys_store()
    phase = XEPhase(TrainConfig(out=str(tmp_path), attention_supervision_weight=5.0), model, vocab, store, images,
                    "cpu")
    phase.ss_prob = 0.25  # the epoch's scheduled-sampling rate (the loop sets it) reaches the supervised steps too
    phase.supervise_attention(AttentionTargets(rows={(images[1].key, 0): {1: np.array([0.7, 0.1, 0.1, 0.1],
                                                                                    dtype=np.float32)}}, items=4))
    out = phase.loss([0, 1])
    target, supervised = phase.attention_targets.batch([(images[0].key, 0), (images[1].key, 0)], 3, "cpu")
    expected = 5.0 * attention_supervision_loss(attention, target, supervised).item()
    assert expected > 0 and out.logs["attention_supervision"] == pytest.approx(expected)
    assert out.loss.item() == pytest.approx(out.logs["xe"] + expected)
    assert rates == [0.25]


def test_targets_lay_each_phrase_box_on_the_heatmap_cells(tmp_path):
    _, entities = _photos(tmp_path)
    images = [CaptionedImage(i, tmp_path / "images" / f"{fid}_x.jpg", "train",
                             [CAPTION, ["one", "circle"], ["a", "circle", "not", "in", "entities"]])
              for i, (fid, _, _) in enumerate(PHOTOS[:2])]
    targets = entities_attention_targets(images, str(entities), EncoderSpec(layer="blocks"), max_len=16)
    assert targets.items == 64 and targets.captions == 6 and targets.aligned == 4
    # "a red circle" (positions 0-2) and "one circle" (0-1) are boxed; "on", the scene chain and the caption
    # Entities does not hold are not supervised
    first, second = images[0].key, images[1].key
    assert set(targets.rows) == {(first, 0), (first, 1), (second, 0), (second, 1)}
    assert sorted(targets.rows[(first, 0)]) == [0, 1, 2] and sorted(targets.rows[(first, 1)]) == [0, 1]
    # the first photo's circle fills the top-left quadrant: the 4×4 cells there, equally (8×8 grid, stretched)
    expected = np.zeros((8, 8), np.float32)
    expected[:4, :4] = 1 / 16
    np.testing.assert_allclose(targets.rows[(first, 0)][1].reshape(8, 8), expected, atol=1e-6)
    expected = np.zeros((8, 8), np.float32)
    expected[4:, 4:] = 1 / 16  # the second photo's: bottom right
    np.testing.assert_allclose(targets.rows[(second, 1)][0].reshape(8, 8), expected, atol=1e-6)
    assert targets.words == 10 and "4 of 6 training captions" in targets.summary()

    cut = entities_attention_targets(images, str(entities), EncoderSpec(layer="blocks"), max_len=2)
    assert sorted(cut.rows[(first, 0)]) == [0, 1]  # training captions are cut there
    beta, supervised = targets.batch([(first, 0), (second, 2), (second, 1)], steps=3, device=torch.device("cpu"))
    assert beta.shape == (3, 3, 64) and supervised.tolist() == [[True] * 3, [False] * 3, [True, True, False]]
    np.testing.assert_allclose(beta[2, 0].reshape(8, 8).numpy(), expected, atol=1e-6)


def test_a_photo_stored_on_its_side_gets_the_targets_of_its_upright_copy(tmp_path):
    """The boxes are drawn on the photo as it is shown, after its EXIF orientation: under a centre crop the header's
    unturned size (48 wide, 64 high) lays the grid elsewhere (for a box off the quadrants' lines: a quadrant lands
    on the same cells either way)."""
    circle_photos(tmp_path, [("111", (40, 0, 64, 12), "train"), ("112", (40, 0, 64, 12), "train")], [CAPTION])
    side_on = tmp_path / "images" / "112_x.jpg"
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = 6  # turn a quarter clockwise to show
    with Image.open(side_on) as upright:
        turned = upright.transpose(Image.Transpose.ROTATE_90)
    turned.save(side_on, exif=exif.tobytes())
    images = [CaptionedImage(i, tmp_path / "images" / f"{fid}_x.jpg", "train", [CAPTION])
              for i, fid in enumerate(("111", "112"))]
    spec = EncoderSpec(layer="blocks", resize="center_crop", resize_to=256)
    targets = entities_attention_targets(images, str(tmp_path / "entities"), spec, max_len=16)
    upright_key, side_on_key = images[0].key, images[1].key
    assert turned.size == (48, 64) and set(targets.rows) == {(upright_key, 0), (side_on_key, 0)}
    for position in (0, 1, 2):
        np.testing.assert_allclose(targets.rows[(side_on_key, 0)][position], targets.rows[(upright_key, 0)][position],
                                   atol=1e-6)


def test_a_batch_places_each_row_on_its_own_word_and_leaves_out_words_past_its_steps():
    first, third = np.full(4, 0.25, np.float32), np.array([1, 0, 0, 0], np.float32)
    targets = AttentionTargets(rows={("a", 0): {0: first, 2: third}, ("b", 1): {1: third}}, items=4)
    beta, supervised = targets.batch([("b", 1), ("a", 0), ("a", 1)], steps=2, device=torch.device("cpu"))
    assert supervised.tolist() == [[False, True], [True, False], [False, False]]
    assert beta[1, 0].tolist() == first.tolist() and beta[0, 1].tolist() == third.tolist()
    assert float(beta[0, 0].abs().sum() + beta[1, 1].abs().sum() + beta[2].abs().sum()) == 0.0


def test_a_phrase_whose_box_holds_no_pixel_is_left_unsupervised_and_photos_entities_lacks_are_counted(tmp_path):
    # a box past the photo's edge (an annotation of another copy of it): no cell holds any of its pixels
    _, entities = circle_photos(tmp_path, [("555", (70, 50, 90, 60), "train")], [CAPTION])
    images = [CaptionedImage(0, tmp_path / "images" / "555_x.jpg", "train", [CAPTION]),
              CaptionedImage(1, tmp_path / "images" / "999_x.jpg", "train", [CAPTION, CAPTION])]  # not in Entities
    targets = entities_attention_targets(images, str(entities), EncoderSpec(layer="blocks"), max_len=16)
    assert (targets.captions, targets.aligned, targets.words, targets.rows) == (3, 1, 0, {})


def _config(tmp_path, **overrides) -> TrainConfig:
    dataset, entities = _photos(tmp_path)
    # resolved as prepare_run hands it over: the model and the features named
    cfg = dict(dataset=str(dataset), out=str(tmp_path / "run"), model="sat", features="grid",
               cache_dir=str(tmp_path / "cache"),
               model_args=dict(embed_dim=16, hidden_dim=32, attn_dim=16, dropout=0.0), encoder={"layer": "blocks"},
               progress=False, attention_supervision=f"entities:{entities}")
    cfg.update(overrides)
    return TrainConfig(**cfg)


@pytest.mark.parametrize("overrides, message", [
    (dict(attention_supervision="boxes:somewhere"), "takes entities:DIR"),
    (dict(attention_supervision="entities:/nonexistent"), "not a Flickr30k Entities folder"),
    (dict(attention_supervision_weight=0.0), "must be positive"),
    (dict(phase="scst"), "not to --phase scst"),
    (dict(features="regions:/somewhere"), "has none"),
    (dict(augment="hflip"), "leave out --augment"),
    (dict(model="xtransformer"), "forward pass of its own"),
    (dict(model="sat-hard"), "forward pass of its own")])
def test_settings_it_cannot_serve_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        checked_entities_folder(_config(tmp_path, **overrides))


def test_a_folder_whose_path_holds_a_colon_is_taken_whole(tmp_path):
    """Only the first colon ends the kind: a Linux folder may hold colons of its own ("flickr:30k"), and the rest of
    ``entities:DIR`` is the folder as given, not refused as another kind."""
    folder = tmp_path / "flickr:30k"
    folder.mkdir()
    cfg = _config(folder)
    assert checked_entities_folder(cfg) == cfg.attention_supervision.removeprefix("entities:")
    assert ":30k" in checked_entities_folder(cfg)


def test_the_command_refuses_them_in_one_line_before_any_work(tmp_path):
    cfg = _config(tmp_path)
    done = captioner("train", "--dataset", cfg.dataset, "--out", cfg.out, "--model", "xtransformer",
                     "--attention-supervision", cfg.attention_supervision, "--cache-dir", cfg.cache_dir, check=False)
    assert done.returncode == 2 and "forward pass of its own" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------------------
# A run
# ---------------------------------------------------------------------------------------------------------------
def test_a_supervised_run_moves_the_attention_into_the_boxes(tmp_path):
    cfg = _config(tmp_path, epochs=25, batch_size=9, lr=1e-2, attention_supervision_weight=5.0, log_every=1,
                  val_beam=1, min_count=1)
    train(cfg)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    terms = [s["attention_supervision"] for s in steps if s.get("kind") == "step"]
    assert len(terms) == 25 and np.mean(terms[-5:]) < 0.5 * np.mean(terms[:3])
    trained_on = json.loads((tmp_path / "run" / "best" / "config.json").read_text())["meta"]["trained_on"]
    assert "attention supervised by the Flickr30k Entities (Plummer et al." in trained_on  # the card and GET /models
    # without the term nothing is logged for it
    train(replace(cfg, out=str(tmp_path / "plain"), attention_supervision=None, epochs=1))
    plain = (tmp_path / "plain" / "metrics.jsonl").read_text()
    assert "attention_supervision" not in plain and '"xe"' in plain


def test_each_cell_weighs_its_share_of_the_boxes_pixels_and_every_photo_size_has_its_own_cells(tmp_path):
    """β_t holds each cell's share of the box's pixels: a box off the cells' lines weighs the cells it cuts by the
    part they hold (the quadrant boxes above fill whole cells, where an even spread over the cells touched agrees).
    Photos of another size are laid on cells of their own: Flickr's photos come in many sizes."""
    circle_photos(tmp_path, [("111", (36, 0, 64, 9), "train"), ("222", (32, 24, 64, 48), "train")], [CAPTION])
    with Image.open(tmp_path / "images" / "222_x.jpg") as photo:
        photo.resize((32, 24)).save(tmp_path / "images" / "222_x.jpg")
    images = [CaptionedImage(i, tmp_path / "images" / f"{fid}_x.jpg", "train", [CAPTION])
              for i, fid in enumerate(("111", "222"))]
    targets = entities_attention_targets(images, str(tmp_path / "entities"), EncoderSpec(layer="blocks"), max_len=16)
    # the 64×48 photo's 8×8 cells are 8×6 pixels: the box (x 36-64, y 0-9) holds half of column 4's cells and
    # half of row 1's, so its cells weigh 1 (whole), 1/2 or 1/4 of a whole one, 28×9 pixels in all
    expected = np.zeros((8, 8), np.float32)
    expected[0, 4:], expected[1, 4:] = [24, 48, 48, 48], [12, 24, 24, 24]
    np.testing.assert_allclose(targets.rows[(images[0].key, 0)][1].reshape(8, 8), expected / (28 * 9), atol=1e-6)
    expected = np.zeros((8, 8), np.float32)
    expected[4:, 4:] = 1 / 16  # the half-size photo's bottom-right quadrant, on its own 4×3-pixel cells
    np.testing.assert_allclose(targets.rows[(images[1].key, 0)][0].reshape(8, 8), expected, atol=1e-6)


def test_a_box_of_one_pixel_supervises_the_cell_under_it(tmp_path):
    # a small object on a small copy of its photo (the grounding measure keeps a pixel even for a thinner box): its
    # words are trained towards that pixel's cell, not left out as a box that holds none is
    circle_photos(tmp_path, [("111", (10, 10, 11, 11), "train")], [CAPTION])
    images = [CaptionedImage(0, tmp_path / "images" / "111_x.jpg", "train", [CAPTION])]
    targets = entities_attention_targets(images, str(tmp_path / "entities"), EncoderSpec(layer="blocks"), max_len=16)
    expected = np.zeros(64, np.float32)
    expected[1 * 8 + 1] = 1  # pixel (10, 10) is in the cell of column 10 // 8, row 10 // 6
    assert sorted(targets.rows[(images[0].key, 0)]) == [0, 1, 2]
    np.testing.assert_allclose(targets.rows[(images[0].key, 0)][0], expected)
