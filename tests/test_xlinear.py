"""X-Linear attention block (X-LAN, arXiv:2003.14080, §3.2): the batched efficient form against a per-item loop
written straight from X-LAN Eq. 2–6 and Eq. 8, masking, heads, and gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from captioner.models.attention import xlinear
from captioner.models.attention.xlinear import (ItemUpdate, XLinearAttention, XLinearLayer, dropout_keep_mask,
                                               embedding_activation)

# tiny tensors gain nothing from a second thread, and on a busy machine waiting for it dominates
pytestmark = pytest.mark.usefixtures("one_thread")

QUERY, KEY, VALUE, ITEMS = 5, 6, 7, 6


def block(heads: int = 1, activation: str = "celu", bilinear_dim: int = 8, channel_dim: int = 4, **options):
    torch.manual_seed(0)
    return XLinearAttention(QUERY, KEY, VALUE, bilinear_dim, channel_dim, heads, activation, dropout=0.0,
                            **options).double().eval()


def inputs(batch: int = 3, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    mask = torch.ones(batch, ITEMS, dtype=torch.bool)
    mask[1, 4:] = False  # a padded image
    mask[2, [0, 3]] = False  # padding anywhere, not only at the end
    return make(batch, QUERY), make(batch, ITEMS, KEY), make(batch, ITEMS, VALUE), mask


def affine(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear.weight @ x + linear.bias


def naive(block: XLinearAttention, query, keys, values, mask):
    """X-LAN Eq. 2–6 for one image, item by item and head by head, with B^v_i formed per item (no factoring)."""
    rho = torch.nn.CELU(1.3) if isinstance(block.key_embed[1], torch.nn.CELU) else torch.relu
    heads, width = block.heads, block.key_embed[0].out_features // block.heads
    real = [i for i in range(keys.shape[0]) if mask[i]]
    query_for_keys, query_for_values = rho(affine(block.query_key_embed[0], query)), rho(
        affine(block.query_value_embed[0], query))
    attended, channel, spatial = [], [], torch.zeros(heads, keys.shape[0], dtype=query.dtype)
    for h in range(heads):
        part = slice(h * width, (h + 1) * width)
        bilinear_key = {i: rho(affine(block.key_embed[0], keys[i]))[part] * query_for_keys[part] for i in real}  # Eq. 2
        transformed = {i: torch.relu(affine(block.bilinear_embed, bilinear_key[i])) for i in real}  # B'^k_i, Eq. 3
        beta_s = torch.stack([affine(block.spatial_score, transformed[i])[0] for i in real]).softmax(0)  # Eq. 3
        squeezed = sum(transformed[i] for i in real) / len(real)  # Eq. 4
        beta_c = torch.sigmoid(affine(block.excitation, squeezed))  # Eq. 5
        bilinear_value = {i: rho(affine(block.value_embed[0], values[i]))[part] * query_for_values[part] for i in real}
        attended.append(beta_c * sum(beta_s[j] * bilinear_value[i] for j, i in enumerate(real)))  # Eq. 6
        channel.append(beta_c)
        spatial[h, real] = beta_s
    return torch.cat(attended), spatial, torch.cat(channel)


@pytest.mark.parametrize("heads,activation", [(1, "celu"), (1, "relu"), (2, "celu"), (4, "relu")])
def test_batched_block_equals_the_per_item_equations(heads, activation):
    attention = block(heads, activation)
    query, keys, values, mask = inputs()
    out = attention(query, keys, values, mask)
    assert out.attended.shape == (3, 8) and out.spatial.shape == (3, heads, ITEMS) and out.channel.shape == (3, 8)
    for b in range(3):
        attended, spatial, channel = naive(attention, query[b], keys[b], values[b], mask[b])
        torch.testing.assert_close(out.attended[b], attended)
        torch.testing.assert_close(out.spatial[b], spatial)
        torch.testing.assert_close(out.channel[b], channel)


def test_padded_items_get_exactly_zero_attention_and_change_nothing():
    attention = block(heads=2)
    query, keys, values, mask = inputs()
    out = attention(query, keys, values, mask)
    assert torch.all(out.spatial.masked_select(~mask[:, None, :]) == 0)
    torch.testing.assert_close(out.spatial.sum(-1), torch.ones(3, 2, dtype=torch.float64))
    assert torch.all((out.channel > 0) & (out.channel < 1))  # β^c ∈ (0, 1): a sigmoid (X-LAN Eq. 5)
    # the squeeze is a masked mean too: garbage in padded slots must not leak into β^c or v̂
    noisy = attention(query, keys.masked_fill(~mask[..., None], 1e3), values.masked_fill(~mask[..., None], -1e3), mask)
    for name in ("attended", "spatial", "channel"):
        torch.testing.assert_close(getattr(noisy, name), getattr(out, name))
    # an all-True mask (grid features) is the same as no mask
    full = torch.ones_like(mask)
    torch.testing.assert_close(attention(query, keys, values, full).attended, attention(query, keys, values).attended)


def test_an_image_without_any_real_item_gets_nothing_and_stays_finite():
    # Eq. 4's mean over no item is the empty sum (docs/decisions.md#masked-items): B̄ = 0, so β^c = sigmoid(b_e);
    # a 0/0 there would put NaN in the row, and into every gradient of the batch
    attention = block(heads=2)
    query, keys, values, mask = inputs()
    mask[0] = False
    query, keys, values = (x.requires_grad_() for x in (query, keys, values))
    out = attention(query, keys, values, mask)
    assert torch.all(out.spatial[0] == 0) and torch.all(out.attended[0] == 0)
    torch.testing.assert_close(out.channel[0], torch.sigmoid(attention.excitation.bias).repeat(2))
    for b in (1, 2):
        torch.testing.assert_close(out.attended[b], naive(attention, query[b], keys[b], values[b], mask[b])[0])
    sum(part.sum() for part in out).backward()
    for x in (query, keys, values, *attention.parameters()):
        assert torch.isfinite(x.grad).all()


def test_the_embedding_activations_default_is_celu_with_alpha_1_3():
    """``embedding_activation("celu")`` alone is the "+ELU" block's ρ, CELU with α = 1.3
    (docs/decisions.md#x-lan-activation). X-LAN and X-Transformer pass their own α, so only this holds the default
    a library user's call gets."""
    rho = embedding_activation("celu")
    assert isinstance(rho, torch.nn.CELU) and rho.alpha == 1.3
    assert isinstance(embedding_activation("relu"), torch.nn.ReLU)


def test_the_traced_form_of_an_image_without_any_real_item_stays_finite(monkeypatch):
    """An ONNX export traces the broadcast form (``_scores_and_squeeze``), whose squeeze is a masked mean of its own
    (``_squeeze``): over no real item it must be the empty sum as in the slab form (B̄ = 0, so β^c = sigmoid(b_e)),
    not 0/0, which would put NaN in the exported graph's row."""
    monkeypatch.setattr(XLinearAttention, "_scores_and_squeeze_in_slabs", XLinearAttention._scores_and_squeeze)
    attention = block(heads=2)
    query, keys, values, mask = inputs()
    mask[0] = False
    out = attention(query, keys, values, mask)
    assert torch.all(out.spatial[0] == 0) and torch.all(out.attended[0] == 0)
    torch.testing.assert_close(out.channel[0], torch.sigmoid(attention.excitation.bias).repeat(2))
    torch.testing.assert_close(out.attended[1], naive(attention, query[1], keys[1], values[1], mask[1])[0])


def test_many_queries_with_per_query_masks_equal_one_query_at_a_time():
    attention = block(heads=2)
    _, keys, values, _ = inputs()
    queries = torch.randn(3, ITEMS, QUERY, dtype=torch.float64)
    causal = torch.ones(ITEMS, ITEMS, dtype=torch.bool).tril().expand(3, ITEMS, ITEMS)
    out = attention(queries, keys, values, causal)
    assert out.spatial.shape == (3, 2, ITEMS, ITEMS)
    for t in range(ITEMS):
        single = attention(queries[:, t], keys, values, causal[:, t])
        torch.testing.assert_close(out.attended[:, t], single.attended)
        torch.testing.assert_close(out.spatial[:, :, t], single.spatial)
        torch.testing.assert_close(out.channel[:, t], single.channel)


def test_precomputed_memory_is_the_same_block():
    attention = block(heads=2, group_norm=True)
    query, keys, values, mask = inputs()
    direct = attention(query, keys, values, mask)
    cached = attention.attend(query, *attention.embed_memory(keys, values), mask)
    torch.testing.assert_close(cached.attended, direct.attended)
    # GroupNorm (authors' code) normalises each head's channels of every embedding separately
    embedded = attention.key_embed(keys).unflatten(-1, (2, 4))
    torch.testing.assert_close(embedded.mean(-1), torch.zeros(3, ITEMS, 2, dtype=torch.float64))


def test_gradcheck_on_a_tiny_block():
    attention = block(heads=2)
    query, keys, values, mask = inputs()
    query, keys, values = (x.requires_grad_() for x in (query, keys, values))
    assert torch.autograd.gradcheck(lambda q, k, v: tuple(attention(q, k, v, mask)), (query, keys, values),
                                    eps=1e-6, atol=1e-6)


def test_shapes_must_split_into_heads():
    with pytest.raises(ValueError, match="divisible"):
        XLinearAttention(4, 4, 4, bilinear_dim=10, channel_dim=4, heads=4)
    with pytest.raises(ValueError, match="activation"):
        XLinearAttention(4, 4, 4, bilinear_dim=8, channel_dim=4, heads=2, activation="elu")


def test_an_unknown_activation_is_refused_with_the_names_that_work():
    """A misspelt ``activation`` is refused with the names ρ may take; every name the error lists must be one that
    works, or a user who copies a listed name from the message is refused again."""
    with pytest.raises(ValueError, match="activation") as refused:
        embedding_activation("elu")
    assert "('celu', 'relu')" in str(refused.value)
    for name in xlinear.ACTIVATIONS:
        embedding_activation(name)


def test_defaults_are_the_papers_block():
    """A library user's ``XLinearAttention(query, key, value)`` has the paper's widths (D_B = 1024, D_c = 512, as the
    class documents), the "+ELU" embeddings, 8 heads and the authors' 0.1 dropout on B'^k; every model of the zoo
    passes its own sizes, so only this test holds them."""
    attention = XLinearAttention(QUERY, KEY, VALUE)
    assert attention.heads == 8 and attention.key_embed[0].out_features == 1024
    assert (attention.bilinear_embed.in_features, attention.bilinear_embed.out_features) == (1024 // 8, 512 // 8)
    assert isinstance(attention.key_embed[1], torch.nn.CELU) and attention.key_embed[1].alpha == 1.3
    assert attention.dropout.p == 0.1 and len(attention.key_embed) == 2  # no GroupNorm


def test_the_blocks_celu_alpha_reaches_all_four_embeddings():
    """``ρ`` is CELU with the α asked for (docs/decisions.md#x-lan-activation) in the embeddings of the keys, the
    values and both of the query's: a block that kept 1.3 whatever it was given matches every test at the default."""
    attention = block(heads=2, celu_alpha=0.5)
    query, keys, values, _ = inputs()
    for embed, x in [(attention.key_embed, keys), (attention.value_embed, values),
                     (attention.query_key_embed, query), (attention.query_value_embed, query)]:
        torch.testing.assert_close(embed(x), F.celu(embed[0](x), alpha=0.5))


def test_stacked_layer_defaults_are_the_papers():
    """A library user's ``XLinearLayer(dim, channels, heads)``: the "+ELU" embeddings with α = 1.3, the authors'
    0.1 dropout on B'^k, no dropout on v̂ or in Eq. 8 (the paper states none), and one update for keys and values
    (docs/decisions.md#x-lan-key-and-value-update). The models of the zoo pass all of them, so only this holds them."""
    layer = XLinearLayer(8, 4, heads=2)
    rho = layer.attention.key_embed[1]
    assert isinstance(rho, torch.nn.CELU) and rho.alpha == 1.3 and len(layer.attention.key_embed) == 2
    assert layer.attention.dropout.p == 0.1 and layer.output_dropout.p == 0.0 and layer.value_update.dropout.p == 0.0
    assert layer.key_update is None
    assert ItemUpdate(8).dropout.p == 0.0


def test_stacked_layer_passes_its_options_to_its_block_and_updates():
    """``XLinearLayer``'s dropouts and GroupNorm reach the parts that use them: X-LAN and X-Transformer build their
    encoder layers from their own ``attention_dropout``, ``update_dropout`` and ``group_norm``, and a layer that kept
    the block's 0.1, no Eq. 8 dropout or no GroupNorm matched every test, which build models with dropout 0."""
    layer = XLinearLayer(8, 4, heads=2, shared_kv_update=False, attention_dropout=0.2, output_dropout=0.4,
                         update_dropout=0.3, group_norm=True)
    assert layer.attention.dropout.p == 0.2 and layer.output_dropout.p == 0.4
    assert layer.value_update.dropout.p == layer.key_update.dropout.p == 0.3
    for embed in (layer.attention.key_embed, layer.attention.value_embed, layer.attention.query_key_embed,
                  layer.attention.query_value_embed):
        assert isinstance(embed[-1], torch.nn.GroupNorm) and embed[-1].num_groups == 2  # one group per head


@pytest.mark.parametrize("shared", [True, False])
def test_stacked_layer_is_eq7_then_eq8(shared):
    torch.manual_seed(0)
    layer = XLinearLayer(8, 4, heads=2, shared_kv_update=shared).double().eval()
    _, _, _, mask = inputs()
    keys, values = torch.randn(2, 3, ITEMS, 8, dtype=torch.float64)
    query = torch.randn(3, 8, dtype=torch.float64)
    attended, new_keys, new_values, _ = layer(query, keys, values, mask)
    torch.testing.assert_close(attended, layer.attention(query, keys, values, mask).attended)  # Eq. 7

    def eq8(update: ItemUpdate, items):  # LN(ReLU(W [v̂^(m); x_i]) + x_i), item by item
        def one(b, i):
            embedded = torch.relu(affine(update.embed, torch.cat([attended[b], items[b, i]])))
            return F.layer_norm(embedded + items[b, i], (8,), update.norm.weight, update.norm.bias)

        return torch.stack([torch.stack([one(b, i) for i in range(ITEMS)]) for b in range(3)])

    torch.testing.assert_close(new_values, eq8(layer.value_update, values))
    torch.testing.assert_close(new_keys, new_values if shared else eq8(layer.key_update, keys))
    assert (layer.key_update is None) == shared


def test_stacked_layer_updates_the_items_with_the_dropped_out_attended_vector():
    """Eq. 8 refines the keys and values with v̂^(m) as the layer returns it, after its output dropout (as the
    authors' encoder does): with all of v̂ dropped the items are updated with zeros, not with the block's output."""
    torch.manual_seed(0)
    layer = XLinearLayer(8, 4, heads=2, attention_dropout=0.0, output_dropout=1.0).double().train()
    _, _, _, mask = inputs()
    keys, values = torch.randn(2, 3, ITEMS, 8, dtype=torch.float64)
    attended, _, new_values, block_out = layer(torch.randn(3, 8, dtype=torch.float64), keys, values, mask)
    assert torch.all(attended == 0) and block_out.attended.abs().sum() > 0
    torch.testing.assert_close(new_values, layer.value_update(torch.zeros_like(attended), values))


def test_item_update_drops_out_only_the_new_part_not_the_residual():
    """Eq. 8's dropout (``update_dropout``, 0.3 in the authors' code) acts on ``ReLU(W [v̂; x_i] + b)`` before the
    residual ``x_i`` is added: with all of it dropped, each item is only layer-normalised. A dropout over the sum
    would drop the items themselves in training, and every encoder layer would lose part of the regions it refines."""
    torch.manual_seed(0)
    update = ItemUpdate(8, dropout=1.0).double().train()
    items = torch.randn(3, ITEMS, 8, dtype=torch.float64)
    torch.testing.assert_close(update(torch.randn(3, 8, dtype=torch.float64), items), update.norm(items))


class _Mask(torch.nn.Module):
    """Dropout with a given mask: lets the broadcast form drop exactly what the slab form dropped."""

    def __init__(self, keep: torch.Tensor, drop: float):
        super().__init__()
        self.scaled = keep.to(torch.float64) / (1.0 - drop)

    def forward(self, x):
        return x * self.scaled


@pytest.mark.parametrize("queries,masking", [(None, "items"), (3, "none"), (3, "items"), (ITEMS, "causal")])
def test_slab_form_equals_the_broadcast_form_with_dropout_and_gradients(monkeypatch, queries, masking):
    """The training path (b^s and B̄ as matmuls, a few (row, head) slabs at a time, B'^k rebuilt in the backward
    pass) against Eq. 2–4 written with B^k and B'^k materialised, dropout mask included, values and gradients."""
    attention = block(heads=2).train()
    attention.dropout.p = 0.3
    query, keys, values, mask = inputs()
    if queries is not None:
        query = torch.randn(3, queries, QUERY, dtype=torch.float64)
    if masking == "none":
        mask = None
    elif masking == "causal":
        keys, values = (torch.randn(3, ITEMS, KEY, dtype=torch.float64),
                        torch.randn(3, ITEMS, VALUE, dtype=torch.float64))
        mask = torch.ones(ITEMS, ITEMS, dtype=torch.bool).tril().unsqueeze(0)
    leaves = [query.requires_grad_(), keys.requires_grad_(), values.requires_grad_(), *attention.parameters()]
    made = {}

    def keep_mask(shape, drop, device=None):
        made["keep"] = xlinear.dropout_keep_mask.__wrapped__(shape, drop, device)
        return made["keep"]

    keep_mask.__wrapped__ = xlinear.dropout_keep_mask
    monkeypatch.setattr(xlinear, "dropout_keep_mask", keep_mask)
    monkeypatch.setattr(xlinear, "SLAB_FLOATS", 40)  # several slabs, the last one short

    def run():
        out = attention(query, keys, values, mask)
        loss = (out.attended ** 2).sum() + out.spatial.sin().sum() + out.channel.cos().sum()
        return out, torch.autograd.grad(loss, leaves, allow_unused=True)

    slab, slab_grads = run()
    length = 1 if query.dim() == 2 else query.shape[1]
    # the mask is [rows·heads, items, queries·channels]; the broadcast form's B'^k is [rows, queries, items, heads, c]
    keep = made["keep"].view(3, 2, keys.shape[1], length, -1).permute(0, 3, 2, 1, 4)
    attention.dropout = _Mask(keep, 0.3)
    monkeypatch.setattr(XLinearAttention, "_scores_and_squeeze_in_slabs", XLinearAttention._scores_and_squeeze)
    broadcast, broadcast_grads = run()
    for got, expected in zip(slab, broadcast):
        torch.testing.assert_close(got, expected)
    for got, expected in zip(slab_grads, broadcast_grads):
        torch.testing.assert_close(got, expected)
    assert 0.0 < made["keep"].to(torch.float64).mean() < 1.0


def test_the_slab_form_runs_under_bfloat16_autocast_close_to_float32():
    """``captioner train --precision bfloat16`` and a server with ``CAPTIONER_PRECISION=bfloat16`` run the block under
    autocast: its linear layers hand the slab form bfloat16 keys and queries beside float32 weights, which
    :class:`_SpatialSqueeze` must bring to one dtype (its matmuls refuse mixed ones). The result and the float32
    weights' gradients stay close to float32's."""
    torch.manual_seed(0)
    attention = XLinearAttention(QUERY, KEY, VALUE, 16, 8, heads=2, dropout=0.0).train()
    query, keys, values, mask = (x if x.dtype == torch.bool else x.float() for x in inputs())
    results = {}
    for precision in (torch.float32, torch.bfloat16):
        attention.zero_grad()
        with torch.autocast("cpu", dtype=precision, enabled=precision != torch.float32):
            out = attention(query, keys, values, mask)
        assert out.attended.dtype == precision
        (out.attended.float().square().sum() + out.channel.float().sum()).backward()
        results[precision] = out.attended.float(), [p.grad.clone() for p in attention.parameters()]
    (exact, exact_grads), (lower, lower_grads) = results[torch.float32], results[torch.bfloat16]
    torch.testing.assert_close(lower, exact, atol=0.05, rtol=0.05)
    for got, expected in zip(lower_grads, exact_grads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=0.05, rtol=0.05)


def test_a_dropout_of_one_drops_all_of_b_prime_k():
    """``nn.Dropout(1.0)`` is allowed and zeroes its input; the slab form's rescaling ``1/(1 − p)`` must not divide
    by zero. With all of B'^k dropped, b^s is W_b's bias alone (uniform spatial attention over the real items) and
    B̄ = 0 (β^c = sigmoid of W_e's bias)."""
    attention = block(heads=2).train()
    attention.dropout.p = 1.0
    query, keys, values, mask = inputs()
    out = attention(query, keys, values, mask)
    real = mask.to(torch.float64)
    torch.testing.assert_close(out.spatial, (real / real.sum(-1, keepdim=True))[:, None].expand(-1, 2, -1))
    torch.testing.assert_close(out.channel, torch.sigmoid(attention.excitation.bias).repeat(2).expand(3, -1))


def test_dropout_keep_mask_keeps_each_element_with_the_asked_probability():
    torch.manual_seed(0)
    keep = dropout_keep_mask((1000, 1000), 0.1)
    assert keep.dtype == torch.bool and keep.shape == (1000, 1000)
    # 10⁶ Bernoulli(0.9) draws: the standard deviation of the rate is 3·10⁻⁴
    assert abs(keep.to(torch.float64).mean().item() - 0.9) < 1.5e-3
    assert abs(keep[:, ::2].to(torch.float64).mean() - keep[:, 1::2].to(torch.float64).mean()) < 3e-3  # both halves
    assert dropout_keep_mask((7,), 0.0).all() and not dropout_keep_mask((7,), 1.0).any()


def test_the_slab_backward_runs_each_bmm_over_all_pairs_at_once():
    """The backward's matmuls run over every (row, head) pair at once. ATen runs a ``bmm`` whose ``out=`` is not
    contiguous (the mixer's gradient has the mixer's transposed layout), or whose items are neither contiguous nor
    transposed (an einsum over that gradient's ``[G, d, L, c]`` view), as one matmul per batch item, with a
    ``select`` of each operand per item: some 150,000 of them in one X-Transformer SCST step (docs/decisions.md,
    "Training steps, profiled"). The values are the broadcast form's (the test above)."""
    torch.manual_seed(0)
    # matrices past ATen's small-product kernel (it loops over the pairs anyway): 17 × 24 outputs per pair
    attention = XLinearAttention(QUERY, KEY, VALUE, 64, 32, heads=4, dropout=0.1).train()
    rows, items = 12, 9
    query = torch.randn(rows, 3, QUERY, requires_grad=True)
    keys, values = torch.randn(rows, items, KEY), torch.randn(rows, items, VALUE)
    out = attention(query, keys, values, torch.ones(items, items, dtype=torch.bool).tril()[None, :3])
    loss = out.attended.square().sum() + out.spatial.sin().sum() + out.channel.sum()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    selects = sum(event.count for event in prof.key_averages() if event.key == "aten::select")
    assert selects < rows * 4, f"{selects} selects in the backward of {rows * 4} (row, head) pairs"
    assert attention.bilinear_embed.weight.grad is not None and query.grad is not None
