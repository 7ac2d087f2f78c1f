"""Faithfulness to the authors' published code: reference computations transcribed line by line (argument order
included) from the authors' repositories, compared with this project's modules at small sizes.

* Area attention against tensor2tensor ``tensor2tensor/layers/area_attention.py`` (``_compute_sum_image``,
  ``compute_area_features``, ``compute_area_key(mode="concat")``, ``dot_product_area_attention`` with its bias
  handling): area order, area features, the combined key, padding and causal masks.
* SAT soft attention against kelvinxu/arctic-captions ``capgen.py`` (``lstm_cond_layer._step`` with
  ``attn_type="deterministic"`` and ``selector=True``, the ``ff_state``/``ff_memory`` initial state and the
  ``prev2out``/``ctx2out`` readout): attention, gated context, LSTM state; the readout follows SAT Eq. 7, which has
  no tanh, where ``capgen.py`` applies ``logit = tanh(logit)`` before ``ff_logit``.
* The SCST loss against ruotianluo/self-critical.pytorch ``misc/utils.py`` (``RewardCriterion.forward(self,
  input, seq, reward)``) with the advantage of ``misc/rewards.py`` (``get_self_critical_reward``: ``scores[:batch_size]
  - scores[batch_size:]``, repeated over time), and against JDAI-CV/image-captioning ``losses/reward_criterion.py``
  (``RewardCriterion.forward(self, seq, logP, rewards)``), on captions drawn by :func:`decoding.sample`.

The AoANet, X-LAN and X-Transformer references transcribed from their authors' code live in
``tests/test_interop.py`` and ``tests/test_interop_xlan.py``.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from captioner.models.attention.area import AreaMultiHeadAttention
from captioner.models.decoding import sample
from captioner.models.protocol import VisualBatch
from captioner.models.training.scst import scst_advantages, scst_loss
from captioner.models.zoo import create

pytestmark = pytest.mark.usefixtures("one_thread")


# -- tensor2tensor layers/area_attention.py, transcribed to torch -------------------------------------------------
def t2t_compute_sum_image(features, max_area_width, max_area_height=1, height=1):
    """``_compute_sum_image(features, max_area_width, max_area_height=1, height=1)``: integral image, padded by one
    row and column, and the four-corner differences, area shapes in its loop order (height outer, width inner)."""
    batch_size, length, depth = features.shape
    width = length // height
    features_2d = features.reshape(batch_size, height, width, depth)
    width_cum = features_2d.cumsum(-2)
    integral_image = width_cum.cumsum(-3)
    padded_image = F.pad(integral_image, (0, 0, 1, 0, 1, 0))  # tf.pad [[0, 0], [1, 0], [1, 0], [0, 0]]
    size_tensor = torch.ones_like(padded_image[:, :, :, 0], dtype=torch.int64)
    dst_images, src_images_diag, src_images_h, src_images_v, height_list, width_list = [], [], [], [], [], []
    for area_height in range(max_area_height):
        for area_width in range(max_area_width):
            dst_images.append(padded_image[:, area_height + 1:, area_width + 1:, :].reshape(batch_size, -1, depth))
            src_images_diag.append(
                padded_image[:, :-area_height - 1, :-area_width - 1, :].reshape(batch_size, -1, depth))
            src_images_h.append(padded_image[:, area_height + 1:, :-area_width - 1, :].reshape(batch_size, -1, depth))
            src_images_v.append(padded_image[:, :-area_height - 1, area_width + 1:, :].reshape(batch_size, -1, depth))
            height_list.append((size_tensor[:, area_height + 1:, area_width + 1:] * (area_height + 1))
                               .reshape(batch_size, -1))
            width_list.append((size_tensor[:, area_height + 1:, area_width + 1:] * (area_width + 1))
                              .reshape(batch_size, -1))
    sum_image = ((torch.cat(dst_images, 1) + torch.cat(src_images_diag, 1))
                 - (torch.cat(src_images_v, 1) + torch.cat(src_images_h, 1)))
    return sum_image, torch.cat(height_list, 1)[..., None], torch.cat(width_list, 1)[..., None]


def t2t_compute_area_features(features, max_area_width, max_area_height=1, height=1, epsilon=1e-6):
    """``compute_area_features``: mean, std ``sqrt(|E[x²] − μ²| + ε)``, sum, heights, widths."""
    area_sum, area_heights, area_widths = t2t_compute_sum_image(features, max_area_width, max_area_height, height)
    area_squared_sum, _, _ = t2t_compute_sum_image(features ** 2, max_area_width, max_area_height, height)
    float_area_sizes = (area_heights * area_widths).to(features.dtype)
    area_mean = area_sum / float_area_sizes
    s2_n = area_squared_sum / float_area_sizes
    area_std = torch.sqrt((s2_n - area_mean ** 2).abs() + epsilon)
    return area_mean, area_std, area_sum, area_heights, area_widths


def t2t_compute_area_key_concat(features, max_area_width, max_area_height, height, height_emb, width_emb, dense1,
                                dense2):
    """``compute_area_key(..., mode="concat")``: ``[mean; std; [height_emb; width_emb]]`` → dense(relu) → dense,
    with ``area_height_emb``/``area_width_emb`` ``[max, depth // 2]`` and the two dense layers as ``(W, b)``
    pairs in TF's ``x @ W + b`` layout."""
    area_mean, area_std, _, area_heights, area_widths = t2t_compute_area_features(
        features, max_area_width, max_area_height, height)
    size_embed = torch.cat([height_emb[area_heights[:, :, 0] - 1], width_emb[area_widths[:, :, 0] - 1]], -1)
    feature_concat = torch.cat([area_mean, area_std, size_embed], -1)
    feature_hidden = torch.relu(feature_concat @ dense1[0] + dense1[1])
    return feature_hidden @ dense2[0] + dense2[1]


def t2t_dot_product_area_attention(q, k, v, bias, max_area_width, max_area_height, memory_height, key_fn):
    """``dot_product_area_attention(q, k, v, bias, ..., area_value_mode="sum")`` without dropout, temperature 1 and
    no top-k: ``q, k, v [batch, heads, length, depth]`` (``q`` already scaled by ``depth ** -0.5``, as
    ``multihead_attention`` does), ``bias [batch or 1, 1, length_q or 1, length_kv]`` (−1e9 = masked)."""
    batch_size, head_size, length, depth = k.shape
    k_area = key_fn(k.reshape(-1, length, depth))
    _, _, v_area, _, _ = t2t_compute_area_features(v.reshape(-1, length, depth), max_area_width, max_area_height,
                                                   memory_height)
    k = k_area.reshape(batch_size, head_size, -1, depth)
    v = v_area.reshape(batch_size, head_size, -1, depth)
    logits = q @ k.transpose(-1, -2)
    if bias is not None:
        bias_shape = bias.shape
        mem_length = bias_shape[-1]
        bias_values = (bias < -1).to(q.dtype).reshape(-1, mem_length, 1)
        _, _, padding_sum, _, _ = t2t_compute_area_features(bias_values, max_area_width, max_area_height,
                                                            memory_height)
        area_bias = torch.where(padding_sum.to(torch.int32).bool(), torch.full_like(padding_sum, -math.inf),
                                torch.zeros_like(padding_sum))
        logits = logits + area_bias.reshape(bias_shape[0], bias_shape[1], bias_shape[2], -1)
    weights = logits.softmax(-1)
    return weights @ v, weights


def _t2t_key_fn(attn, max_h, max_w, height):
    """The combined key of ``attn`` (our :class:`AreaKeyCombiner`) as tensor2tensor's ``concat`` key, or the mean
    key, with our weights moved into TF's layout."""
    if attn.combiner is None:
        return lambda k: t2t_compute_area_features(k, max_w, max_h, height)[0]
    comb = attn.combiner
    dense1 = (comb.hidden.weight.T, comb.hidden.bias)
    dense2 = (comb.out.weight.T, comb.out.bias)
    return lambda k: t2t_compute_area_key_concat(k, max_w, max_h, height, comb.height.weight, comb.width.weight,
                                                 dense1, dense2)


def _t2t_multihead(attn, query, memory, bias, max_h, max_w, height):
    """Our projections around ``t2t_dot_product_area_attention``: split heads, scale q, merge, output layer."""
    heads, d = attn.n_heads, attn.head_dim

    def split(x):
        return x.view(x.shape[0], x.shape[1], heads, d).transpose(1, 2)

    q = split(attn.q(query)) * d ** -0.5
    out, weights = t2t_dot_product_area_attention(q, split(attn.k(memory)), split(attn.v(memory)), bias, max_w,
                                                  max_h, height, _t2t_key_fn(attn, max_h, max_w, height))
    return attn.o(out.transpose(1, 2).flatten(2)), weights


@pytest.mark.parametrize("key_mode", ["mean", "combined"])
@pytest.mark.parametrize("rows,cols,max_h,max_w", [(3, 4, 2, 3), (4, 4, 3, 3), (2, 5, 3, 2)])
def test_area_attention_equals_tensor2tensor(key_mode, rows, cols, max_h, max_w):
    """Grid memory with padded cells: area order, area keys (mean or combined, shared by the heads), sum values,
    the padding rule (an area holding a padded cell is masked) and the output all equal tensor2tensor's.  (2, 5)
    with a 3-high maximum checks that areas taller than the grid are dropped as tensor2tensor's empty slices drop
    them."""
    torch.manual_seed(0)
    attn = AreaMultiHeadAttention(16, 4, (max_h, max_w), key_mode=key_mode).double()
    n = rows * cols
    memory, query = torch.randn(2, n, 16, dtype=torch.float64), torch.randn(2, 3, 16, dtype=torch.float64)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, [1, n - 1]] = False
    ours, our_weights = attn(query, memory, (rows, cols), mask)
    bias = (-1e9 * (~mask).to(torch.float64))[:, None, None, :]  # attention_bias_ignore_padding
    theirs, their_weights = _t2t_multihead(attn, query, memory, bias, max_h, max_w, rows)
    torch.testing.assert_close(our_weights, their_weights)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("key_mode", ["mean", "combined"])
def test_causal_caption_areas_equal_tensor2tensor(key_mode):
    """1D areas over the caption with the decoder's lower-triangle bias: tensor2tensor turns each query row of the
    bias into an area mask, so a span reaching a future position is masked; ours does the same."""
    torch.manual_seed(1)
    attn = AreaMultiHeadAttention(8, 2, (1, 3), key_mode=key_mode).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    ours, our_weights = attn(x, x, causal=True)
    future = ~torch.ones(6, 6, dtype=torch.bool).tril()
    bias = (-1e9 * future.to(torch.float64))[None, None]  # attention_bias_lower_triangle: [1, 1, L, L]
    theirs, their_weights = _t2t_multihead(attn, x, x, bias, 1, 3, 1)
    torch.testing.assert_close(our_weights, their_weights)
    torch.testing.assert_close(ours, theirs)


# -- kelvinxu/arctic-captions capgen.py, transcribed to torch -----------------------------------------------------
def _arctic_params(model):
    """Our SAT's weights in capgen.py's layout (``x @ W``; LSTM gates stacked i, f, o, c; the attention's hidden size
    is ``ctx_dim``, so the tiny model below uses ``attn_dim = feat_dim``)."""
    emb = model.embed.embedding_dim
    order = [0, 1, 3, 2]  # PyTorch i, f, g, o → capgen i, f, o, c(g)

    def gates(weight):  # [4·dim, in] (PyTorch) → [in, 4·dim] (capgen)
        return torch.cat([chunk for chunk in (weight.chunk(4, 0)[i] for i in order)], 0).T

    lstm, att = model.lstm, model.attend
    bias = lstm.bias_ih + lstm.bias_hh
    return {
        "ff_state_W": model.init_h.weight.T, "ff_state_b": model.init_h.bias,
        "ff_memory_W": model.init_c.weight.T, "ff_memory_b": model.init_c.bias,
        "decoder_W": gates(lstm.weight_ih[:, :emb]), "decoder_Wc": gates(lstm.weight_ih[:, emb:]),
        "decoder_U": gates(lstm.weight_hh), "decoder_b": torch.cat([bias.chunk(4)[i] for i in order]),
        # capgen puts the attention bias on the context projection (b_att), ours on the state projection: the same sum
        "decoder_Wc_att": att.key.weight.T, "decoder_b_att": att.query.bias, "decoder_Wd_att": att.query.weight.T,
        "decoder_U_att": att.score.weight.T, "decoder_c_tt": att.score.bias,
        "decoder_W_sel": model.gate.weight.T, "decoder_b_sel": model.gate.bias,
        "ff_logit_lstm_W": model.out_h.weight.T, "ff_logit_lstm_b": model.out_h.bias,
        "ff_logit_ctx_W": model.out_z.weight.T, "ff_logit_ctx_b": model.out_z.bias,
        "ff_logit_W": model.out_word.weight.T, "ff_logit_b": model.out_word.bias,
    }


def arctic_init(tparams, ctx):
    """``build_sampler``'s f_init: ``ctx_mean = ctx.mean(0)``, then ``ff_state``/``ff_memory`` with ``activ='tanh'``."""
    ctx_mean = ctx.mean(1)
    return (torch.tanh(ctx_mean @ tparams["ff_state_W"] + tparams["ff_state_b"]),
            torch.tanh(ctx_mean @ tparams["ff_memory_W"] + tparams["ff_memory_b"]))


def arctic_step(tparams, emb, h_, c_, context):
    """``lstm_cond_layer(..., one_step=True)``'s ``_step`` for ``attn_type='deterministic'``, ``selector=True``, no
    LSTM dropout; ``state_below = emb @ W + b`` as computed before the scan."""
    dim = tparams["decoder_U"].shape[0]
    x_ = emb @ tparams["decoder_W"] + tparams["decoder_b"]
    pctx_ = context @ tparams["decoder_Wc_att"] + tparams["decoder_b_att"]
    pstate_ = h_ @ tparams["decoder_Wd_att"]
    pctx_ = torch.tanh(pctx_ + pstate_[:, None, :])
    alpha = (pctx_ @ tparams["decoder_U_att"] + tparams["decoder_c_tt"]).squeeze(-1)
    alpha = alpha.softmax(-1)
    ctx_ = (context * alpha[:, :, None]).sum(1)
    sel_ = torch.sigmoid(h_ @ tparams["decoder_W_sel"] + tparams["decoder_b_sel"]).reshape(-1)
    ctx_ = sel_[:, None] * ctx_
    preact = h_ @ tparams["decoder_U"] + x_ + ctx_ @ tparams["decoder_Wc"]
    i, f, o = (torch.sigmoid(preact[:, n * dim:(n + 1) * dim]) for n in range(3))
    c = torch.tanh(preact[:, 3 * dim:4 * dim])
    c = f * c_ + i * c
    h = o * torch.tanh(c)
    return h, c, alpha, ctx_, sel_


def arctic_readout_pre_tanh(tparams, h, emb, ctx):
    """``build_sampler``'s readout up to (not including) ``logit = tanh(logit)``, with ``prev2out`` and
    ``ctx2out``: ``ff_logit_lstm(h) + emb + ff_logit_ctx(ctx)``."""
    return (h @ tparams["ff_logit_lstm_W"] + tparams["ff_logit_lstm_b"] + emb
            + ctx @ tparams["ff_logit_ctx_W"] + tparams["ff_logit_ctx_b"])


def test_sat_step_equals_arctic_captions():
    """Initial state, attention, gated context and LSTM state of one step equal capgen.py's ``_step``; the word
    distribution is ``softmax(ff_logit(·))`` of capgen's readout *without* its tanh (SAT Eq. 7 has none: a known,
    deliberate difference from the authors' code that the shipped ``sat`` checkpoint was trained with)."""
    torch.manual_seed(0)
    model = create("sat", vocab_size=17, feat_dim=12, embed_dim=10, hidden_dim=14, attn_dim=12,
                   dropout=0.0).double().eval()
    feats = torch.randn(3, 9, 12, dtype=torch.float64)
    vis = VisualBatch.from_features(feats)
    enc = model.encode(vis)
    state = model.init_state(enc)
    tparams = _arctic_params(model)
    h0, c0 = arctic_init(tparams, feats)
    torch.testing.assert_close(state["h"], h0)
    torch.testing.assert_close(state["c"], c0)
    # a random previous state, so that the attention and the gate see more than the initial one
    g = torch.Generator().manual_seed(2)
    state = {"h": torch.randn(3, 14, generator=g, dtype=torch.float64),
             "c": torch.randn(3, 14, generator=g, dtype=torch.float64)}
    prev = torch.tensor([4, 9, 16])
    logprobs, new_state, record = model.step(prev, state, enc)
    emb = model.embed.weight[prev]
    h, c, alpha, ctx, sel = arctic_step(tparams, emb, state["h"], state["c"], feats)
    torch.testing.assert_close(record.primary, alpha)
    torch.testing.assert_close(record.extras["beta_gate"][:, 0], sel)
    torch.testing.assert_close(new_state["h"], h)
    torch.testing.assert_close(new_state["c"], c)
    pre = arctic_readout_pre_tanh(tparams, h, emb, ctx)
    torch.testing.assert_close(logprobs, (pre @ tparams["ff_logit_W"] + tparams["ff_logit_b"]).log_softmax(-1))
    with_tanh = (torch.tanh(pre) @ tparams["ff_logit_W"] + tparams["ff_logit_b"]).log_softmax(-1)
    assert not torch.allclose(logprobs, with_tanh), "capgen.py's tanh readout is not what this model computes"


# -- SCST: self-critical.pytorch misc/utils.py + misc/rewards.py, JDAI-CV losses/reward_criterion.py ---------------
def scp_reward_criterion(input, seq, reward):
    """ruotianluo/self-critical.pytorch ``misc/utils.py``: ``RewardCriterion.forward(self, input, seq, reward)``."""
    input = input.contiguous().view(-1)
    reward = reward.contiguous().view(-1)
    mask = (seq > 0).float()
    mask = torch.cat([mask.new(mask.size(0), 1).fill_(1), mask[:, :-1]], 1).contiguous().view(-1)
    output = - input * reward * mask
    return torch.sum(output) / torch.sum(mask)


def scp_self_critical_rewards(sample_scores, greedy_scores, steps):
    """``misc/rewards.py`` ``get_self_critical_reward`` after scoring: ``scores`` holds the ``batch_size`` sampled
    rows then the ``batch_size`` greedy rows; ``scores[:batch_size] - scores[batch_size:]`` repeated over time."""
    scores = np.concatenate([sample_scores, greedy_scores])
    batch_size = len(sample_scores)
    scores = scores[:batch_size] - scores[batch_size:]
    return np.repeat(scores[:, np.newaxis], steps, 1)


def xlan_reward_criterion(seq, logP, rewards):
    """JDAI-CV/image-captioning ``losses/reward_criterion.py``:
    ``RewardCriterion.forward(self, seq, logP, rewards)``."""
    mask = seq > 0
    mask = torch.cat([mask.new(mask.size(0), 1).fill_(1), mask[:, :-1]], 1)
    rewards = rewards.view(-1, 1).expand_as(logP)
    logP = torch.masked_select(logP, mask)
    rewards = torch.masked_select(rewards, mask)
    return torch.mean(-logP * rewards)


def test_scst_loss_equals_the_authors_reward_criteria():
    """On captions drawn by ``decoding.sample`` (our EOS and padding become the authors' 0), the mask of
    ``Samples`` is the authors' shifted ``seq > 0`` mask, and ``scst_loss`` with ``scst_advantages`` equals both
    authors' ``RewardCriterion`` with the greedy baseline of ``get_self_critical_reward``."""
    torch.manual_seed(3)
    model = create("sat", vocab_size=12, feat_dim=6, embed_dim=8, hidden_dim=10, attn_dim=6, dropout=0.0)
    with torch.no_grad():  # <pad> and <bos> drawn while a caption is alive would not be the authors' tokens
        model.out_word.bias[[model.pad_id, model.bos_id]] = -1e4
        model.out_word.bias[model.eos_id] += 1.5  # captions of varied lengths inside max_len
    n = 4
    drawn = sample(model, VisualBatch.from_features(torch.randn(3, 5, 6)), n=n, max_len=7)
    tokens = drawn.tokens
    assert bool((tokens == model.eos_id).any()) and bool((tokens == model.pad_id).any())
    their_seq = torch.where((tokens == model.eos_id) | (tokens == model.pad_id), torch.zeros_like(tokens), tokens)
    authors_mask = torch.cat([torch.ones_like(their_seq[:, :1]), (their_seq[:, :-1] > 0).long()], 1).bool()
    assert torch.equal(drawn.mask, authors_mask)

    g = torch.Generator().manual_seed(4)
    sample_rewards, greedy_rewards = torch.rand(3, n, generator=g, dtype=torch.float64), torch.rand(3, generator=g,
                                                                                                    dtype=torch.float64)
    advantages = scst_advantages(sample_rewards, greedy_rewards).flatten().float()
    ours = scst_loss(drawn.logprobs, drawn.mask, advantages)
    # the authors' greedy caption is decoded for every expanded row, so its reward repeats per sample
    rewards = scp_self_critical_rewards(sample_rewards.flatten().numpy(), greedy_rewards.repeat_interleave(n).numpy(),
                                        tokens.shape[1])
    rewards = torch.from_numpy(rewards).float()
    torch.testing.assert_close(ours, scp_reward_criterion(drawn.logprobs, their_seq, rewards))
    torch.testing.assert_close(ours, xlan_reward_criterion(their_seq, drawn.logprobs, rewards[:, 0]))
    # and the gradients reach the sampled log-probabilities in the same way
    (ours_grad,) = torch.autograd.grad(ours, drawn.logprobs, retain_graph=True)
    (their_grad,) = torch.autograd.grad(scp_reward_criterion(drawn.logprobs, their_seq, rewards), drawn.logprobs)
    torch.testing.assert_close(ours_grad, their_grad)
