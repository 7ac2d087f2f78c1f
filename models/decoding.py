"""The one decoder every model shares: greedy, sampling and beam search.

Models only supply ``step``; this module owns the search, the back-pointers and the per-token attention
history, so the attention row returned for token ``t`` is always the one that fed its prediction — after beam
reordering too (docs/decisions.md#model-protocol-and-alignment-rule).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor

from .protocol import AttnRecord, Captioner, DecState, EncState, VisualBatch, index_rows
from .vocab import Vocabulary


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


@dataclass(frozen=True)
class DecodingRules:
    """Options of the beam search against short and repetitive captions, as the reference codebases offer them
    (docs/decisions.md#decoding-rules).  The defaults change nothing.

    * ``length_penalty`` α: hypotheses are ranked by ``score / ((5 + |y|) / 6)^α``, the GNMT length penalty (Wu et
      al. 2016, arXiv:1609.08144, Eq. 14; self-critical.pytorch's ``--length_penalty wu_α``), and ranked so at
      every step, not only among the final beams: a finished caption keeps its length while live ones grow, so
      α > 0 lets a longer caption overtake a short one that ended early.
    * ``block_trigrams``: a word that would repeat a trigram already in the caption is never chosen (the hard
      form of self-critical.pytorch's ``block_trigrams``; fairseq's ``no_repeat_ngram_size=3``).
    * ``block_doubled_words``: a word is never chosen right after itself ("green green"; self-critical.pytorch's
      ``decoding_constraint``, "not allowing same word in a row").
    """

    length_penalty: float = 0.0
    block_trigrams: bool = False
    block_doubled_words: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.length_penalty <= 5.0:
            raise ValueError(f"length_penalty must lie in [0, 5], got {self.length_penalty}")

    @property
    def active(self) -> bool:
        return bool(self.length_penalty) or self.blocks

    @property
    def blocks(self) -> bool:
        """Whether some words are never chosen (by either blocking rule)."""
        return self.block_trigrams or self.block_doubled_words

    @classmethod
    def of_checkpoint(cls, meta: dict, source: str = "the checkpoint's record") -> "DecodingRules":
        """The rules stored with a checkpoint as its defaults (chosen on validation by ``captioner
        tune-decoding``), else none; also a ``captioner eval`` report's (``meta``: the report).  A ``decoding``
        that is not an object of these rules' names and kinds is a :class:`ValueError` naming ``source`` (the file
        it was read from), not a TypeError from the constructor."""
        decoding = meta.get("decoding", {})
        defaults = {rule.name: rule.default for rule in fields(cls)}

        def fits(name: str, value: object) -> bool:  # of its default's kind: a switch, or a number that is not one
            return (name in defaults and isinstance(value, (int, float))
                    and isinstance(value, bool) == isinstance(defaults[name], bool))

        if not isinstance(decoding, dict) or not all(fits(name, value) for name, value in decoding.items()):
            raise ValueError(f"{source}: its 'decoding' is {decoding!r}, not an object of the decoding rules "
                             f"({', '.join(defaults)})")
        try:
            return cls(**decoding)
        except ValueError as exc:  # a value out of its range
            raise ValueError(f"{source}: {exc}") from None

    def overridden(self, **named: float | bool | None) -> "DecodingRules":
        """These rules with the values a request or a command line names, by the rules' names (None: keep this
        one)."""
        return replace(self, **{name: value for name, value in named.items() if value is not None})

    def overridden_by(self, options: object) -> "DecodingRules":
        """:meth:`overridden` by the attributes of ``options`` that carry the rules' names: a request's parameters,
        a command line's arguments, an archive's options.  A rule added here reaches every caller at once."""
        return self.overridden(**{name: getattr(options, name, None) for name in RULE_NAMES})


NO_RULES = DecodingRules()
#: the rules' names, in their order: as a request, a command line, an answer and a report spell them
RULE_NAMES = tuple(rule.name for rule in fields(DecodingRules))


def gnmt_divisor(length, alpha):
    """The GNMT length penalty's divisor ``((5 + |y|) / 6)^α`` (Wu et al. 2016, arXiv:1609.08144, Eq. 14), of
    numbers or of tensors of lengths and α."""
    return ((5.0 + length) / 6.0) ** alpha


def _length_normalised(score: float, length: int, length_penalty: float | None) -> float:
    # None or 0: the summed log-prob (docs/decisions.md#decoding-rules)
    if not length_penalty:
        return score
    return score / gnmt_divisor(length, length_penalty)


def host_index(values: Sequence[int] | Tensor, device: torch.device | str) -> Tensor:
    """A small index tensor made on the host and sent to ``device`` without waiting for it: a tensor built on a
    GPU from a Python list, or ``repeat_interleave`` with GPU counts, waits for every kernel queued before it
    (and on a server, those of the CNN running beside the decoder)."""
    index = values if isinstance(values, Tensor) else torch.tensor(values, dtype=torch.long)
    return index.to(device, non_blocking=True)


def block_rows(blocks: Iterable[tuple[int, int]]) -> list[int]:
    """The rows of blocks ``(first row, size)``, block after block."""
    return [row for first, size in blocks for row in range(first, first + size)]


# --------------------------------------------------------------------------------------------------------------
# Beam search over a table of rows.  The rows of one decoding table are split into beam groups (one group per
# image / request, ``k`` contiguous rows each); groups may have different ``k``.  ``beam_search`` below runs one
# table with equal groups; the service's continuous batcher runs the same functions over a table whose groups
# come and go between steps, so both produce the same hypotheses.
# --------------------------------------------------------------------------------------------------------------
class BeamLayout:
    """Row layout of a decoding table: group ``g`` owns rows ``offsets[g] .. offsets[g] + sizes[g] - 1``."""

    def __init__(self, sizes: Sequence[int], device: torch.device | str = "cpu"):
        if not sizes or min(sizes) < 1:
            raise ValueError(f"every beam group needs at least one row, got {list(sizes)}")
        self.sizes = list(sizes)
        self.offsets = [0]
        for size in self.sizes[:-1]:
            self.offsets.append(self.offsets[-1] + size)
        self.rows = sum(self.sizes)
        self.device = torch.device(device)
        # every index is made on the host (see host_index): a layout is rebuilt whenever a request joins or leaves
        # a server's table
        sizes_t = torch.tensor(self.sizes, dtype=torch.long)
        self.sizes_tensor = host_index(sizes_t, device)
        self.group_of_row = host_index(torch.repeat_interleave(torch.arange(len(self.sizes)), sizes_t), device)
        # one top-k per distinct beam width: (k, rows of those groups in table order or None for all rows,
        # first row of each of those groups)
        self.by_width: list[tuple[int, Tensor | None, Tensor]] = []
        for k in sorted(set(self.sizes)):
            groups = [g for g, size in enumerate(self.sizes) if size == k]
            firsts = [self.offsets[g] for g in groups]
            rows = None if len(groups) == len(self.sizes) else host_index(block_rows((f, k) for f in firsts), device)
            self.by_width.append((k, rows, host_index(firsts, device)))

    @property
    def groups(self) -> int:
        return len(self.sizes)

    def initial_rows(self, bos_id: int) -> tuple[Tensor, Tensor, Tensor]:
        """The rows before the first step: the previous word of each (``bos_id``), its score and whether it has
        finished.  Only the first row of each group is live at the start; the others get -inf, so the first top-k
        of a group picks ``k`` different words from its one live row."""
        scores = torch.full((self.rows,), float("-inf"))
        scores[self.offsets] = 0.0
        prev = torch.full((self.rows,), bos_id, dtype=torch.long, device=self.device)
        finished = torch.zeros(self.rows, dtype=torch.bool, device=self.device)
        return prev, scores.to(self.device, non_blocking=True), finished

    def groups_done(self, finished: Tensor) -> Tensor:
        """``[groups]`` bool: every row of the group has emitted EOS."""
        counts = torch.zeros(self.groups, dtype=torch.long, device=finished.device)
        counts.index_add_(0, self.group_of_row, finished.long())
        return counts == self.sizes_tensor


@dataclass
class BeamStep:
    """The outcome of one beam step: new row ``i`` continues old row ``pointer[i]`` with ``tokens[i]``."""

    pointer: Tensor
    tokens: Tensor
    token_logprobs: Tensor
    scores: Tensor
    finished: Tensor


def never_emitted(model: Captioner) -> tuple[int, ...]:
    """Tokens a caption can never contain: ``<pad>`` (which the vocabulary drops, so an emitted one would leave an
    attention row without a word), ``<bos>`` (training never targets either, but an untrained or unlucky
    model can still rank them first) and ``<unk>``, which training does target (every word below the count
    threshold) but which tells a user nothing: the model's next best word is taken instead, as
    self-critical.pytorch's beam search does.  Every vocabulary of the project holds ``<unk>`` at the same id."""
    return (model.pad_id, model.bos_id, Vocabulary.unk_id)


def _no_empty_caption(logprobs: Tensor, prev: Tensor, bos_id: int, eos_id: int) -> Tensor:
    """``logprobs`` (a fresh tensor, written in place) with EOS forbidden to the rows about to choose their caption's
    first token, those whose previous token is BOS (which is never emitted): a caption has a word.  A large beam
    otherwise keeps the one-token caption "<eos>" (its score is one log-prob, where every real caption sums several)
    and, with a length penalty, may rank it first.  Every decoder applies this one rule."""
    logprobs[:, eos_id] = logprobs[:, eos_id].masked_fill(prev == bos_id, float("-inf"))
    return logprobs


def _forbid(logprobs: Tensor, token_ids: tuple[int, ...]) -> Tensor:
    if not token_ids:
        return logprobs
    # integer column writes: no index tensor to build and copy to the device at every step
    logprobs = logprobs.clone()
    for token in token_ids:
        logprobs[:, token] = float("-inf")
    return logprobs


@dataclass
class RowHistory:
    """What the :class:`DecodingRules` need of every row of a decoding table: the words it emitted ``tokens`` ``[R,
    W]`` (entries at or past ``lengths`` are meaningless), ``lengths`` ``[R]`` (tokens emitted, EOS included, frozen
    once the row has finished) and each row's own rules, ``alpha`` ``[R]`` (length penalty), ``trigrams`` ``[R]``
    (block repeated trigrams) and ``doubles`` ``[R]`` (block doubled words): rows of different requests share a
    table in the service's batcher."""

    tokens: Tensor
    lengths: Tensor
    alpha: Tensor
    trigrams: Tensor
    doubles: Tensor
    # known on the host, so a table whose rows have no rules skips their arithmetic without asking the device
    penalised: bool = False
    blocking: bool = False

    @classmethod
    def start(cls, widths: Sequence[int], rules: Sequence[DecodingRules], max_len: int,
              device: torch.device | str) -> "RowHistory":
        """Empty histories for groups of ``widths[g]`` rows, group ``g`` decoded with ``rules[g]``."""
        rows, counts = sum(widths), torch.tensor(list(widths), dtype=torch.long)
        alpha = torch.repeat_interleave(torch.tensor([r.length_penalty for r in rules], dtype=torch.float32), counts)
        trigrams, doubles = (torch.repeat_interleave(torch.tensor(flags), counts).to(device, non_blocking=True)
                             for flags in ([r.block_trigrams for r in rules], [r.block_doubled_words for r in rules]))
        # one column more than any caption's length: a finished row keeps writing EOS just past its end
        return cls(torch.zeros((rows, max_len + 1), dtype=torch.long, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device),
                   alpha.to(device, non_blocking=True), trigrams, doubles,
                   penalised=any(r.length_penalty for r in rules), blocking=any(r.blocks for r in rules))

    def select(self, rows: Tensor) -> "RowHistory":
        return replace(self, **{name: getattr(self, name).index_select(0, rows) for name in ROW_FIELDS})

    def cat(self, other: "RowHistory") -> "RowHistory":
        width = max(self.tokens.shape[1], other.tokens.shape[1])
        tokens = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in (self.tokens, other.tokens)]
        return RowHistory(torch.cat(tokens), *(torch.cat([getattr(self, name), getattr(other, name)])
                                               for name in ROW_FIELDS[1:]),
                          penalised=self.penalised or other.penalised, blocking=self.blocking or other.blocking)

    def after(self, step: "BeamStep", finished_before: Tensor) -> "RowHistory":
        """The histories after ``step``: row ``i`` continues row ``step.pointer[i]``; a row that had not finished
        appends its token (a finished one only repeats EOS, which is not counted)."""
        parent = self.select(step.pointer)
        live = ~finished_before.index_select(0, step.pointer)
        position = parent.lengths.clamp(max=parent.tokens.shape[1] - 1)
        parent.tokens.scatter_(1, position[:, None], step.tokens[:, None])
        parent.lengths = parent.lengths + live.long()
        return parent

    def blocked(self, vocab: int) -> Tensor:
        """``[R, V]`` bool: the words that would complete a trigram the row already holds (rows that block
        trigrams), and the row's last word (rows that block doubled words)."""
        tokens, n = self.tokens, self.lengths
        last_two = tokens.gather(1, torch.stack([(n - 2).clamp(min=0), (n - 1).clamp(min=0)], 1))
        starts = torch.arange(tokens.shape[1] - 2, device=tokens.device)
        # trigram i = tokens[i : i+3] lies inside the caption when i + 2 <= n - 1, and starts like the last two
        repeats = ((tokens[:, :-2] == last_two[:, :1]) & (tokens[:, 1:-1] == last_two[:, 1:])
                   & (starts[None, :] <= (n - 3)[:, None]) & self.trigrams[:, None])
        counts = torch.zeros((tokens.shape[0], vocab), device=tokens.device)
        counts.scatter_add_(1, tokens[:, 2:], repeats.float())
        # the last word, once there is one (a finished row's last word is EOS, which beam_step lets it repeat)
        return counts.scatter_add_(1, last_two[:, 1:], ((n > 0) & self.doubles).float()[:, None]) > 0

    def penalty(self, finished: Tensor) -> Tensor:
        """``[R]`` GNMT divisor ``((5 + |y|) / 6)^α`` of every row's candidates: a live row's grow by one word."""
        return gnmt_divisor((self.lengths + (~finished).long()).float(), self.alpha)


#: :class:`RowHistory`'s tensors of one entry per row, in its fields' order (the others are flags of the table)
ROW_FIELDS = ("tokens", "lengths", "alpha", "trigrams", "doubles")


def beam_step(logprobs: Tensor, scores: Tensor, finished: Tensor, layout: BeamLayout, prev: Tensor, bos_id: int,
              eos_id: int, forbidden: tuple[int, ...] = (), history: RowHistory | None = None) -> BeamStep:
    """Top-k of (beam × vocabulary) within every beam group, with back-pointers; ``forbidden`` tokens (see
    :func:`never_emitted`) are never chosen, a ``history`` applies its rows' :class:`DecodingRules`, and the rows
    whose previous token ``prev`` is BOS cannot end their caption yet (:func:`_no_empty_caption`).

    Finished rows may only be extended by EOS at log-prob 0, so they keep competing with live ones on their
    final score (length-normalised when a row has a length penalty).  Everything stays on the device: no host
    synchronisation happens here.
    """
    logprobs = _forbid(logprobs.float(), forbidden)
    if history is not None and history.blocking:
        logprobs = logprobs.masked_fill(history.blocked(logprobs.shape[1]), float("-inf"))
    vocab = logprobs.shape[1]
    allowed = logprobs.masked_fill(finished[:, None], float("-inf"))
    allowed[:, eos_id] = torch.where(finished, torch.zeros_like(scores), logprobs[:, eos_id])
    allowed = _no_empty_caption(allowed, prev, bos_id, eos_id)  # a finished row's previous token is EOS, not BOS
    candidates = scores[:, None] + allowed
    # what the top-k ranks: the summed log-prob, or with a length penalty that sum over each row's divisor
    penalised = history is not None and history.penalised
    ranked = candidates / history.penalty(finished)[:, None] if penalised else candidates
    if len(layout.by_width) == 1:
        k, _, firsts = layout.by_width[0]
        top_ranked, top_index = ranked.view(layout.groups, k * vocab).topk(k, dim=1)
        top_scores = candidates.view(layout.groups, k * vocab).gather(1, top_index) if penalised else top_ranked
        pointer = (firsts[:, None] + torch.div(top_index, vocab, rounding_mode="floor")).view(-1)
        tokens, new_scores = (top_index % vocab).view(-1), top_scores.view(-1)
    else:
        pointer = torch.empty(layout.rows, dtype=torch.long, device=scores.device)
        tokens = torch.empty_like(pointer)
        new_scores = torch.empty_like(scores)
        for k, rows, firsts in layout.by_width:
            top_ranked, top_index = ranked.index_select(0, rows).view(len(firsts), k * vocab).topk(k, dim=1)
            top_scores = (candidates.index_select(0, rows).view(len(firsts), k * vocab).gather(1, top_index)
                          if penalised else top_ranked)
            pointer.index_copy_(0, rows,
                                (firsts[:, None] + torch.div(top_index, vocab, rounding_mode="floor")).view(-1))
            tokens.index_copy_(0, rows, (top_index % vocab).view(-1))
            new_scores.index_copy_(0, rows, top_scores.view(-1))
    return BeamStep(pointer=pointer, tokens=tokens, token_logprobs=allowed[pointer, tokens], scores=new_scores,
                    finished=finished.index_select(0, pointer) | (tokens == eos_id))


@dataclass
class StepRecord:
    """What one step emitted, row by row, and where each row came from (``parent``: a row of the previous
    record).  The attention stored for a row is the one that fed its token: the parent's row of this step's
    attention (docs/decisions.md#model-protocol-and-alignment-rule)."""

    parent: Tensor
    tokens: Tensor
    token_logprobs: Tensor
    attention: Tensor
    extras: dict[str, Tensor] = field(default_factory=dict)


def record_step(step: BeamStep, attn: AttnRecord, parent: Tensor | None = None,
                extras: tuple[str, ...] | bool = True) -> StepRecord:
    """The history entry of ``step``; ``parent`` defaults to the step's back-pointers (a table whose rows did not
    change between steps)."""
    wanted = attn.extras if extras is True else {n: v for n, v in attn.extras.items() if extras and n in extras}
    return StepRecord(
        parent=step.pointer if parent is None else parent, tokens=step.tokens, token_logprobs=step.token_logprobs,
        attention=attn.primary.index_select(0, step.pointer).float(),
        extras={name: value.index_select(0, step.pointer).float() for name, value in wanted.items()})


def backtrack(records: Sequence[StepRecord], rows: Tensor) -> dict[str, Tensor]:
    """Follow the back-pointers from ``rows`` of the last record to the first: ``{name: [len(rows), T, ...]}``
    with names ``tokens``, ``logprobs``, ``attention`` and ``extra:<name>``."""
    columns: dict[str, list[Tensor]] = {}
    for record in reversed(records):
        values = {"tokens": record.tokens, "logprobs": record.token_logprobs, "attention": record.attention,
                  **{f"extra:{name}": value for name, value in record.extras.items()}}
        for name, value in values.items():
            columns.setdefault(name, []).append(value.index_select(0, rows))
        rows = record.parent.index_select(0, rows)
    return {name: torch.stack(values[::-1], dim=1) for name, values in columns.items()}


def expand_rows(state: dict[str, Tensor], counts: Sequence[int]) -> dict[str, Tensor]:
    """Repeat row ``i`` of every tensor ``counts[i]`` times: image ``i``'s rows of a decoding table (a beam of
    ``counts[i]``, or as many samples), the one expansion that beam search, sampling and the serving runtimes use."""
    index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))
    return index_rows(state, host_index(index, next(iter(state.values())).device))


@torch.no_grad()
def beam_search(
    model: Captioner,
    vis: VisualBatch,
    k: int = 3,
    max_len: int = 20,
    rules: DecodingRules = NO_RULES,
    n_best: int = 1,
    extras: tuple[str, ...] | bool = True,
) -> list[list[Hypothesis]]:
    """Beam search over a batch of images; returns ``n_best`` hypotheses per image, best first.

    Finished hypotheses may only be extended by EOS at log-prob 0, so they keep competing with live ones on
    their final score.  ``rules``: length penalty, trigram and doubled-word blocking (:class:`DecodingRules`).
    ``extras=True`` keeps every extra map the model reports; a tuple keeps only those.
    """
    check_search([k], max_len, rules, n_best)
    model.check_visual(vis)
    enc = expand_rows(model.encode(vis), [k] * vis.feats.shape[0])
    state = model.init_state(enc)
    return search_rows(model.step, model.reorder, enc, state, [k] * vis.feats.shape[0], model.bos_id, model.eos_id,
                       never_emitted(model), max_len, rules, n_best, extras)


def _whole(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_search(widths: Sequence[int], max_len: int, rules: DecodingRules, n_best: int = 1) -> None:
    """Refuse a search that cannot be run, by the option's name: a beam of 0 was an error about ``n_best``, -1
    PyTorch's "repeats can not be negative", ``max_len=0`` a ``KeyError`` (a library user's audit)."""
    bad = [width for width in widths if not _whole(width) or width < 1]
    if bad:
        raise ValueError(f"beam_size must be a whole number of at least 1, got {bad[0]!r}")
    if n_best < 1 or n_best > min(widths):
        raise ValueError(f"need 1 <= n_best <= every beam width, got widths={list(widths)}, n_best={n_best}")
    if not _whole(max_len) or max_len < 1:
        raise ValueError(f"max_len must be a whole number of at least 1, got {max_len!r}")
    if not isinstance(rules, DecodingRules):
        raise TypeError(f"rules must be DecodingRules(length_penalty=…, block_trigrams=…, block_doubled_words=…), "
                        f"got {rules!r}")


StepFn = Callable[[Tensor, DecState, EncState], tuple[Tensor, DecState, AttnRecord]]
ReorderFn = Callable[[DecState, Tensor], DecState]


@torch.no_grad()
def search_rows(step: StepFn, reorder: ReorderFn, enc: EncState, state: DecState, widths: Sequence[int], bos_id: int,
                eos_id: int, forbidden: tuple[int, ...] = (), max_len: int = 20,
                rules: DecodingRules = NO_RULES, n_best: int = 1,
                extras: tuple[str, ...] | bool = True) -> list[list[Hypothesis]]:
    """The loop of :func:`beam_search` over rows that are already encoded and expanded (image ``g`` owns
    ``widths[g]`` contiguous rows of ``enc`` and ``state``), driven by any ``step`` / ``reorder`` pair with the
    :class:`~captioner.models.protocol.Captioner` signatures: a PyTorch model's own methods or an exported graph's.
    Returns ``n_best`` hypotheses per image, best first.  Its callers check the widths, ``n_best``, the length and
    the rules (:func:`check_search`) before they encode and expand the rows: a larger ``n_best`` than a width here
    gives that image fewer hypotheses."""
    device = next(iter(enc.values())).device
    layout = BeamLayout(widths, device)
    prev, scores, finished = layout.initial_rows(bos_id)
    history = RowHistory.start(widths, [rules] * len(widths), max_len, device) if rules.active else None
    records: list[StepRecord] = []

    for _ in range(max_len):
        logprobs, state, attn = step(prev, state, enc)
        beam = beam_step(logprobs, scores, finished, layout, prev, bos_id, eos_id, forbidden, history)
        if history is not None:
            history = history.after(beam, finished)
        records.append(record_step(beam, attn, extras=extras))
        state = reorder(state, beam.pointer)
        scores, finished, prev = beam.scores, beam.finished, beam.tokens
        if bool(finished.all()):
            break

    history = backtrack(records, torch.arange(layout.rows, device=device))
    return [collect_hypotheses({name: value[first:first + width] for name, value in history.items()},
                               scores[first:first + width], eos_id, n_best, rules.length_penalty)
            for first, width in zip(layout.offsets, layout.sizes)]


def collect_hypotheses(history: dict[str, Tensor], scores: Tensor, eos_id: int, n_best: int,
                       length_penalty: float | None) -> list[Hypothesis]:
    """The ``n_best`` hypotheses of one beam group, best first, from its backtracked ``history`` (``[k, T, ...]``
    per name) and final ``scores`` ``[k]``; tokens after the first EOS are dropped."""
    history = {name: value.cpu() for name, value in history.items()}
    scores = scores.cpu()
    hyps = []
    for j in range(scores.shape[0]):
        ids = history["tokens"][j].tolist()
        length = ids.index(eos_id) + 1 if eos_id in ids else len(ids)
        hyps.append(Hypothesis(
            token_ids=ids[:length],
            token_logprobs=history["logprobs"][j, :length].tolist(),
            attention=history["attention"][j, :length],
            extras={n[6:]: v[j, :length] for n, v in history.items() if n.startswith("extra:")},
            score=_length_normalised(float(scores[j]), length, length_penalty),
            ended_with_eos=eos_id in ids,
        ))
    hyps.sort(key=lambda h: h.score, reverse=True)
    return hyps[:n_best]


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
        # what the beam search forbids: the never-emitted tokens, and ending the caption before its first word
        allowed = _no_empty_caption(_forbid(logprobs.float(), never_emitted(model)), prev, model.bos_id, model.eos_id)
        best, prev = allowed.max(-1)
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


def sample(model: Captioner, vis: VisualBatch, n: int = 1, max_len: int = 20) -> Samples:
    """Multinomial sampling from the full softmax, ``n`` captions per image (rows ``b*n .. b*n+n-1``).

    Nothing is forbidden here, unlike the beam search (:func:`never_emitted`): REINFORCE's gradient
    ``A · ∇ log p(y^s)`` is only unbiased when ``y^s`` is drawn from the ``p`` it differentiates.  Drawing with
    ``<unk>`` / ``<pad>`` / ``<bos>`` masked while the loss differentiated the full softmax left those tokens
    without any push down; under SCST's mostly negative advantages they were pushed up instead, until they held
    most of the mass and the decoded captions collapsed (docs/decisions.md, "Flickr8k: SCST").  For the same reason
    there is no temperature: a tempered draw is not from that ``p`` either."""
    enc = expand_rows(model.encode(vis), [n] * vis.feats.shape[0])
    state = model.init_state(enc)
    rows = vis.feats.shape[0] * n
    prev = torch.full((rows,), model.bos_id, dtype=torch.long, device=vis.feats.device)
    alive = torch.ones(rows, dtype=torch.bool, device=vis.feats.device)
    tokens, logps, masks = [], [], []
    for _ in range(max_len):
        logprobs, state, _ = model.step(prev, state, enc)
        with torch.no_grad():
            drawn = torch.multinomial(logprobs.softmax(-1), 1).squeeze(1)
        drawn = torch.where(alive, drawn, torch.full_like(drawn, model.pad_id))
        tokens.append(drawn)
        logps.append(logprobs.gather(1, drawn[:, None]).squeeze(1))
        masks.append(alive)
        alive = alive & (drawn != model.eos_id)
        prev = drawn
        if not bool(alive.any()):
            break
    return Samples(torch.stack(tokens, 1), torch.stack(logps, 1), torch.stack(masks, 1))
