"""AreaTransformer (Area attention, arXiv:1810.10126, §3.2): protocol, incremental decoding = parallel pass, beam
alignment, attention export, masking, and a memorisation smoke test."""

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from captioner.models.attention.area import areas_to_cells, enumerate_areas_2d
from captioner.models.layers import sinusoid_positions
from captioner.models.protocol import Geometry, VisualBatch
from captioner.models.zoo import available, create

from .model_checks import (RecordingDropout, assert_beam_one_is_greedy, memorisation_cider, memorisation_task,
                          rescored_beams, stepwise, train_to_memorise)

# tiny tensors gain nothing from a second thread, and on a busy machine waiting for it dominates
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, FEAT = 23, 16
TOLERANCE = dict(atol=1e-5, rtol=1e-5)  # cached incremental decoding vs the step loop
CONFIGS = {
    "regular": dict(encoder_area=None, decoder_area=None, area_key="mean"),
    "2x2-basic": dict(encoder_area=2, decoder_area=2, area_key="mean"),
    "3x3-combined+2": dict(encoder_area=3, decoder_area=[3, 2], caption_area=2, area_key="combined"),
    "pre-norm-3-layers": dict(caption_area=3, pre_norm=True, enc_layers=3, dec_layers=3),
}


def tiny(**overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=VOCAB, feat_dim=FEAT, d_model=32, n_heads=4, enc_layers=2, dec_layers=2, ffn_dim=64,
                  dropout=0.0)
    return create("area-transformer", **{**config, **overrides}).eval()


@pytest.fixture
def visuals():
    torch.manual_seed(1)
    return VisualBatch.from_features(torch.randn(3, 16, FEAT))  # a 4×4 grid


def test_registered_and_config_round_trips():
    assert "area-transformer" in available()
    model = tiny(**CONFIGS["3x3-combined+2"], grid_hw=[4, 4])
    assert model.arch == "area-transformer" and model.attention_kind == "area_attention"  # GET /models, the card
    config = json.loads(json.dumps(model.config()))
    again = create("area-transformer", **config)
    assert again.config() == model.config()
    assert {k: v.shape for k, v in again.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}


def test_defaults_are_the_documented_small_model():
    """docs/area_attention.md: a library user's ``create("area-transformer", vocab_size=V, feat_dim=D)`` is a small
    CPU model with the paper's best image setting, 3×3* in the first 2 layers (the recipe names every size)."""
    model = create("area-transformer", vocab_size=VOCAB, feat_dim=FEAT)
    assert model.config() == dict(vocab_size=VOCAB, feat_dim=FEAT, d_model=256, n_heads=4, enc_layers=2, dec_layers=2,
                                  ffn_dim=1024, dropout=0.1, encoder_area=3, decoder_area=3, caption_area=None,
                                  area_key="combined", area_layers=2, pre_norm=False, grid_hw=None, max_grid=32)


def test_areas_only_in_the_first_area_layers():
    model = tiny(enc_layers=6, dec_layers=6, caption_area=2)  # the paper's layout: areas in layers 1–2 only
    assert [layer.attn.max_area for layer in model.encoder] == [(3, 3)] * 2 + [(1, 1)] * 4
    assert [layer.cross.max_area for layer in model.decoder] == [(3, 3)] * 2 + [(1, 1)] * 4
    assert [layer.self_attn.max_area for layer in model.decoder] == [(1, 2)] * 2 + [(1, 1)] * 4
    # area_key covers every area layer (docs/area_attention.md): the encoder's and the caption's too
    for attention in ("attn", "cross", "self_attn"):
        layers = model.encoder if attention == "attn" else model.decoder
        assert [getattr(layer, attention).combiner is not None for layer in layers] == [True] * 2 + [False] * 4


@pytest.mark.parametrize("name", list(CONFIGS))
def test_incremental_step_equals_parallel_forward(name, visuals):
    captions = torch.tensor([[5, 6, 7, 8, 2, 0], [9, 10, 2, 0, 0, 0], [11, 12, 13, 14, 15, 2]])
    model = tiny(**CONFIGS[name]).double()
    vis = VisualBatch.from_features(visuals.feats.double())
    parallel, aux = model.forward_xe(vis, captions)
    assert parallel.shape == (3, 6, VOCAB) and aux == {}
    step_by_step, _ = stepwise(model, vis, captions)
    torch.testing.assert_close(step_by_step, parallel, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(parallel.exp().sum(-1), torch.ones(3, 6, dtype=torch.float64))
    model32 = tiny(**CONFIGS[name])
    torch.testing.assert_close(stepwise(model32, visuals, captions)[0], model32.forward_xe(visuals, captions)[0],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pre_norm", [False, True])
def test_encoder_and_first_step_follow_vaswani_layout(pre_norm, visuals):
    """The step-vs-parallel check cannot see a change both passes share, so the Transformer around the area
    attention is written out here: cell ``(r, c)`` gets ``row_embed[r] + col_embed[c]`` (row-major), each sublayer
    is ``LN(x + f(x))`` (post-norm) or ``x + f(LN(x))`` with a final LN (pre-norm), words are ``√d E w + PE(t)``.
    The LayerNorms are given trained-looking scales and shifts: at their initial 1 and 0 a sublayer using another's
    norm, or a second LN after a post-norm one, changes nothing.  The exported ``areas`` are the last layer's
    cross-attention weights averaged over the heads (no head alone)."""
    model = tiny(**CONFIGS["2x2-basic"], pre_norm=pre_norm)
    with torch.no_grad():
        for norm in (module for module in model.modules() if isinstance(module, nn.LayerNorm)):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    assert isinstance(model.enc_norm, nn.LayerNorm) == isinstance(model.dec_norm, nn.LayerNorm) == pre_norm
    grid = (4, 4)

    def sublayer(sub, x, fn):
        return x + fn(sub.norm(x)) if pre_norm else sub.norm(x + fn(x))

    pos = torch.stack([model.row_embed.weight[r] + model.col_embed.weight[c] for r in range(4) for c in range(4)])
    x = model.proj(visuals.feats) + pos
    for layer in model.encoder:
        x = sublayer(layer.sub1, x, lambda y, layer=layer: layer.attn(y, y, grid)[0])
        x = sublayer(layer.sub2, x, layer.ffn)
    memory = model.enc_norm(x) if pre_norm else x
    bos = torch.full((3,), model.bos_id)
    y = model.embed(bos)[:, None] * math.sqrt(32) + sinusoid_positions(torch.tensor([0]), 32)
    area_maps = []

    def cross(z, layer):
        out, weights = layer.cross(z, memory, grid)
        area_maps.append(weights[:, :, 0].mean(1))  # [B, heads, |R|] at the one position, over the heads
        return out

    for layer in model.decoder:
        y = sublayer(layer.subs[0], y, lambda z, layer=layer: layer.self_attn(z, z)[0])  # only itself in the past
        y = sublayer(layer.subs[1], y, lambda z, layer=layer: cross(z, layer))
        y = sublayer(layer.subs[2], y, layer.ffn)
    expected = model.out(model.dec_norm(y[:, 0]) if pre_norm else y[:, 0]).log_softmax(-1)
    enc = model.encode(visuals)
    torch.testing.assert_close(enc["memory"], memory)
    logprobs, _, record = model.step(bos, model.init_state(enc), enc)
    torch.testing.assert_close(logprobs, expected)
    torch.testing.assert_close(record.extras["areas"], area_maps[-1])


def test_a_wide_grid_is_read_as_rows_by_columns_in_every_area_attention_and_the_export():
    """A landscape photo's features come as 3 rows × 5 columns (``grid_hw``), and an area is a rectangle of that grid:
    the encoder's self-attention, the cross-attention's area keys and values built in :meth:`encode` and the cells
    that ``primary`` spreads an area's weight onto must all read the grid as rows × columns.  Every other equation
    test has a square grid, where a grid read as columns × rows gives the same areas; here it joins cells of
    different rows into one area, and the caption and the heat map shown over the photo change."""
    model = tiny(encoder_area=[2, 3], decoder_area=[3, 2], area_key="mean", grid_hw=[3, 5])
    feats = torch.randn(2, 15, FEAT, generator=torch.Generator().manual_seed(2))
    grid = (3, 5)
    pos = torch.stack([model.row_embed.weight[r] + model.col_embed.weight[c] for r in range(3) for c in range(5)])
    x = model.proj(feats) + pos
    for layer in model.encoder:  # post-norm: LN(x + f(x))
        x = layer.sub1.norm(x + layer.attn(x, x, grid)[0])
        x = layer.sub2.norm(x + layer.ffn(x))
    bos = torch.full((2,), model.bos_id)
    y = model.embed(bos)[:, None] * math.sqrt(32) + sinusoid_positions(torch.tensor([0]), 32)
    for layer in model.decoder:
        y = layer.subs[0].norm(y + layer.self_attn(y, y)[0])
        out, weights = layer.cross(y, x, grid)
        y = layer.subs[1].norm(y + out)
        y = layer.subs[2].norm(y + layer.ffn(y))
    areas = weights[:, :, 0].mean(1)  # the last layer's, over the heads
    enc = model.encode(VisualBatch.from_features(feats))
    torch.testing.assert_close(enc["memory"], x)
    logprobs, _, record = model.step(bos, model.init_state(enc), enc)
    torch.testing.assert_close(logprobs, model.out(y[:, 0]).log_softmax(-1))
    torch.testing.assert_close(record.extras["areas"], areas)
    cells = areas_to_cells(areas, enumerate_areas_2d(3, 5, 3, 2), grid)
    torch.testing.assert_close(record.primary, cells / cells.sum(-1, keepdim=True))


def test_beam_search_attention_lines_up_with_tokens(visuals):
    model = tiny(**CONFIGS["3x3-combined+2"])
    model.out.bias.data[model.eos_id] += 2.0  # let some captions end inside max_len
    boxes = model.area_boxes((4, 4))
    assert torch.equal(boxes, enumerate_areas_2d(4, 4, 3, 2))
    for single, tokens, hyp, _ in rescored_beams(model, visuals, tolerance=TOLERANCE):
        steps = len(hyp.token_ids)
        torch.testing.assert_close(torch.tensor(hyp.token_logprobs),
                                   model.forward_xe(single, tokens)[0][0].gather(1, tokens.T).squeeze(1), **TOLERANCE)
        assert hyp.attention.shape == (steps, 16)
        areas = hyp.extras["areas"]
        assert areas.shape == (steps, len(boxes))
        torch.testing.assert_close(areas.sum(-1), torch.ones(steps))
        cells = areas_to_cells(areas, boxes, 16)
        torch.testing.assert_close(hyp.attention, cells / cells.sum(-1, keepdim=True))
        assert set(hyp.extras) == {"areas", "cell_mass", "layer1", "layer2"}
        size = ((boxes[:, 2] - boxes[:, 0] + 1) * (boxes[:, 3] - boxes[:, 1] + 1)).float()
        torch.testing.assert_close(hyp.extras["cell_mass"][:, 0], areas @ size)  # Σ_j c_j = Σ_r a_r |r|


def test_beam_one_equals_greedy(visuals):
    model = tiny(**CONFIGS["2x2-basic"])
    assert_beam_one_is_greedy(model, visuals, max_len=8)


def test_paper_layout_exports_the_last_area_layers_areas_and_the_last_layers_cells(visuals):
    """With areas in the first layers only (the paper's 6 layers: areas in 1–2), ``areas`` is the last area layer's
    weights, over the boxes ``area_boxes`` lists, while ``primary`` is the last layer's plain cell attention; that
    has no area mass, so there is no ``cell_mass``."""
    model = tiny(dec_layers=2, area_layers=1)
    boxes = model.area_boxes((4, 4))
    assert torch.equal(boxes, enumerate_areas_2d(4, 4, 3, 3))
    assert torch.equal(model.area_boxes(), enumerate_areas_2d(8, 8, 3, 3))  # no grid given or configured: 8×8
    _, records = stepwise(model, visuals, torch.tensor([[5, 6]] * 3))
    for record in records:
        assert set(record.extras) == {"areas", "layer1", "layer2"}
        assert record.extras["areas"].shape == (3, len(boxes))
        cells = areas_to_cells(record.extras["areas"], boxes, 16)
        torch.testing.assert_close(record.extras["layer1"], cells / cells.sum(-1, keepdim=True))
        torch.testing.assert_close(record.primary, record.extras["layer2"])
        torch.testing.assert_close(record.primary.sum(-1), torch.ones(3))


def test_regular_model_exports_plain_cell_attention(visuals):
    model = tiny(**CONFIGS["regular"])
    assert model.area_boxes() is None
    _, records = stepwise(model, visuals, torch.tensor([[5, 6]] * 3))
    assert "areas" not in records[0].extras
    torch.testing.assert_close(records[0].primary.sum(-1), torch.ones(3))


def test_masked_cells_get_no_attention(visuals):
    model = tiny(**CONFIGS["3x3-combined+2"])
    mask = torch.ones(3, 16, dtype=torch.bool)
    mask[1, 10:] = False
    mask[2, [0, 5]] = False
    vis = VisualBatch(visuals.feats, mask)
    _, records = stepwise(model, vis, torch.tensor([[5, 6, 7]] * 3))
    for record in records:
        assert torch.all(record.primary[~mask] == 0)
        torch.testing.assert_close(record.primary.sum(-1), torch.ones(3))
    noisy = VisualBatch(visuals.feats.masked_fill(~mask.unsqueeze(-1), 50.0), mask)
    torch.testing.assert_close(stepwise(model, noisy, torch.tensor([[5, 6, 7]] * 3))[0],
                               stepwise(model, vis, torch.tensor([[5, 6, 7]] * 3))[0])


def test_an_image_without_a_real_cell_gets_a_zero_map_not_nan(visuals):
    """Every area of such an image is masked, so no cell gets mass: the renormalised map stays 0 (0/0 is guarded)
    while the other images' maps still sum to 1."""
    model = tiny(**CONFIGS["3x3-combined+2"])
    mask = torch.ones(3, 16, dtype=torch.bool)
    mask[1] = False
    logprobs, records = stepwise(model, VisualBatch(visuals.feats, mask), torch.tensor([[5, 6]] * 3))
    assert torch.isfinite(logprobs).all()
    for record in records:
        assert torch.equal(record.primary[1], torch.zeros(16)) and record.extras["cell_mass"][1].item() == 0.0
        torch.testing.assert_close(record.primary[[0, 2]].sum(-1), torch.ones(2))


def test_grid_comes_from_geometry_or_config():
    model = tiny(grid_hw=[3, 5])
    enc = model.encode(VisualBatch.from_features(torch.randn(2, 15, FEAT)))
    assert enc["grid_hw"].tolist() == [[3, 5], [3, 5]]
    with pytest.raises(ValueError, match="grid"):
        tiny().encode(VisualBatch.from_features(torch.randn(1, 15, FEAT)))
    # the features' own geometry wins over the configured grid: a portrait photo's 5×3 cells are not laid out 3×5
    portrait = Geometry("grid", (30, 50), (5, 3), np.zeros((15, 4), np.float32))
    enc = model.encode(VisualBatch.from_features(torch.randn(2, 15, FEAT), [portrait, portrait]))
    assert enc["grid_hw"].tolist() == [[5, 3], [5, 3]]


def test_area_boxes_follow_the_grid_asked_for_over_the_configured_one():
    """The caption's ``area_boxes`` come from ``area_boxes(geometry.grid_hw)``: a model configured for 3×5 given a
    portrait photo's 5×3 cells attends over the 5×3 grid's areas (its geometry wins in :meth:`encode`), so the boxes
    drawn for ``area_topk`` must be that grid's too, not the configured one's (other areas, another count)."""
    model = tiny(decoder_area=[3, 2], grid_hw=[3, 5])
    assert torch.equal(model.area_boxes((5, 3)), enumerate_areas_2d(5, 3, 3, 2))
    assert torch.equal(model.area_boxes(), enumerate_areas_2d(3, 5, 3, 2))  # no grid given: the configured one


def test_grid_of_max_grid_rows_is_taken_and_a_larger_one_refused():
    # the learned cell positions hold max_grid rows and columns (docs/area_attention.md): all of them are usable
    model = tiny(max_grid=4)
    assert model.encode(VisualBatch.from_features(torch.randn(1, 16, FEAT)))["grid_hw"].tolist() == [[4, 4]]
    with pytest.raises(ValueError, match="max_grid=4"):
        model.encode(VisualBatch.from_features(torch.randn(1, 25, FEAT)))  # a 5×5 grid


def test_forward_xe_refuses_scheduled_sampling(visuals):
    with pytest.raises(ValueError, match="scheduled sampling"):
        tiny().forward_xe(visuals, torch.tensor([[5, 6, 2]] * 3), ss_prob=0.1)


def test_memorises_ten_captions():
    # a 4×4 grid: still every area shape up to 3×3 (81 areas), a third of the 8×8 grid's time (441 areas)
    vis, targets, captions = memorisation_task(items=16)
    torch.manual_seed(0)
    model = create("area-transformer", vocab_size=VOCAB, feat_dim=32, d_model=64, n_heads=4, ffn_dim=128,
                   dropout=0.0, caption_area=2)
    loss = train_to_memorise(model, vis, targets, steps=100, lr=3e-3, stop_loss=0.0)
    cider, exact, _ = memorisation_cider(model, vis, captions)
    assert exact >= 8 and cider > 2.0, (exact, cider, loss)


def test_a_grid_wider_than_max_grid_is_refused_by_name():
    """The row and column embeddings both hold ``max_grid`` positions: a 2×5 grid under ``max_grid=4`` is refused
    naming the limit, not met as an embedding's IndexError."""
    model = tiny(max_grid=4, grid_hw=[2, 5])
    with pytest.raises(ValueError, match="max_grid=4"):
        model.encode(VisualBatch.from_features(torch.randn(1, 10, FEAT)))


def test_dropout_sits_on_the_summed_inputs_and_on_every_sublayers_output(visuals):
    """Vaswani et al. §5.4: dropout on the sums of the cells' projections and positions and of the words'
    embeddings and positions, and on each sublayer's output before the residual add (and inside the FFN), all at
    the model's ``dropout``.  Every other test runs with dropout 0 or in eval mode, where a dropout moved, dropped
    or given another rate changes no output; recording stand-ins show which tensors reach it."""
    model = tiny(**CONFIGS["3x3-combined+2"], dropout=0.3)
    dropouts = [module for module in model.modules() if isinstance(module, nn.Dropout)]
    # the model's own, 2 + the FFN's per encoder layer, 3 + the FFN's per decoder layer: each at the model's rate
    assert len(dropouts) == 1 + 2 * 3 + 2 * 4 and {module.p for module in dropouts} == {0.3}
    model.drop = RecordingDropout()
    subs = [sub for layer in model.encoder for sub in (layer.sub1, layer.sub2)]
    subs += [sub for layer in model.decoder for sub in layer.subs]
    for sub in subs:
        sub.drop = RecordingDropout()
    captions = torch.tensor([[5, 6, 2], [7, 2, 0], [8, 9, 10]])
    model.forward_xe(visuals, captions)
    cells, words = model.drop.inputs
    pos = torch.stack([model.row_embed.weight[r] + model.col_embed.weight[c] for r in range(4) for c in range(4)])
    torch.testing.assert_close(cells, model.proj(visuals.feats) + pos)
    tokens = torch.cat([torch.full((3, 1), model.bos_id), captions[:, :-1]], 1)
    torch.testing.assert_close(words, model.embed(tokens) * math.sqrt(32) + sinusoid_positions(torch.arange(3), 32))
    assert [len(sub.drop.inputs) for sub in subs] == [1] * len(subs)  # each sublayer's output, once


def test_a_configured_grid_that_does_not_fit_the_features_gives_way_to_a_square_one():
    """``grid_hw`` is taken only when it holds the features' count: a model configured for 3×5 given the 16 cells
    of a 4×4 grid lays them out 4×4, rather than failing on 15 positions for 16 cells."""
    model = tiny(grid_hw=[3, 5])
    enc = model.encode(VisualBatch.from_features(torch.randn(2, 16, FEAT)))
    assert enc["grid_hw"].tolist() == [[4, 4], [4, 4]]


def test_forward_xe_reads_each_captions_image_through_rows(visuals):
    """Training encodes each image once and passes ``rows`` (caption → image): the log-probabilities are those of
    the images repeated per caption, in the rows' order (every other test has one caption per image, in order)."""
    model = tiny(**CONFIGS["3x3-combined+2"])
    captions = torch.tensor([[5, 6, 2], [7, 2, 0], [8, 9, 10], [11, 2, 0]])
    rows = torch.tensor([2, 0, 2, 1])
    repeated = VisualBatch.from_features(visuals.feats[rows])
    torch.testing.assert_close(model.forward_xe(visuals, captions, rows=rows)[0],
                               model.forward_xe(repeated, captions)[0])
