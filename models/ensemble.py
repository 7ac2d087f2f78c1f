"""An ensemble of trained captioners decoded as one (docs/decisions.md#flickr8k-an-ensemble-of-the-shipped-checkpoints).

The next-word distribution is the mean of the members' probabilities,
``p(y_t) = 1/K Σ_k p_k(y_t | y_<t, I)``, as self-critical.pytorch's ``AttEnsemble`` (which AoANet, arXiv:1908.06954,
and X-LAN, arXiv:2003.14080, build on for their ensemble rows) averages its members' softmax outputs; the attention
row exported for a word is the mean of the members' rows for it, so the one beam search decodes an ensemble and
its heatmaps stay aligned with its tokens.  Members share the vocabulary and the visual items (one encoder spec);
``captioner ensemble`` checks both when it builds one.  An ensemble is built from trained checkpoints, never
trained.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from .protocol import AttnRecord, Captioner, DecState, EncState, VisualBatch
from .registry import create, register


def mean_of(normalisers: Iterable[str]) -> str:
    """How an ensemble's attention is named: the mean of its members' maps, each named by its normaliser."""
    return "mean of " + " and ".join(normalisers)


def _prefix(k: int) -> str:
    """Member ``k``'s keys in the ensemble's flat state (the one place that knows the format)."""
    return f"m{k}_"


def _split(state: dict[str, Tensor], members: int) -> list[dict[str, Tensor]]:
    """Member ``k``'s own state out of the ensemble's flat one (every key carries its member's prefix)."""
    prefixes = [_prefix(k) for k in range(members)]
    return [{key[len(p):]: value for key, value in state.items() if key.startswith(p)} for p in prefixes]


def _join(parts: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """One flat state of the members' states, so the protocol's generic expand and reorder serve an ensemble."""
    return {_prefix(k) + name: value for k, part in enumerate(parts) for name, value in part.items()}


@register("ensemble")
class Ensemble(Captioner):
    """Trained captioners decoded as one by the shared beam search: every step averages the members' next-word
    probabilities, ``p(y_t) = 1/K Σ_k p_k(y_t | y_<t, I)``, and their exported attention rows.

    No paper equation: the papers that report ensembles (AoANet, arXiv:1908.06954, and X-LAN, arXiv:2003.14080,
    Table 1 of each) do not say how members combine; this is the probability mean of self-critical.pytorch's
    ``AttEnsemble``, which their code uses (docs/decisions.md#flickr8k-an-ensemble-of-the-shipped-checkpoints).
    Members keep their own states, prefixed ``m{k}_`` in one flat dict, so the protocol's generic expand and
    reorder serve an ensemble unchanged.
    """

    attention_kind = "ensemble_mean_attention"

    def __init__(self, vocab_size: int, feat_dim: int, members: Sequence[dict[str, Any]] = (), **ids: int):
        """``members``: each member's ``{"arch": name, "model": its config}``, as its own checkpoint stores them."""
        super().__init__(vocab_size, feat_dim, **ids)
        if len(members) < 2:
            raise ValueError("an ensemble needs at least two members, built from trained checkpoints by "
                             "`captioner ensemble` (an ensemble is not trained)")
        self.member_configs = [{"arch": m["arch"], "model": dict(m["model"])} for m in members]
        self.members = nn.ModuleList(create(m["arch"], **m["model"], **ids) for m in self.member_configs)
        for member in self.members:
            if (member.vocab_size, member.feat_dim) != (vocab_size, feat_dim):
                raise ValueError(f"member {member.arch} has {member.vocab_size} words over {member.feat_dim}-d "
                                 f"features; the ensemble has {vocab_size} over {feat_dim}")

    def config(self) -> dict[str, Any]:
        return dict(vocab_size=self.vocab_size, feat_dim=self.feat_dim, members=self.member_configs)

    @property
    def attention_name(self) -> str:
        return mean_of(member.attention_name for member in self.members)

    def encode(self, vis: VisualBatch) -> EncState:
        return _join([member.encode(vis) for member in self.members])

    def init_state(self, enc: EncState) -> DecState:
        encs = _split(enc, len(self.members))
        return _join([member.init_state(e) for member, e in zip(self.members, encs)])

    def step(self, prev_tokens: Tensor, state: DecState, enc: EncState) -> tuple[Tensor, DecState, AttnRecord]:
        """``log 1/K Σ_k p_k``, computed as a log-sum-exp of the members' log-probs (no underflow to −inf where
        every member is sure a word is wrong), and the mean of their attention rows.

        Probabilities are averaged, not log-probabilities, as ``AttEnsemble`` does: a word one member rules out
        keeps the others' mass instead of being vetoed.  The attention mean keeps one row per emitted word, on the
        shared visual items, so the ensemble's heatmaps stay aligned with its tokens."""
        states, encs = _split(state, len(self.members)), _split(enc, len(self.members))
        logprobs, new_states, rows = [], [], []
        for member, s, e in zip(self.members, states, encs):
            lp, new, attn = member.step(prev_tokens, s, e)
            logprobs.append(lp)
            new_states.append(new)
            rows.append(attn.primary)
        mean = torch.logsumexp(torch.stack(logprobs), dim=0) - math.log(len(self.members))
        return mean, _join(new_states), AttnRecord(torch.stack(rows).mean(0))

    def forward_xe(self, vis: VisualBatch, captions: Tensor, ss_prob: float = 0.0,
                   rows: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        raise ValueError("an ensemble is not trained: train its members, then build it with `captioner ensemble`")

    def export_blocker(self) -> str | None:
        for member in self.members:
            reason = member.export_blocker()
            if reason:
                return f"member {member.arch}: {reason}"
        return None


def build_ensemble(checkpoints: Sequence[Any]) -> Ensemble:
    """An :class:`Ensemble` of checkpoints (each a loaded ``captioner.models.checkpoint.Checkpoint`` or its folder),
    their weights copied in.

    Refused, naming the first member that differs: another vocabulary (the mean is over the same words), another
    encoder spec (the members attend over the same visual items, one CNN pass for all) or other features (a grid
    and a region folder are different visual items under the same spec)."""
    if len(checkpoints) < 2:
        raise ValueError("an ensemble needs at least two checkpoints")
    from .checkpoint import load_checkpoint  # the checkpoint module builds models, this one among them

    checkpoints = [load_checkpoint(c) if isinstance(c, (str, Path)) else c for c in checkpoints]
    first = checkpoints[0]
    for other in checkpoints[1:]:
        # named by their folders where their names coincide (weights/sat and weights/flickr8k/sat)
        them, it = (other.path, first.path) if other.name == first.name and other.path else (other.name, first.name)
        if other.vocab.itos != first.vocab.itos:
            raise ValueError(f"{them} has another vocabulary than {it} ({len(other.vocab)} against "
                             f"{len(first.vocab)} tokens): the members of an ensemble predict the same words")
        if other.encoder != first.encoder:
            raise ValueError(f"{them} reads other visual items than {it} (encoder {other.encoder} "
                             f"against {first.encoder}): the members of an ensemble share one encoder spec")
        if other.trained_features != first.trained_features:
            raise ValueError(f"{them} was trained on other features than {it}")
    if any(c.model.arch == Ensemble.arch for c in checkpoints):
        raise ValueError("an ensemble's members are single checkpoints, not ensembles")
    model = first.model
    ensemble = Ensemble(model.vocab_size, model.feat_dim,
                        [{"arch": c.model.arch, "model": c.model.config()} for c in checkpoints],
                        pad_id=model.pad_id, bos_id=model.bos_id, eos_id=model.eos_id)
    for target, ckpt in zip(ensemble.members, checkpoints):
        target.load_state_dict(ckpt.model.state_dict(), strict=True)
    return ensemble.eval()


def select_members(candidates: Sequence[Any], score: Callable[[Captioner], float], max_members: int = 4,
                   min_gain: float = 0.005, report: Callable[[str], None] = lambda line: None) -> list[Any]:
    """Greedy forward selection (Caruana, Niculescu-Mizil, Crew & Ksikes, "Ensemble selection from libraries of
    models", ICML 2004): start from ``candidates[0]``, then each round add the candidate whose ensemble ``score``
    is highest, until the best addition gains less than ``min_gain`` or ``max_members`` are in.

    ``score`` rates a captioner (higher is better: a validation split's CIDEr-D); ``report`` hears one line per
    scored set.  Returns the chosen checkpoints, in the order they joined."""
    if max_members < 1 or not candidates:
        raise ValueError("need at least one candidate and max_members >= 1")
    chosen, rest = [candidates[0]], list(candidates[1:])
    best = score(chosen[0].model)
    report(f"{chosen[0].name}: {best:.4f}")
    while rest and len(chosen) < max_members:
        trials = []
        for candidate in rest:
            value = score(build_ensemble([*chosen, candidate]))
            report(" + ".join(c.name for c in (*chosen, candidate)) + f": {value:.4f}")
            trials.append((value, candidate))
        value, candidate = max(trials, key=lambda trial: trial[0])
        if value - best < min_gain:
            report(f"stop: the best addition, {candidate.name}, gains {value - best:+.4f} (< {min_gain:g})")
            break
        chosen.append(candidate)
        rest.remove(candidate)
        best = value
    return chosen
