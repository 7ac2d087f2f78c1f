"""The one decoder every model shares (SPEC §1.7, §8.3): greedy, sampling and beam search.

Models only supply ``step``; this module owns the search, the back-pointers and the per-token attention
history, so the attention row returned for token ``t`` is always the one that fed its prediction — after beam
reordering too (SPEC §8.2 alignment rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .protocol import Captioner, VisualBatch, index_rows


@dataclass
class Hypothesis:
    """One decoded caption: word ids (ending in EOS when one was emitted), their log-probs, the primary
    attention row per token ``[T, N]`` and any requested extras ``{name: [T, ...]}``."""

    token_ids: list[int]
    token_logprobs: list[float]
    attention: Tensor
    extras: dict[str, Tensor] = field(default_factory=dict)
    score: float = 0.0
    ended_with_eos: bool = False

    @property
    def is_eos(self) -> list[bool]:
        return [self.ended_with_eos and i == len(self.token_ids) - 1 for i in range(len(self.token_ids))]


def _length_normalised(score: float, length: int, length_penalty: float | None) -> float:
    # GNMT length penalty ((5+|y|)/6)^α; None means raw summed log-prob (the papers' default, decision #3)
    if not length_penalty:
        return score
    return score / (((5.0 + length) / 6.0) ** length_penalty)


@torch.no_grad()
def beam_search(
    model: Captioner,
    vis: VisualBatch,
    k: int = 3,
    max_len: int = 20,
    length_penalty: float | None = None,
    n_best: int = 1,
    extras: tuple[str, ...] | bool = True,
) -> list[list[Hypothesis]]:
    """Beam search over a batch of images; returns ``n_best`` hypotheses per image, best first.

    Finished hypotheses may only be extended by EOS at log-prob 0, so they keep competing with live ones on
    their final score.  ``extras=True`` keeps every extra map the model reports; a tuple keeps only those.
    """
    if k < 1 or n_best < 1 or n_best > k:
        raise ValueError(f"need 1 <= n_best <= k, got k={k}, n_best={n_best}")
    enc = model.encode(vis)
    batch = vis.feats.shape[0]
    device = vis.feats.device
    enc = model.expand(enc, k)
    state = model.init_state(enc)
    rows = batch * k

    # Only beam 0 of each image is live at the start; the others get -inf so the first top-k picks k words.
    scores = torch.full((batch, k), float("-inf"), device=device)
    scores[:, 0] = 0.0
    scores = scores.view(rows)
    prev = torch.full((rows,), model.bos_id, dtype=torch.long, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    history: dict[str, Tensor] = {}  # every tensor [rows, t, ...]
    base = (torch.arange(batch, device=device) * k).repeat_interleave(k)

    for _ in range(max_len):
        logprobs, state, attn = model.step(prev, state, enc)
        vocab = logprobs.shape[1]
        logprobs = logprobs.float()
        if finished.any():
            eos_only = torch.full_like(logprobs, float("-inf"))
            eos_only[:, model.eos_id] = 0.0
            logprobs = torch.where(finished[:, None], eos_only, logprobs)
        candidates = (scores[:, None] + logprobs).view(batch, k * vocab)
        top_scores, top_index = candidates.topk(k, dim=1)
        pointer = base + torch.div(top_index, vocab, rounding_mode="floor").view(rows)
        tokens = (top_index % vocab).view(rows)

        step_values = {"tokens": tokens[:, None], "logprobs": logprobs[pointer, tokens][:, None],
                       "attention": attn.primary.index_select(0, pointer)[:, None].float()}
        wanted = attn.extras if extras is True else {n: v for n, v in attn.extras.items() if extras and n in extras}
        for name, value in wanted.items():
            step_values[f"extra:{name}"] = value.index_select(0, pointer)[:, None].float()
        history = index_rows(history, pointer) if history else {}
        history = {name: torch.cat([history[name], v], 1) if name in history else v for name, v in step_values.items()}

        state = model.reorder(state, pointer)
        finished = finished.index_select(0, pointer) | (tokens == model.eos_id)
        scores = top_scores.view(rows)
        prev = tokens
        if bool(finished.all()):
            break

    return _collect(history, scores.view(batch, k), model.eos_id, n_best, length_penalty)


def _collect(history: dict[str, Tensor], scores: Tensor, eos_id: int, n_best: int,
             length_penalty: float | None) -> list[list[Hypothesis]]:
    batch, k = scores.shape
    history = {name: value.cpu() for name, value in history.items()}
    results = []
    for b in range(batch):
        hyps = []
        for j in range(k):
            row = b * k + j
            ids = history["tokens"][row].tolist()
            length = ids.index(eos_id) + 1 if eos_id in ids else len(ids)
            hyps.append(Hypothesis(
                token_ids=ids[:length],
                token_logprobs=history["logprobs"][row, :length].tolist(),
                attention=history["attention"][row, :length],
                extras={n[6:]: v[row, :length] for n, v in history.items() if n.startswith("extra:")},
                score=_length_normalised(float(scores[b, j]), length, length_penalty),
                ended_with_eos=eos_id in ids,
            ))
        hyps.sort(key=lambda h: h.score, reverse=True)
        results.append(hyps[:n_best])
    return results


@torch.no_grad()
def greedy(model: Captioner, vis: VisualBatch, max_len: int = 20) -> list[Hypothesis]:
    """Arg-max decoding, written independently of the beam search so each can check the other."""
    enc = model.encode(vis)
    state = model.init_state(enc)
    rows = vis.feats.shape[0]
    prev = torch.full((rows,), model.bos_id, dtype=torch.long, device=vis.feats.device)
    tokens, logps, attns = [], [], []
    done = torch.zeros(rows, dtype=torch.bool, device=vis.feats.device)
    for _ in range(max_len):
        logprobs, state, attn = model.step(prev, state, enc)
        best, prev = logprobs.float().max(-1)
        tokens.append(prev)
        logps.append(best)
        attns.append(attn.primary.float())
        done = done | (prev == model.eos_id)
        if bool(done.all()):
            break
    ids, lp, att = torch.stack(tokens, 1).cpu(), torch.stack(logps, 1).cpu(), torch.stack(attns, 1).cpu()
    out = []
    for r in range(rows):
        row = ids[r].tolist()
        length = row.index(model.eos_id) + 1 if model.eos_id in row else len(row)
        out.append(Hypothesis(row[:length], lp[r, :length].tolist(), att[r, :length],
                              score=float(lp[r, :length].sum()), ended_with_eos=model.eos_id in row))
    return out


@dataclass
class Samples:
    """Sampled captions for SCST: ids ``[R, T]`` (padded after EOS), their log-probs ``[R, T]`` with gradient,
    and the mask of real tokens (EOS included)."""

    tokens: Tensor
    logprobs: Tensor
    mask: Tensor


def sample(model: Captioner, vis: VisualBatch, n: int = 1, max_len: int = 20, temperature: float = 1.0) -> Samples:
    """Multinomial sampling from the full softmax, ``n`` captions per image (rows ``b*n .. b*n+n-1``)."""
    enc = model.expand(model.encode(vis), n)
    state = model.init_state(enc)
    rows = vis.feats.shape[0] * n
    prev = torch.full((rows,), model.bos_id, dtype=torch.long, device=vis.feats.device)
    alive = torch.ones(rows, dtype=torch.bool, device=vis.feats.device)
    tokens, logps, masks = [], [], []
    for _ in range(max_len):
        logprobs, state, _ = model.step(prev, state, enc)
        with torch.no_grad():
            drawn = torch.multinomial((logprobs / temperature).softmax(-1), 1).squeeze(1)
        drawn = torch.where(alive, drawn, torch.full_like(drawn, model.pad_id))
        tokens.append(drawn)
        logps.append(logprobs.gather(1, drawn[:, None]).squeeze(1))
        masks.append(alive)
        alive = alive & (drawn != model.eos_id)
        prev = drawn
        if not bool(alive.any()):
            break
    return Samples(torch.stack(tokens, 1), torch.stack(logps, 1), torch.stack(masks, 1))
