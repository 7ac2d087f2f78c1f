"""AoANet (Huang et al. 2019, arXiv:1908.06954): AoA and the refiner against naive equations, the decoder step
against AoANet Eq. 11–14, masking, the shared decoder's alignment rule, checkpoints, gradients, ablation flags and
memorisation."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from captioner.models.aoanet import AOA_QUERIES, LAYER_NORMS, WORD_EMBEDDINGS, StdLayerNorm
from captioner.models.attention.aoa import AttentionOnAttention
from captioner.models.attention.multihead import multi_head_attention
from captioner.models.decoding import beam_search
from captioner.models.protocol import VisualBatch
from captioner.models.zoo import available, create

from .model_checks import (VOCAB as MEMO_VOCAB, assert_beam_one_is_greedy, assert_checkpoint_round_trip,
                          constructor_arguments, RecordingDropout, memorisation_cider, memorisation_task,
                          rescored_beams, train_to_memorise)

# tiny tensors gain nothing from a second thread, and on a busy machine waiting for it dominates
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, FEAT = 23, 10
ABLATIONS = {  # AoANet Table 4 rows
    "base": dict(refiner="none", decoder_attention="additive", context="linear"),
    "refine-without-aoa": dict(refiner="transformer", decoder_attention="additive", context="linear"),
    "dec-lstm": dict(refiner="none", decoder_attention="additive", context="lstm"),
    "dec-mh-att-aoa": dict(refiner="none", context="aoa"),
    "full-pre-norm": dict(pre_norm=True),
    "transformer-pre-norm-mh-lstm": dict(refiner="transformer", pre_norm=True, context="lstm"),
}


def tiny(dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=VOCAB, feat_dim=FEAT, d_model=16, embed_dim=12, heads=4, refine_layers=2, ffn_dim=24,
                  dropout=0.0, attention_dropout=0.0, aoa_dropout=0.0)
    return create("aoanet", **{**config, **overrides}).to(dtype).eval()


def padded_visuals(dtype=torch.float32, seed=1) -> VisualBatch:
    """Three images with 7, 4 and 2 real items; the padding holds large garbage that must not matter."""
    generator = torch.Generator().manual_seed(seed)
    feats = torch.randn(3, 7, FEAT, generator=generator, dtype=dtype)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 4:] = mask[2, 2:] = False
    feats[~mask] = 1e3 * torch.randn(int((~mask).sum()), FEAT, generator=generator, dtype=dtype)
    return VisualBatch(feats, mask)


def grid_visuals(batch=3, seed=2) -> VisualBatch:
    return VisualBatch.from_features(torch.randn(batch, 9, FEAT, generator=torch.Generator().manual_seed(seed)))


def naive_aoa(aoa: AttentionOnAttention, attended, query):
    """AoANet Eq. 3–5 with the four D×D blocks of the fused weight (rows: information | gate; columns: v̂ | q)."""
    d, w, b = aoa.dim, aoa.linear.weight, aoa.linear.bias
    information = w[:d, :d] @ attended + w[:d, d:] @ query + b[:d]
    gate = torch.sigmoid(w[d:, :d] @ attended + w[d:, d:] @ query + b[d:])
    return gate * information


def naive_layer_norm(x, norm):
    return (x - x.mean()) / torch.sqrt(x.var(unbiased=False) + norm.eps) * norm.weight + norm.bias


def naive_heads(query, keys, values, real, heads):
    """f_mh-att for ONE query (AoANet Eq. 8–10), head by head over the real items only; returns (v̂, weights [H, N])."""
    d = query.shape[0] // heads
    attended, weights = [], torch.zeros(heads, keys.shape[0], dtype=query.dtype)
    for h in range(heads):
        s = slice(h * d, (h + 1) * d)
        scores = torch.stack([query[s] @ keys[j, s] / math.sqrt(d) for j in real])
        alpha = scores.softmax(0)
        weights[h, real] = alpha
        attended.append(sum(alpha[n] * values[j, s] for n, j in enumerate(real)))
    return torch.cat(attended), weights


def merged_heads(split):
    """``[H, N, d]`` → ``[N, H·d]``: one image's keys or values as stored in the encoder state, heads concatenated."""
    return split.transpose(0, 1).flatten(1)


# -- the AoA module ------------------------------------------------------------------------------------------------
def test_aoa_glu_equals_two_matrix_form():
    """Linear(2D, 2D) + GLU is AoANet Eq. 3–4 with the weights mapped blockwise."""
    torch.manual_seed(0)
    dim, query_dim = 5, 3
    w_iv, w_iq, w_gv, w_gq = (torch.randn(dim, n, dtype=torch.float64) for n in (dim, query_dim, dim, query_dim))
    b_i, b_g = torch.randn(dim, dtype=torch.float64), torch.randn(dim, dtype=torch.float64)
    aoa = AttentionOnAttention(dim, query_dim).double()
    with torch.no_grad():
        aoa.linear.weight.copy_(torch.cat([torch.cat([w_iv, w_iq], 1), torch.cat([w_gv, w_gq], 1)], 0))
        aoa.linear.bias.copy_(torch.cat([b_i, b_g]))
    attended, query = torch.randn(4, 2, dim, dtype=torch.float64), torch.randn(4, 2, query_dim, dtype=torch.float64)
    information = attended @ w_iv.T + query @ w_iq.T + b_i  # Eq. 3
    gate = torch.sigmoid(attended @ w_gv.T + query @ w_gq.T + b_g)  # Eq. 4
    torch.testing.assert_close(aoa(attended, query), gate * information)  # Eq. 5


def test_aoa_drops_out_its_input_not_its_output():
    """``input_dropout`` acts on ``[v̂; q]`` (the authors' refiner): with every entry dropped, the result is what the
    biases alone give, ``b^i ⊙ σ(b^g)``, not zero."""
    torch.manual_seed(0)
    aoa = AttentionOnAttention(4, input_dropout=1.0).train()
    got = aoa(torch.randn(3, 4), torch.randn(3, 4))
    torch.testing.assert_close(got, F.glu(aoa.linear.bias, dim=-1).expand(3, 4))


# -- encoder -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pre_norm", [False, True])
def test_refiner_layer_matches_naive_per_item_computation(pre_norm):
    """Eq. 7 (or its pre-norm variant) item by item, head by head, over the real items only."""
    model, vis = tiny(torch.float64, heads=2, pre_norm=pre_norm), padded_visuals(torch.float64)
    layer = model.refine[0]
    items = torch.randn(3, 7, 16, dtype=torch.float64)
    got = layer(items, vis.mask)
    for b in range(3):
        real = vis.mask[b].nonzero().flatten().tolist()
        x = torch.stack([naive_layer_norm(a, layer.norm) for a in items[b]]) if pre_norm else items[b]
        q, k, v = x @ layer.query.weight.T, x @ layer.key.weight.T, x @ layer.value.weight.T
        for i in real:
            attended, _ = naive_heads(q[i], k, v, real, heads=2)
            out = items[b, i] + naive_aoa(layer.aoa, attended, q[i])  # AoA^E's query is Q = W^{Q_e} A
            torch.testing.assert_close(got[b, i], out if pre_norm else naive_layer_norm(out, layer.norm))


def test_encoder_stacks_refiner_layers_and_masked_mean():
    model, vis = tiny(torch.float64, refine_layers=3, pre_norm=True), padded_visuals(torch.float64)
    enc = model.encode(vis)
    items = F.relu(model.embed_items(vis.feats))
    for layer in model.refine:
        items = layer(items, vis.mask)
    items = model.refine_norm(items)  # pre-norm ends with a LayerNorm
    for b in range(3):
        real = vis.mask[b]
        torch.testing.assert_close(enc["mean"][b], items[b, real].mean(0))  # ā over the real items (Eq. 12)
        # stored split into heads, [H, N, d] per image: the layout every decoding step reads
        torch.testing.assert_close(merged_heads(enc["keys"][b])[real], items[b, real] @ model.key.weight.T)
        torch.testing.assert_close(merged_heads(enc["values"][b])[real], items[b, real] @ model.value.weight.T)


def test_encoder_drops_out_the_embedded_items():
    """The authors' code's 0.5 on ``a_i = ReLU(W_r r_i + b_r)`` before refining (docs/decisions.md#aoanet-dropout);
    the refiner layers have dropouts of their own."""
    model, vis = tiny(), padded_visuals()
    model.drop = RecordingDropout()
    model.encode(vis)
    assert len(model.drop.inputs) == 1
    torch.testing.assert_close(model.drop.inputs[0], F.relu(model.embed_items(vis.feats)))


def test_refiner_drops_out_its_attention_weights_its_residual_branch_and_its_aoa_input():
    """The authors' refiner (docs/decisions.md#aoanet-dropout): 0.1 on the attention weights of the weighted sum
    and on the branch added to the residual, 0.3 on AoA's input ``[v̂; Q]``. Tests build their models with dropout
    0, where a dropout moved or dropped changes no output."""
    model, vis = tiny(), padded_visuals()
    layer = model.refine[0]
    layer.drop, layer.aoa.input_dropout = RecordingDropout(), RecordingDropout()
    items = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(4))
    out = layer(items, vis.mask)
    query = layer.query(items)
    attended, weights = multi_head_attention(query, layer.key(items), layer.value(items), 4, vis.mask)
    aoa_input = torch.cat([attended, query], -1)
    branch = F.glu(layer.aoa.linear(aoa_input), dim=-1)
    assert len(layer.drop.inputs) == 2 and len(layer.aoa.input_dropout.inputs) == 1
    torch.testing.assert_close(layer.drop.inputs[0], weights)
    torch.testing.assert_close(layer.aoa.input_dropout.inputs[0], aoa_input)
    torch.testing.assert_close(layer.drop.inputs[1], branch)
    torch.testing.assert_close(out, layer.norm(items + branch))


def test_each_dropout_rate_reaches_its_own_places():
    """``dropout``, ``attention_dropout`` and ``aoa_dropout`` (0.5, 0.1, 0.3: docs/decisions.md#aoanet-dropout) each
    reach the dropouts the authors' code gives them, and AoA^D's input is not dropped out; the "Refine w/o AoA"
    ablation's layers take ``attention_dropout`` too."""
    model = tiny(dropout=0.25, attention_dropout=0.125, aoa_dropout=0.375)
    assert (model.drop.p, model.attention_drop.p, model.aoa.input_dropout.p) == (0.25, 0.125, 0.0)
    assert [(layer.drop.p, layer.aoa.input_dropout.p) for layer in model.refine] == [(0.125, 0.375)] * 2
    transformer = tiny(refiner="transformer", attention_dropout=0.125)
    for layer in transformer.refine:
        assert layer.self_attn.dropout == 0.125
        assert {m.p for m in layer.modules() if isinstance(m, torch.nn.Dropout)} == {0.125}


# -- decoder -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads", [1, 4])
def test_step_matches_naive_equations(heads):
    """One decoder step from a random state: Eq. 12–14 and 11, the LSTM written out gate by gate."""
    model, vis = tiny(torch.float64, heads=heads), padded_visuals(torch.float64)
    enc = model.encode(vis)
    generator = torch.Generator().manual_seed(3)
    state = {name: torch.randn(3, 16, generator=generator, dtype=torch.float64) for name in ("h", "m", "context")}
    prev = torch.tensor([1, 5, 7])
    logprobs, new_state, record = model.step(prev, state, enc)
    lstm = model.lstm
    for b in range(3):
        real = vis.mask[b].nonzero().flatten().tolist()
        x = torch.cat([model.embed_words.weight[prev[b]], enc["mean"][b] + state["context"][b]])  # Eq. 12
        gates = lstm.weight_ih @ x + lstm.bias_ih + lstm.weight_hh @ state["h"][b] + lstm.bias_hh
        i, f, g, o = gates.chunk(4)  # PyTorch's gate order
        m = torch.sigmoid(f) * state["m"][b] + torch.sigmoid(i) * torch.tanh(g)  # Eq. 13
        h = torch.sigmoid(o) * torch.tanh(m)
        query = model.query.weight @ h  # W^{Q_d} h_t
        attended, weights = naive_heads(query, merged_heads(enc["keys"][b]), merged_heads(enc["values"][b]), real,
                                        heads)
        context = naive_aoa(model.aoa, attended, query)  # Eq. 14
        torch.testing.assert_close(new_state["h"][b], h)
        torch.testing.assert_close(new_state["m"][b], m)
        torch.testing.assert_close(new_state["context"][b], context)
        torch.testing.assert_close(logprobs[b], (model.logit.weight @ context).log_softmax(0))  # Eq. 11
        torch.testing.assert_close(record.primary[b], weights.mean(0))  # exported: mean over heads
        if heads > 1:
            torch.testing.assert_close(record.extras["heads"][b], weights)
        else:
            assert record.extras == {}


def test_step_drops_out_the_fed_back_and_the_output_context():
    """The authors' code's decoder dropout (docs/decisions.md#aoanet-dropout): on ``c_{t−1}`` fed back into Eq. 12
    and on ``c_t`` before ``W_p``, nothing else; the attention weights have their own."""
    model, vis = tiny(), padded_visuals()
    enc = model.encode(vis)
    state = {name: torch.randn(3, 16) for name in ("h", "m", "context")}
    model.drop, model.attention_drop = RecordingDropout(), RecordingDropout()
    _, new_state, record = model.step(torch.tensor([1, 5, 7]), state, enc)
    assert len(model.drop.inputs) == 2
    assert model.drop.inputs[0] is state["context"] and model.drop.inputs[1] is new_state["context"]
    # and the attention_dropout (0.1) on the weights of the weighted sum, [B', H, 1, N]: the exported heads
    assert len(model.attention_drop.inputs) == 1
    torch.testing.assert_close(model.attention_drop.inputs[0].squeeze(2), record.extras["heads"])


@pytest.mark.parametrize("context", ["linear", "lstm"])
def test_context_ablations_follow_figure_7(context):
    """Table 4's context ablations: Fig. 7a ``c_t = W[â_t; h_t] + b``; Fig. 7b ``c_t`` is the hidden state of a
    second LSTM on ``[â_t; h_t]`` that carries its own state (h_ctx, m_ctx), not the first LSTM's."""
    model, vis = tiny(torch.float64, context=context), padded_visuals(torch.float64)
    enc = model.encode(vis)
    generator = torch.Generator().manual_seed(3)
    state = {name: torch.randn(3, 16, generator=generator, dtype=torch.float64) for name in model.init_state(enc)}
    logprobs, new_state, _ = model.step(torch.tensor([1, 5, 7]), state, enc)
    attended, _, _ = model.attend(new_state["h"], enc)
    both = torch.cat([attended, new_state["h"]], 1)  # [â_t; h_t]
    if context == "linear":
        context_t = both @ model.context_linear.weight.T + model.context_linear.bias
    else:
        context_t, memory = model.context_lstm(both, (state["h_ctx"], state["m_ctx"]))
        torch.testing.assert_close(new_state["m_ctx"], memory)
    torch.testing.assert_close(model.previous_context(new_state), context_t)
    torch.testing.assert_close(logprobs, (context_t @ model.logit.weight.T).log_softmax(-1))


@pytest.mark.parametrize("pre_norm", [False, True])
def test_transformer_refiner_ablation_follows_pre_norm(pre_norm):
    """The "Refine w/o AoA" ablation (Fig. 6a) takes the AoA refiner's residual style: pre-norm layers and a final
    LN with ``pre_norm``, post-norm layers and no final LN without."""
    model = tiny(refiner="transformer", pre_norm=pre_norm)
    assert [layer.norm_first for layer in model.refine] == [pre_norm] * 2
    assert isinstance(model.refine_norm, torch.nn.LayerNorm) == pre_norm


@pytest.mark.parametrize("name", ["full", "refine-without-aoa", "base"])
def test_padded_items_get_zero_attention_and_change_nothing(name):
    """Region features: padding gets exactly zero weight, rows sum to 1, and a padded image decodes exactly like
    the same image without padding (so refiner, masked mean and decoder all ignore the padding)."""
    model, vis = tiny(**ABLATIONS.get(name, {})), padded_visuals()
    enc = model.encode(vis)
    state, prev = model.init_state(enc), torch.tensor([model.bos_id] * 3)
    for b, n_real in enumerate((7, 4, 2)):
        alone = VisualBatch.from_features(vis.feats[b:b + 1, :n_real])  # grid-style all-True mask
        alone_enc = model.encode(alone)
        alone_state, alone_prev = model.init_state(alone_enc), prev[:1]
        batch_state, batch_prev = state, prev
        for token in (5, 9, 4):
            logprobs, batch_state, record = model.step(batch_prev, batch_state, enc)
            alone_logprobs, alone_state, alone_record = model.step(alone_prev, alone_state, alone_enc)
            assert torch.all(record.primary[b, n_real:] == 0)
            for heads_map in record.extras.values():
                assert torch.all(heads_map[b, :, n_real:] == 0)
            torch.testing.assert_close(record.primary.sum(-1), torch.ones(3))
            torch.testing.assert_close(record.primary[b, :n_real], alone_record.primary[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logprobs[b], alone_logprobs[0], atol=1e-5, rtol=1e-5)
            batch_prev, alone_prev = torch.full((3,), token), torch.tensor([token])


@torch.no_grad()
def _teacher_forced_attention(model, vis, token_ids, row):
    single = VisualBatch(vis.feats[row:row + 1], vis.mask[row:row + 1])
    enc = model.encode(single)
    state, prev, rows = model.init_state(enc), torch.tensor([model.bos_id]), []
    for token in token_ids:
        _, state, record = model.step(prev, state, enc)
        rows.append((record.primary[0], record.extras["heads"][0]))
        prev = torch.tensor([token])
    return torch.stack([p for p, _ in rows]), torch.stack([h for _, h in rows])


@pytest.mark.parametrize("vis", [padded_visuals(), grid_visuals()], ids=["regions", "grid"])
def test_beam_search_attention_is_aligned_with_tokens(vis):
    model = tiny()
    for row, hyps in enumerate(beam_search(model, vis, k=3, max_len=6, n_best=2)):
        for hyp in hyps:
            steps = len(hyp.token_ids)
            primary, heads = _teacher_forced_attention(model, vis, hyp.token_ids, row)
            assert hyp.attention.shape == (steps, vis.feats.shape[1]) and hyp.extras["heads"].shape[:2] == (steps, 4)
            torch.testing.assert_close(hyp.attention, primary, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(hyp.extras["heads"], heads, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(hyp.attention.sum(-1), torch.ones(steps))
            assert torch.all(hyp.attention[:, ~vis.mask[row]] == 0)


def test_beam_one_equals_greedy():
    model, vis = tiny(), padded_visuals()
    assert_beam_one_is_greedy(model, vis, max_len=8)


@pytest.mark.parametrize("name", ["dec-lstm", "transformer-pre-norm-mh-lstm", "full-pre-norm"])
def test_decoder_state_holds_every_tensor_once_and_beams_stay_aligned(name):
    """Beam search reorders every state entry, so a tensor kept under two keys is copied twice per step.  With
    ``context="lstm"`` the context c_t is the context LSTM's hidden state: it must live under one key only.  The
    beams must still re-score to the same tokens, log-probs and attention step by step."""
    model, vis = tiny(**ABLATIONS[name]), padded_visuals()
    state = model.init_state(model.encode(vis))
    for _ in range(3):
        _, state, _ = model.step(torch.full((3,), 5), state, model.encode(vis))
        tensors = list(state.values())
        assert not any(a is b or torch.equal(a, b) for i, a in enumerate(tensors) for b in tensors[i + 1:]), \
            sorted(state)
    for _ in rescored_beams(model, vis, max_len=6, tolerance=dict(atol=1e-5, rtol=1e-5)):
        pass


# -- model plumbing ------------------------------------------------------------------------------------------------
def test_registered_with_paper_defaults_and_config_round_trip():
    assert "aoanet" in available()
    model = tiny(context="lstm", pre_norm=True)
    assert model.arch == "aoanet" and model.attention_kind == "multihead_attention"
    assert model.selection_metric == "CIDEr-D"
    config = json.loads(json.dumps(model.config()))
    assert create("aoanet", **config).config() == model.config()
    with torch.device("meta"):
        paper = create("aoanet", vocab_size=VOCAB, feat_dim=2048)  # defaults are the paper's sizes
    assert (paper.lstm.hidden_size, paper.embed_words.embedding_dim, paper.heads, len(paper.refine)) == \
        (1024, 1024, 8, 6)
    dropouts = paper.hparams["dropout"], paper.hparams["attention_dropout"], paper.hparams["aoa_dropout"]
    assert dropouts == (0.5, 0.1, 0.3)  # docs/decisions.md#aoanet-dropout
    for bad in (dict(refiner="ffn"), dict(context="gru"), dict(decoder_attention="dot")):
        with pytest.raises(ValueError):
            create("aoanet", vocab_size=5, feat_dim=4, **bad)


def test_checkpoint_round_trip_gives_identical_captions(tmp_path):
    model, vis = tiny(context="lstm"), padded_visuals()
    assert_checkpoint_round_trip(model, vis, tmp_path / "aoanet")


def test_gradcheck_tiny_float64_model():
    model, vis = tiny(torch.float64, d_model=8, embed_dim=6, heads=2), padded_visuals(torch.float64)
    feats = vis.feats[:2, :5].clone().requires_grad_()
    mask = vis.mask[:2, :5]
    captions = torch.tensor([[5, 6, 2], [8, 2, 0]])

    def loss_of(f):
        logprobs, _ = model.forward_xe(VisualBatch(f, mask), captions)
        return logprobs.gather(-1, captions.unsqueeze(-1)).sum()

    assert torch.autograd.gradcheck(loss_of, (feats,), eps=1e-6, atol=1e-5)
    loss_of(feats).backward()
    assert torch.all(feats.grad[~mask] == 0)  # padded items are outside the computation graph's reach


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_ablation_variants_train_and_decode(name):
    model = tiny(**ABLATIONS[name]).train()
    captions = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 0], [4, 2, 0, 0]])
    logprobs, aux = model.forward_xe(padded_visuals(), captions, ss_prob=0.5)
    assert logprobs.shape == (3, 4, VOCAB) and aux == {}
    F.nll_loss(logprobs.flatten(0, 1), captions.flatten(), ignore_index=0).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert missing == [], missing
    hyps = beam_search(model.eval(), padded_visuals(), k=2, max_len=5)
    for row, (hyp,) in enumerate(hyps):
        torch.testing.assert_close(hyp.attention.sum(-1), torch.ones(len(hyp.token_ids)))
        assert torch.all(hyp.attention[:, ~padded_visuals().mask[row]] == 0)


def test_memorises_ten_images():
    """Memorisation smoke test: 10 images of random features with fixed random captions are memorised."""
    vis, targets, captions = memorisation_task()
    torch.manual_seed(0)
    model = create("aoanet", vocab_size=MEMO_VOCAB, feat_dim=32, d_model=32, embed_dim=32, heads=4, refine_layers=2,
                   dropout=0.0, attention_dropout=0.0, aoa_dropout=0.0)
    loss = train_to_memorise(model, vis, targets)
    cider, exact, _ = memorisation_cider(model, vis, captions)
    assert exact == 10 and cider > 2.0, (exact, cider, loss)


def test_word_embedding_relu_dropout_drops_out_the_embedded_word():
    """``word_embedding="relu_dropout"`` is the authors' Embedding → ReLU → Dropout
    (docs/decisions.md#aoanet-reference-compatibility-flags): with it, the decoder's ``dropout`` also reaches
    ``ReLU(W_e Π_t)``, between the fed-back and the output context."""
    model, vis = tiny(word_embedding="relu_dropout"), padded_visuals()
    enc = model.encode(vis)
    state = {name: torch.randn(3, 16) for name in ("h", "m", "context")}
    model.drop = RecordingDropout()
    prev = torch.tensor([1, 5, 7])
    model.step(prev, state, enc)
    assert len(model.drop.inputs) == 3
    torch.testing.assert_close(model.drop.inputs[1], F.relu(model.embed_words(prev)))


def test_pre_norm_without_refiner_layers_adds_no_final_norm():
    """The final LN closes a pre-norm stack's un-normalised residual stream; with ``refiner="none"`` there is no
    stack, and the items go to the decoder as embedded."""
    model, vis = tiny(refiner="none", pre_norm=True), padded_visuals()
    enc = model.encode(vis)
    items = F.relu(model.embed_items(vis.feats))
    torch.testing.assert_close(enc["mean"], torch.stack([items[b, vis.mask[b]].mean(0) for b in range(3)]))


def test_additive_attention_weighs_the_refined_items_themselves():
    """The ablations' single attention (docs/decisions.md#aoanet-ablation-attention): ``w^T tanh(U a_i + W h_t)``
    scores the items, and ``â_t = Σ_i α_i a_i`` sums the items themselves, not their projections ``U a_i``."""
    model, vis = tiny(**ABLATIONS["base"]), padded_visuals()
    enc = model.encode(vis)
    h = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))
    attended, query, weights = model.attend(h, enc)
    items = F.relu(model.embed_items(vis.feats))  # refiner "none": the embedded items
    assert query is h and weights.shape == (3, 1, 7)
    torch.testing.assert_close(attended, (weights[:, 0, :, None] * items).sum(1))


@pytest.mark.parametrize("option", ["word_embedding", "aoa_query", "layer_norm"])
def test_reference_compatibility_options_refuse_unknown_values(option):
    """A misspelt value must not select a variant in silence (``layer_norm="Torch"`` would otherwise build the
    authors' StdLayerNorm, ``word_embedding="relu-dropout"`` the plain embedding).  The message names the option
    the user mistyped and is held whole: a search for the option's name also finds it inside another name."""
    choices = dict(word_embedding=WORD_EMBEDDINGS, aoa_query=AOA_QUERIES, layer_norm=LAYER_NORMS)[option]
    with pytest.raises(ValueError) as refused:
        create("aoanet", vocab_size=5, feat_dim=4, **{option: "unknown"})
    assert str(refused.value) == f"{option} must be one of {choices}, got 'unknown'"


def test_config_holds_every_constructor_argument():
    """A checkpoint rebuilds its model from ``config()``: an argument missing there comes back at its default (a
    "Refine w/o AoA" model with another ``ffn_dim`` would not even load its weights).  The compatibility flags are
    recorded only when set, so all of them are set here."""
    model = tiny(refiner="transformer", ffn_dim=20, query_norm=True, word_embedding="relu_dropout",
                 projection_bias=True, aoa_query="input", layer_norm="std")
    arguments = constructor_arguments(model)
    assert set(model.config()) == arguments
    again = create("aoanet", **json.loads(json.dumps(model.config())))
    assert {k: v.shape for k, v in again.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}


def test_config_records_a_compatibility_option_only_when_it_is_set():
    """docs/decisions.md#aoanet-reference-compatibility-flags: a model with the paper's defaults writes the config it
    wrote before the options existed (a checkpoint's ``config.json`` and card stay as they were, and an earlier
    release, whose AoANet takes none of these arguments, still loads it); each option set alone adds itself only."""
    compatibility = {"query_norm", "word_embedding", "projection_bias", "aoa_query", "layer_norm"}
    paper = tiny().config()
    assert set(paper) == constructor_arguments(tiny()) - compatibility
    set_alone = dict(query_norm=True, word_embedding="relu_dropout", projection_bias=True)
    set_alone.update(aoa_query="input", layer_norm="std")
    for option, value in set_alone.items():
        assert tiny(**{option: value}).config() == {**paper, option: value}


def test_std_layer_norm_is_the_authors_with_epsilon_outside_the_root():
    """``layer_norm="std"``: the authors' ``a_2 ⊙ (x − mean) / (std + 1e-6) + b_2`` with the unbiased deviation.
    Checkpoints converted from their code agree to 2e-5 on ordinary activations, where ε is invisible; a row of
    nearly equal values shows it."""
    norm = StdLayerNorm(4).double()
    x = torch.tensor([[0.0, 1e-6, 2e-6, 3e-6], [1.0, -2.0, 0.5, 4.0]], dtype=torch.float64)
    centred = x - x.mean(-1, keepdim=True)
    deviation = (centred.square().sum(-1, keepdim=True) / 3).sqrt()  # unbiased: D − 1 = 3
    torch.testing.assert_close(norm(x), centred / (deviation + 1e-6))
