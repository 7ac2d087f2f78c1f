"""Parameter counts of every registered captioner at the sizes its paper uses (``captioner params``).

Each model is built from :data:`PAPER_SIZES` on the ``meta`` device, which allocates no memory, so even the
100M-parameter models are counted instantly.  ``docs/parameters.md`` derives the SAT, AoANet, X-LAN and
X-Transformer numbers by hand.
"""

from __future__ import annotations

from typing import Any

import torch

from ..zoo import available, create

#: Constructor arguments (besides ``vocab_size``) giving each model its paper's sizes.  ``feat_dim`` is the raw
#: visual feature the paper feeds in.  A model that is not registered is skipped, and so is an entry
#: left as None.
PAPER_SIZES: dict[str, dict[str, Any] | None] = {
    # VGG-19 conv5_4 (D = 512, SAT §3.1.1); m = 512, n = 1024, attention MLP 512 (docs/decisions.md#sat-sizes)
    "sat": dict(feat_dim=512, embed_dim=512, hidden_dim=1024, attn_dim=512),
    "sat-hard": dict(feat_dim=512, embed_dim=512, hidden_dim=1024, attn_dim=512),  # same network, no β gate
    # bottom-up regions (2048-d) → D = 1024, 6 refining layers (AoANet §3.2.1, §3.4), E = 1024, 8 decoder heads
    # (docs/decisions.md#aoanet-sizes)
    "aoanet": dict(feat_dim=2048, d_model=1024, embed_dim=1024, heads=8, refine_layers=6),
    # ResNet 8×8×2048 grid → g = 512; LSTM 512, word embedding 256 (SparseCap §3–4); attention 512 (our choice)
    "sparsecap": dict(feat_dim=2048, embed_dim=256, hidden_dim=512, visual_dim=512, attn_dim=512),
    # T2T8x8 with 3×3* areas (Area attention §3.2, Table 4); Inception-ResNet-v2 cells (1536-d), learned row/column
    # embeddings of the 8×8 grid (docs/decisions.md#areatransformer-cell-positions), FFN 2048
    # (docs/decisions.md#areatransformer-recipe)
    "area-transformer": dict(feat_dim=1536, d_model=512, n_heads=8, enc_layers=6, dec_layers=6, ffn_dim=2048,
                             encoder_area=3, decoder_area=3, area_key="combined", area_layers=2, grid_hw=[8, 8],
                             max_grid=8),
    # bottom-up regions (2048-d) → D_v = D_B = 1024, D_c = 512, LSTM 1024, 4 "+ELU" encoder blocks (X-LAN §4.1);
    # 8 heads (docs/decisions.md#x-lan-heads), word embedding 1024 (the authors' code)
    "xlan": dict(feat_dim=2048, dim=1024, hidden_dim=1024, embed_dim=1024, channel_dim=512, heads=8,
                 encoder_layers=4),
    # the authors' code (docs/decisions.md#x-transformer-architecture): width 768, 8 heads, D_c = 384, 6 + 6 layers,
    # FFN 4·768
    "xtransformer": dict(feat_dim=2048, dim=768, channel_dim=384, heads=8, encoder_layers=6, decoder_layers=6,
                         ffn_dim=3072),
}


def count_parameters(module: torch.nn.Module) -> int:
    """Trainable and frozen parameters alike, each shared tensor once."""
    return sum(p.numel() for p in module.parameters())


def parameter_table(vocab_size: int) -> dict[str, int]:
    """``{model name: parameter count}`` for every registered model that has paper sizes, in table order."""
    registered = set(available())
    table = {}
    for name, sizes in PAPER_SIZES.items():
        if sizes is None or name not in registered:
            continue
        with torch.device("meta"):
            table[name] = count_parameters(create(name, vocab_size=vocab_size, **sizes))
    return table
