"""AreaTransformer (Area attention, arXiv:1810.10126, §3.2): protocol, incremental decoding = parallel pass, beam
alignment, attention export, masking, and a memorisation smoke test."""

import json
import math

import pytest
import torch

from captioner.models.attention.area import areas_to_cells, enumerate_areas_2d
from captioner.models.layers import sinusoid_positions
from captioner.models.protocol import VisualBatch
from captioner.models.zoo import available, create

from .model_checks import (assert_beam_one_is_greedy, memorisation_cider, memorisation_task, rescored_beams,
                          stepwise, train_to_memorise)

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
    config = json.loads(json.dumps(model.config()))
    again = create("area-transformer", **config)
    assert again.config() == model.config()
    assert {k: v.shape for k, v in again.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}


def test_areas_only_in_the_first_area_layers():
    model = tiny(enc_layers=6, dec_layers=6, caption_area=2)  # the paper's layout: areas in layers 1–2 only
    assert [layer.attn.max_area for layer in model.encoder] == [(3, 3)] * 2 + [(1, 1)] * 4
    assert [layer.cross.max_area for layer in model.decoder] == [(3, 3)] * 2 + [(1, 1)] * 4
    assert [layer.self_attn.max_area for layer in model.decoder] == [(1, 2)] * 2 + [(1, 1)] * 4
    assert [layer.cross.combiner is not None for layer in model.decoder] == [True] * 2 + [False] * 4


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
    is ``LN(x + f(x))`` (post-norm) or ``x + f(LN(x))`` with a final LN (pre-norm), words are ``√d E w + PE(t)``."""
    model = tiny(**CONFIGS["2x2-basic"], pre_norm=pre_norm)
    grid = (4, 4)

    def sublayer(sub, x, fn):
        return x + fn(sub.norm(x)) if pre_norm else sub.norm(x + fn(x))

    pos = torch.stack([model.row_embed.weight[r] + model.col_embed.weight[c] for r in range(4) for c in range(4)])
    x = model.proj(visuals.feats) + pos
    for layer in model.encoder:
        x = sublayer(layer.sub1, x, lambda y, layer=layer: layer.attn(y, y, grid)[0])
        x = sublayer(layer.sub2, x, layer.ffn)
    memory = model.enc_norm(x)
    bos = torch.full((3,), model.bos_id)
    y = model.embed(bos)[:, None] * math.sqrt(32) + sinusoid_positions(torch.tensor([0]), 32)
    for layer in model.decoder:
        y = sublayer(layer.subs[0], y, lambda z, layer=layer: layer.self_attn(z, z)[0])  # only itself in the past
        y = sublayer(layer.subs[1], y, lambda z, layer=layer: layer.cross(z, memory, grid)[0])
        y = sublayer(layer.subs[2], y, layer.ffn)
    expected = model.out(model.dec_norm(y[:, 0])).log_softmax(-1)
    enc = model.encode(visuals)
    torch.testing.assert_close(enc["memory"], memory)
    logprobs, _, _ = model.step(bos, model.init_state(enc), enc)
    torch.testing.assert_close(logprobs, expected)


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


def test_grid_comes_from_geometry_or_config():
    model = tiny(grid_hw=[3, 5])
    enc = model.encode(VisualBatch.from_features(torch.randn(2, 15, FEAT)))
    assert enc["grid_hw"].tolist() == [[3, 5], [3, 5]]
    with pytest.raises(ValueError, match="grid"):
        tiny().encode(VisualBatch.from_features(torch.randn(1, 15, FEAT)))


def test_memorises_ten_captions():
    # a 4×4 grid: still every area shape up to 3×3 (81 areas), a third of the 8×8 grid's time (441 areas)
    vis, targets, captions = memorisation_task(items=16)
    torch.manual_seed(0)
    model = create("area-transformer", vocab_size=VOCAB, feat_dim=32, d_model=64, n_heads=4, ffn_dim=128,
                   dropout=0.0, caption_area=2)
    loss = train_to_memorise(model, vis, targets, steps=100, lr=3e-3, stop_loss=0.0)
    cider, exact, _ = memorisation_cider(model, vis, captions)
    assert exact >= 8 and cider > 2.0, (exact, cider, loss)
