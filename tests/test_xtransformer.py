"""X-Transformer (X-LAN paper, arXiv:2003.14080, §4.2; the authors' code's structure): incremental decoding = the
parallel teacher-forced pass, the decoder structure, masking, the shared decoder's alignment rule, checkpoint round
trip and the memorisation smoke test."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from captioner.models.attention.xlinear import ItemUpdate, XLinearAttention
from captioner.models.layers import masked_mean, sinusoid_positions
from captioner.models.protocol import VisualBatch
from captioner.models.zoo import available, create

from .model_checks import (VOCAB as MEMO_VOCAB, assert_beam_one_is_greedy, assert_checkpoint_round_trip,
                          constructor_arguments, RecordingDropout, memorisation_cider, memorisation_task,
                          rescored_beams, stepwise, train_to_memorise)

# tiny tensors gain nothing from a second thread, and on a busy machine waiting for it dominates
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, FEAT, ITEMS = 23, 16, 9
TOLERANCE = dict(atol=1e-5, rtol=1e-5)  # cached incremental decoding vs the step loop
CAPTIONS = torch.tensor([[5, 6, 7, 8, 2, 0], [9, 10, 2, 0, 0, 0], [11, 12, 13, 14, 15, 2]])


def tiny(**overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=VOCAB, feat_dim=FEAT, dim=32, channel_dim=16, heads=4, encoder_layers=2,
                  decoder_layers=3, ffn_dim=64, dropout=0.0, word_dropout=0.0, attention_dropout=0.0,
                  update_dropout=0.0)
    return create("xtransformer", **{**config, **overrides}).eval()


def regions(batch: int = 3, seed: int = 1, dtype=torch.float32) -> VisualBatch:
    """Padded region features: image 1 has 5 real regions, image 2 misses regions 0 and 6."""
    torch.manual_seed(seed)
    mask = torch.ones(batch, ITEMS, dtype=torch.bool)
    mask[1, 5:] = False
    mask[2, [0, 6]] = False
    return VisualBatch(torch.randn(batch, ITEMS, FEAT, dtype=dtype), mask)


def test_registered_and_config_round_trips():
    assert "xtransformer" in available()
    model = tiny(activation="relu", group_norm=True)
    assert model.arch == "xtransformer" and model.attention_kind == "xlinear_spatial_attention"  # GET /models
    config = json.loads(json.dumps(model.config()))
    again = create("xtransformer", **config)
    assert again.config() == model.config()
    assert {k: v.shape for k, v in again.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    # the last decoder layer's word states would feed nothing: no update, no FFN
    assert [layer.feed_forward is None for layer in model.decoder] == [False, False, True]


def test_default_dropouts_and_celu_are_the_authors():
    """The documented values of the authors' code: dropout 0.5 on the sublayer outputs, 0.1 on the word embedding and
    inside the X-Linear blocks, 0.3 in the item updates, and CELU's α = 1.3 (docs/decisions.md#x-lan-activation).
    The shipped recipe names no model argument, so these defaults are what ``captioner train --recipe
    xtransformer`` trains with."""
    torch.manual_seed(0)
    model = create("xtransformer", vocab_size=VOCAB, feat_dim=FEAT, dim=32, channel_dim=16, heads=4,
                   encoder_layers=1, decoder_layers=2, ffn_dim=64)
    assert model.drop.p == model.decoder[0].drop.p == model.encoder[0].output_dropout.p == 0.5
    assert model.word_drop.p == 0.1
    assert {block.dropout.p for block in model.modules() if isinstance(block, XLinearAttention)} == {0.1}
    assert {update.dropout.p for update in model.modules() if isinstance(update, ItemUpdate)} == {0.3}
    assert {celu.alpha for celu in model.modules() if isinstance(celu, nn.CELU)} == {1.3}


def test_a_celu_alpha_given_reaches_every_celu():
    """``--set celu_alpha=1.0`` (docs/decisions.md#x-lan-activation) is the α of every "+ELU" embedding: the regions',
    both halves of the first query and every X-Linear block's.  The default test cannot tell a CELU built without it
    from one built with it, since both are then 1.3."""
    model = tiny(celu_alpha=0.5)
    celus = [module for module in model.modules() if isinstance(module, nn.CELU)]
    assert len(celus) == len([m for m in tiny().modules() if isinstance(m, nn.CELU)])
    assert {celu.alpha for celu in celus} == {0.5}
    assert model.embed_items[1] in celus and model.query_image[1] in celus and model.query_words[1] in celus


def test_each_dropout_rate_reaches_its_own_places():
    """The sublayer ``dropout`` (0.5 in the authors' code) also sits on the embedded regions and inside and after
    every FFN block, encoder and decoder; the default test cannot tell it from the others there, so each rate is set
    apart here."""
    model = tiny(dropout=0.25, word_dropout=0.125, attention_dropout=0.0625, update_dropout=0.375)
    assert model.embed_items[3].p == 0.25
    blocks = [*model.encoder_ffn, *(layer.feed_forward for layer in model.decoder if layer.feed_forward is not None)]
    assert len(blocks) == 4
    assert {(block.drop.p, block.ffn[2].p) for block in blocks} == {(0.25, 0.25)}


@pytest.mark.parametrize("padded", [True, False])
def test_incremental_step_equals_parallel_forward(padded):
    model = tiny().double()
    vis = regions(dtype=torch.float64)
    if not padded:  # grid features: every item real
        vis = VisualBatch.from_features(vis.feats)
    parallel, aux = model.forward_xe(vis, CAPTIONS)
    assert parallel.shape == (3, 6, VOCAB) and aux == {}
    step_by_step, _ = stepwise(model, vis, CAPTIONS)
    torch.testing.assert_close(step_by_step, parallel, atol=1e-10, rtol=1e-10)
    model32 = tiny()
    torch.testing.assert_close(stepwise(model32, regions(), CAPTIONS)[0], model32.forward_xe(regions(), CAPTIONS)[0],
                               atol=1e-5, rtol=1e-5)


def test_encoder_and_first_step_follow_the_reference_structure():
    model, vis = tiny(decoder_layers=2), regions()
    enc = model.encode(vis)
    # encoder: g^(0) = masked mean; X-Linear layer (keys = values) + FFN per layer; g = LN(W_G [g^(0); …; g^(L)])
    items = model.embed_items(vis.feats)
    image_vectors = [masked_mean(items, vis.mask)]
    for layer, feed_forward in zip(model.encoder, model.encoder_ffn):
        attended = layer.attention(image_vectors[-1], items, items, vis.mask).attended
        items = feed_forward(layer.value_update(attended, items))
        image_vectors.append(attended)
    torch.testing.assert_close(enc["global"], model.global_embed(torch.cat(image_vectors, -1)))
    # first step, written out for one position (t = 0)
    words = model.word_norm(model.embed_words(torch.full((3,), model.bos_id)) * math.sqrt(32)
                            + sinusoid_positions(torch.tensor([0]), 32))
    query = model.query_image(enc["global"]) * model.query_words(words)  # x̄_0 = x_0
    queries, cross_maps, channel_maps = [query], [], []
    for i, layer in enumerate(model.decoder):
        words_seen = layer.word_attention(query, words[:, None], words[:, None]).attended  # only itself in the past
        mixed = words + words_seen
        cross = layer.cross_attention(layer.cross_query_norm(mixed), items, items, vis.mask)
        query = layer.output_norm(mixed + cross.attended)
        queries.append(query)
        cross_maps.append(cross.spatial)
        channel_maps.append(cross.channel)
        if layer.feed_forward is not None:
            words = layer.feed_forward(layer.word_update(query, words))
    expected = model.logit(model.output_norm(F.glu(model.output_embed(torch.cat(queries, -1)), -1))).log_softmax(-1)
    logprobs, _, record = model.step(torch.full((3,), model.bos_id), model.init_state(enc), enc)
    torch.testing.assert_close(logprobs, expected)
    # export: last layer's cross attention averaged over heads; every layer's map as an extra
    torch.testing.assert_close(record.primary, cross_maps[-1].mean(1))
    torch.testing.assert_close(record.extras["heads"], cross_maps[-1])
    torch.testing.assert_close(record.extras["layer1"], cross_maps[0].mean(1))
    torch.testing.assert_close(record.extras["channel_attn"], channel_maps[-1])  # the last layer's β^c
    assert set(record.extras) == {"heads", "layer1", "layer2", "channel_attn"}


def test_padded_regions_get_no_attention_and_change_nothing():
    model, vis = tiny(), regions()
    logps, records = stepwise(model, vis, CAPTIONS)
    for record in records:
        for weights in (record.primary, record.extras["layer1"], record.extras["layer2"]):
            assert torch.all(weights[~vis.mask] == 0)
            torch.testing.assert_close(weights.sum(-1), torch.ones(3))
        assert torch.all(record.extras["heads"].masked_select(~vis.mask[:, None]) == 0)
    noisy = VisualBatch(vis.feats.masked_fill(~vis.mask[..., None], 50.0), vis.mask)
    torch.testing.assert_close(stepwise(model, noisy, CAPTIONS)[0], logps)
    torch.testing.assert_close(model.forward_xe(noisy, CAPTIONS)[0], model.forward_xe(vis, CAPTIONS)[0])


def test_beam_search_attention_lines_up_with_tokens():
    model, vis = tiny(), regions()
    model.logit.bias.data[model.eos_id] += 2.0  # let some captions end inside max_len
    for single, tokens, hyp, _ in rescored_beams(model, vis, tolerance=TOLERANCE):
        # the parallel training pass scores the caption as the cached decoding did
        torch.testing.assert_close(torch.tensor(hyp.token_logprobs),
                                   model.forward_xe(single, tokens)[0][0].gather(1, tokens.T).squeeze(1), **TOLERANCE)


def test_beam_one_equals_greedy():
    model, vis = tiny(), regions()
    assert_beam_one_is_greedy(model, vis, max_len=8)


def test_checkpoint_round_trip(tmp_path):
    model, vis = tiny(), regions()
    assert_checkpoint_round_trip(model, vis, tmp_path / "xtransformer")


def test_forward_xe_reaches_every_parameter_and_refuses_scheduled_sampling():
    model = tiny(dropout=0.5, word_dropout=0.1, group_norm=True).train()
    logprobs, _ = model.forward_xe(regions(), CAPTIONS)
    F.nll_loss(logprobs.flatten(0, 1), CAPTIONS.flatten(), ignore_index=0).backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert missing == [], missing
    with pytest.raises(ValueError, match="scheduled sampling"):
        model.forward_xe(regions(), CAPTIONS, ss_prob=0.1)


def test_memorises_ten_captions():
    # 16 items per image: the bilinear maps are [B, N, D_B] per query, and 16 is plenty to tell 10 images apart
    vis, targets, captions = memorisation_task(items=16)
    torch.manual_seed(0)
    model = create("xtransformer", vocab_size=MEMO_VOCAB, feat_dim=32, dim=32, channel_dim=16, heads=4,
                   encoder_layers=2, decoder_layers=2, ffn_dim=64, dropout=0.0, word_dropout=0.0,
                   attention_dropout=0.0, update_dropout=0.0)
    loss = train_to_memorise(model, vis, targets, steps=200, lr=3e-3)
    cider, exact, hyps = memorisation_cider(model, vis, captions)
    assert exact >= 9 and cider > 2.0, (exact, cider, loss)
    assert all(torch.allclose(h.attention.sum(-1), torch.ones(len(h.token_ids))) for h in hyps)


def test_dropouts_sit_where_the_authors_code_puts_them():
    """The module docstring's dropouts: on the embedded regions, on the word states ``x_t``, on ``q^(0)``, on each
    decoder layer's word and cross attention outputs, inside and after each FFN block, and on the hidden vector
    before ``W_p``.  The other tests build their models with dropout 0, where a dropout dropped or moved changes no
    output, so each is replaced here by an identity that records what it is given."""
    model, vis = tiny(decoder_layers=2), regions()
    model.embed_items[3] = items_drop = RecordingDropout()
    model.word_drop, model.drop = RecordingDropout(), RecordingDropout()
    blocks = [*model.encoder_ffn, model.decoder[0].feed_forward]
    for block in blocks:
        block.drop, block.ffn[2] = RecordingDropout(), RecordingDropout()
    for layer in model.decoder:
        layer.drop = RecordingDropout()
    enc = model.encode(vis)
    torch.testing.assert_close(items_drop.inputs, [model.embed_items[:3](vis.feats)])
    assert [len(block.drop.inputs) for block in model.encoder_ffn] == [1, 1]
    assert [len(block.ffn[2].inputs) for block in model.encoder_ffn] == [1, 1]
    bos = torch.full((3,), model.bos_id)
    model.step(bos, model.init_state(enc), enc)
    words = model.word_norm(model.embed_words(bos) * math.sqrt(32) + sinusoid_positions(torch.tensor([0]), 32))
    torch.testing.assert_close(model.word_drop.inputs, [words[:, None]])
    first_query, hidden = model.drop.inputs  # q^(0), then LN(GLU(W_o [q^(0); …; q^(L)])) before W_p
    expected_query = model.query_image(enc["global"])[:, None] * model.query_words(words[:, None])
    torch.testing.assert_close(first_query, expected_query)
    assert hidden.shape == (3, 1, 32)
    assert [len(layer.drop.inputs) for layer in model.decoder] == [2, 2]  # word attention, cross attention
    assert (len(blocks[-1].drop.inputs), len(blocks[-1].ffn[2].inputs)) == (1, 1)


def test_config_holds_every_constructor_argument():
    """A checkpoint rebuilds its model from ``config()``: an argument missing there comes back at its default, so a
    model trained with ``--set celu_alpha=1.0`` (or any other non-default) would reload as another model."""
    model = tiny(celu_alpha=1.0, update_dropout=0.2, attention_dropout=0.05, word_dropout=0.15, dropout=0.25,
                 activation="relu", group_norm=True)
    arguments = constructor_arguments(model)
    assert set(model.config()) == arguments
    again = create("xtransformer", **json.loads(json.dumps(model.config())))
    assert {name: again.config()[name] for name in arguments} == {name: model.config()[name] for name in arguments}
