"""X-LAN (Pan et al. 2020, arXiv:2003.14080, §3.3): encoder and decoder equations, masking, the shared decoder's
alignment rule, checkpoint round trip and the memorisation smoke test."""

import json

import pytest
import torch
import torch.nn.functional as F

from captioner.models.layers import masked_mean
from captioner.models.protocol import VisualBatch
from captioner.models.zoo import available, create, options

from .model_checks import (VOCAB as MEMO_VOCAB, assert_beam_one_is_greedy, assert_checkpoint_round_trip,
                          RecordingDropout, memorisation_cider, memorisation_task, rescored_beams, stepwise,
                          train_to_memorise)

# tiny tensors gain nothing from a second thread, and on a busy machine waiting for it dominates
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, FEAT, ITEMS = 23, 16, 9


def tiny(**overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=VOCAB, feat_dim=FEAT, dim=32, hidden_dim=24, embed_dim=12, channel_dim=16, heads=4,
                  encoder_layers=2, dropout=0.0, attention_dropout=0.0, update_dropout=0.0)
    return create("xlan", **{**config, **overrides}).eval()


def regions(batch: int = 3, seed: int = 1) -> VisualBatch:
    """Padded region features: image 1 has 5 real regions, image 2 misses regions 0 and 6."""
    torch.manual_seed(seed)
    mask = torch.ones(batch, ITEMS, dtype=torch.bool)
    mask[1, 5:] = False
    mask[2, [0, 6]] = False
    return VisualBatch(torch.randn(batch, ITEMS, FEAT), mask)


def test_registered_and_config_round_trips():
    assert "xlan" in available()
    model = tiny(lstm_input="sum", hidden_dim=32, shared_kv_update=False, activation="relu")
    # GET /models and the model card name how the exported attention was made: the decoder block's spatial β^s
    assert model.arch == "xlan" and model.attention_kind == "xlinear_spatial_attention"
    config = json.loads(json.dumps(model.config()))
    again = create("xlan", **config)
    assert again.config() == model.config()
    assert {k: v.shape for k, v in again.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="lstm_input"):
        tiny(lstm_input="gru")
    with pytest.raises(ValueError, match="hidden_dim"):
        tiny(lstm_input="sum")  # ṽ + c_{t−1} needs equal widths


def test_defaults_are_the_authors_celu():
    """``captioner train --model xlan`` with no model options builds the "+ELU" block's CELU with the authors'
    α = 1.3 (docs/decisions.md#x-lan-activation) on the region and word embeddings and in every X-Linear block
    (its sizes, X-LAN §4.1's, are held by test_params)."""
    defaults = options("xlan")
    assert {key: defaults[key] for key in ["activation", "celu_alpha"]} == dict(activation="celu", celu_alpha=1.3)
    model = create("xlan", vocab_size=VOCAB, feat_dim=FEAT, dim=32, hidden_dim=24, embed_dim=12, channel_dim=16,
                   heads=4, encoder_layers=2)
    alphas = [module.alpha for module in model.modules() if isinstance(module, torch.nn.CELU)]
    assert len(alphas) >= 2 + 4 * 3 and set(alphas) == {1.3}


@pytest.mark.parametrize("shared", [True, False])
def test_encoder_stacks_xlinear_layers_from_the_mean_region(shared):
    model, vis = tiny(shared_kv_update=shared), regions()
    enc = model.encode(vis)
    embedded = model.embed_items(vis.feats)
    attended = masked_mean(embedded, vis.mask)  # v̂^(0) = v̄ over the real regions
    image_vectors, keys, values = [attended], embedded, embedded  # K^(0) = V^(0) = V
    for layer in model.encoder:
        attended = layer.attention(attended, keys, values, vis.mask).attended  # Eq. 7
        new_values = layer.value_update(attended, values)  # Eq. 8
        keys = new_values if layer.key_update is None else layer.key_update(attended, keys)
        values = new_values
        image_vectors.append(attended)
    # separate W^k_m in every layer but the last, whose keys K^(1+M) feed nothing
    assert [layer.key_update is not None for layer in model.encoder] == [not shared, False]
    torch.testing.assert_close(enc["global"], model.global_embed(torch.cat(image_vectors, -1)))  # Eq. 10
    # the decoder block's keys and values are V^(1+M), embedded once per image and laid out by head [B, H, N, d]

    def by_head(embedded):
        return embedded.unflatten(-1, (model.attention.heads, -1)).transpose(1, 2)

    torch.testing.assert_close(enc["keys"], by_head(model.attention.key_embed(values)))
    torch.testing.assert_close(enc["values"], by_head(model.attention.value_embed(values)))


@pytest.mark.parametrize("lstm_input", ["concat", "sum"])
def test_step_matches_the_decoder_equations(lstm_input):
    model, vis = tiny(lstm_input=lstm_input, hidden_dim=32), regions()
    enc = model.encode(vis)
    state = {name: torch.randn(3, 32) for name in ("h", "m", "context")}
    prev = torch.tensor([1, 5, 7])
    logprobs, new_state, record = model.step(prev, state, enc)
    visual = (torch.cat([enc["global"], state["context"]], 1) if lstm_input == "concat"
              else enc["global"] + state["context"])
    h, m = model.lstm(torch.cat([model.embed_words(prev), visual], 1), (state["h"], state["m"]))
    block = model.attention.attend(h, enc["keys"], enc["values"], enc["mask"])  # v̂_d = F(V, V, h_t)
    gate_input = torch.cat([block.attended, h], 1)
    linear, half = model.context_gate, 32
    context = ((linear.weight[:half] @ gate_input.T).T + linear.bias[:half]) * torch.sigmoid(
        (linear.weight[half:] @ gate_input.T).T + linear.bias[half:])  # c_t = GLU(W_c [v̂_d; h_t] + b_c)
    torch.testing.assert_close(new_state["h"], h)
    torch.testing.assert_close(new_state["m"], m)
    torch.testing.assert_close(new_state["context"], context)
    torch.testing.assert_close(logprobs, model.logit(context).log_softmax(-1))
    torch.testing.assert_close(record.primary, block.spatial.mean(1))
    torch.testing.assert_close(record.extras["heads"], block.spatial)
    torch.testing.assert_close(record.extras["channel_attn"], block.channel)
    assert record.extras["heads"].shape == (3, 4, ITEMS) and record.extras["channel_attn"].shape == (3, 32)


def test_step_drops_out_the_fed_back_context_the_block_output_and_c_t():
    """The authors' code's decoder dropout (docs/decisions.md#x-lan--x-transformer): on ``c_{t−1}`` fed back, on the
    block output ``v̂_d`` before the GLU and on ``c_t`` before ``W_p``, in that order and nowhere else."""
    model, vis = tiny(), regions()
    enc = model.encode(vis)
    state = {name: torch.randn(3, 24) for name in ("h", "m", "context")}
    model.drop = RecordingDropout()
    _, new_state, _ = model.step(torch.tensor([1, 5, 7]), state, enc)
    block = model.attention.attend(new_state["h"], enc["keys"], enc["values"], enc["mask"])
    previous, attended, context = model.drop.inputs
    assert previous is state["context"] and context is new_state["context"]
    torch.testing.assert_close(attended, block.attended)


@pytest.mark.parametrize("lstm_input", ["concat", "sum"])
def test_a_fed_back_context_dropped_out_whole_feeds_nothing_into_the_lstm(lstm_input):
    """``c_{t−1}`` reaches the LSTM only through the dropout, whether concatenated beside ṽ or added to it as the
    authors' code does (``lstm_input="sum"``, the setting ``captioner import xlan`` gives): with that dropout
    zeroing everything, a step from any context is the step from a zero context.  A sum that took the context
    from the state rather than the dropped-out one trained the imported models without their decoder dropout."""
    model, vis = tiny(lstm_input=lstm_input, hidden_dim=32), regions()
    enc = model.encode(vis)
    model.drop = torch.nn.Dropout(1.0).train()  # zeroes whatever it is given
    state = {name: torch.randn(3, 32) for name in ("h", "m", "context")}
    logprobs, new_state, _ = model.step(torch.tensor([1, 5, 7]), state, enc)
    zero_context = {**state, "context": torch.zeros(3, 32)}
    again, again_state, _ = model.step(torch.tensor([1, 5, 7]), zero_context, enc)
    torch.testing.assert_close(new_state["h"], again_state["h"])
    torch.testing.assert_close(logprobs, again)


def test_initial_state_is_zero():
    model = tiny()
    state = model.init_state(model.encode(regions()))
    assert set(state) == {"h", "m", "context"} and all(torch.all(v == 0) for v in state.values())


def test_padded_regions_get_no_attention_and_change_nothing():
    model, vis = tiny(), regions()
    tokens = torch.tensor([[5, 6, 7]] * 3)
    logps, records = stepwise(model, vis, tokens)
    for record in records:
        assert torch.all(record.primary[~vis.mask] == 0)
        assert torch.all(record.extras["heads"].masked_select(~vis.mask[:, None]) == 0)
        torch.testing.assert_close(record.primary.sum(-1), torch.ones(3))
    noisy = VisualBatch(vis.feats.masked_fill(~vis.mask[..., None], 50.0), vis.mask)
    torch.testing.assert_close(stepwise(model, noisy, tokens)[0], logps)
    # grid features: every item real
    grid = VisualBatch.from_features(vis.feats)
    _, records = stepwise(model, grid, tokens)
    assert all((r.primary > 0).all() for r in records)


def test_beam_search_attention_lines_up_with_tokens():
    model, vis = tiny(), regions()
    model.logit.bias.data[model.eos_id] += 2.0  # let some captions end inside max_len
    for _, _, hyp, records in rescored_beams(model, vis):
        torch.testing.assert_close(hyp.extras["heads"], torch.cat([r.extras["heads"] for r in records]))


def test_beam_one_equals_greedy():
    model, vis = tiny(), regions()
    assert_beam_one_is_greedy(model, vis, max_len=8)


def test_checkpoint_round_trip(tmp_path):
    model, vis = tiny(lstm_input="sum", hidden_dim=32, group_norm=True), regions()
    assert_checkpoint_round_trip(model, vis, tmp_path / "xlan")


def test_forward_xe_reaches_every_parameter_and_supports_scheduled_sampling():
    model = tiny(dropout=0.5, shared_kv_update=False, group_norm=True).train()
    captions = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 0], [4, 2, 0, 0]])
    logprobs, aux = model.forward_xe(regions(), captions, ss_prob=0.5)
    assert logprobs.shape == (3, 4, VOCAB) and aux == {}
    F.nll_loss(logprobs.flatten(0, 1), captions.flatten(), ignore_index=0).backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert missing == [], missing


def test_memorises_ten_captions():
    # 16 items per image: the bilinear maps are [B, N, D_B] per query, and 16 is plenty to tell 10 images apart
    vis, targets, captions = memorisation_task(items=16)
    torch.manual_seed(0)
    model = create("xlan", vocab_size=MEMO_VOCAB, feat_dim=32, dim=32, hidden_dim=32, embed_dim=16, channel_dim=16,
                   heads=4, encoder_layers=2, dropout=0.0, attention_dropout=0.0, update_dropout=0.0)
    loss = train_to_memorise(model, vis, targets, steps=200)
    cider, exact, hyps = memorisation_cider(model, vis, captions)
    assert exact >= 9 and cider > 2.0, (exact, cider, loss)
    assert all(torch.allclose(h.attention.sum(-1), torch.ones(len(h.token_ids))) for h in hyps)
