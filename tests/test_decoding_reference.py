"""The shared beam search and its rules against self-critical.pytorch's decoders as published.

References transcribed from ruotianluo/self-critical.pytorch (commit 0edc73621e337af88c35d7108ee54dbe06ec8aa0):

* ``models/CaptionModel.py``, ``beam_search`` / ``beam_step`` (one group, no diversity): at every step each live beam
  offers its ``beam_size`` best words, the ``beam_size`` best (beam, word) pairs by summed log-prob go on, a beam that
  has just emitted the end token (or reached the length limit) is copied to ``done_beams`` with its score passed
  through ``length_penalty(t + 1, p)`` and its slot set to -1000; ``<unk>`` loses 1000 at every step ("suppress UNK
  tokens in the decoding"); the answer is the best of ``done_beams``.
  With ``decoding_constraint`` ("not allowing same word in a row") each beam's previous word is set to -inf
  before the step's candidates are ranked.
* ``misc/utils.py``, ``penalty_builder`` / ``length_wu``: ``p / (((5 + length) ** alpha) / ((5 + 1) ** alpha))``,
  the length counting the end token (``t + 1`` at the step that emitted it).
* ``models/AttModel.py``, ``_sample`` with ``block_trigrams``: from ``t >= 3`` the trigram ending at the previous
  word is stored, and the words that would complete a stored trigram after the last two words are penalised by
  ``-0.693 * alpha`` (the code's comment: "alpha -> infty works best"; the project uses the hard limit).

The project's search differs where docs/decisions.md#decoding-rules says so (finished captions keep their row and
the length penalty ranks every step's candidates; EOS is never the first token).  The toy model below never ranks
``<pad>``, ``<bos>`` or a first-step EOS, so those documented differences do not arise here, and with α = 0 the
two searches must return the same caption.
"""

from __future__ import annotations

import pytest
import torch

from captioner.models.decoding import DecodingRules, search_rows
from captioner.models.protocol import AttnRecord
from captioner.models.vocab import Vocabulary

PAD, BOS, EOS, UNK = 0, 1, 2, Vocabulary.unk_id
VOCAB = 12


class ToyDecoder:
    """A small recurrent decoder with fixed random weights: the next word depends on the whole prefix (through
    ``h``) and on the image (a bias per image), so beams diverge and reorder."""

    def __init__(self, seed: int, images: int, eos_bias: float = 0.0, repeat: bool = False):
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(VOCAB, 8, generator=g, dtype=torch.float64)
        self.recur = torch.randn(8, 8, generator=g, dtype=torch.float64) * 0.6
        self.out = torch.randn(8, VOCAB, generator=g, dtype=torch.float64) * 1.5
        self.image_bias = torch.randn(images, VOCAB, generator=g, dtype=torch.float64)
        self.image_bias[:, EOS] += eos_bias
        self.image_bias[:, UNK] += 1.5  # <unk> is often the likeliest word: the rule has to act
        if repeat:  # a few words dominate: captions repeat phrases
            self.image_bias[:, 4:7] += 3.0

    def logprobs(self, prev: torch.Tensor, h: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(h @ self.recur + self.embed[prev])
        logits = h @ self.out + self.image_bias[image]
        logits[:, PAD] = float("-inf")  # the model never ranks <pad> or <bos>, nor EOS before a word
        logits[:, BOS] = float("-inf")
        logits[:, EOS] = logits[:, EOS].masked_fill(prev == BOS, float("-inf"))
        return torch.log_softmax(logits, -1), h

    # the Captioner protocol's step / reorder, for the project's search_rows
    def step(self, prev, state, enc):
        logprobs, h = self.logprobs(prev, state["h"], enc["image"])
        return logprobs.float(), {"h": h}, AttnRecord(primary=torch.ones(len(prev), 1))

    @staticmethod
    def reorder(state, pointer):
        return {"h": state["h"].index_select(0, pointer)}


def project_beam(model: ToyDecoder, images: int, k: int, max_len: int, rules: DecodingRules):
    image = torch.arange(images).repeat_interleave(k)
    state = {"h": torch.zeros(images * k, 8, dtype=torch.float64)}
    return search_rows(model.step, model.reorder, {"image": image}, state, [k] * images, BOS, EOS,
                       (PAD, BOS, UNK), max_len, rules, extras=())


def length_wu(length, logprobs, alpha=0.0):
    # self-critical.pytorch misc/utils.py, length_wu
    modifier = (((5 + length) ** alpha) / ((5 + 1) ** alpha))
    return logprobs / modifier


def self_critical_beam(model: ToyDecoder, image: int, beam_size: int, seq_length: int, alpha: float,
                       decoding_constraint: bool = False):
    """self-critical.pytorch ``CaptionModel.beam_search`` with one group, transcribed (its EOS is our EOS id, its
    UNK column our UNK id)."""
    beam_seq = torch.zeros(seq_length, beam_size, dtype=torch.long)
    beam_seq_logprobs = torch.zeros(seq_length, beam_size, dtype=torch.float64)
    beam_logprobs_sum = torch.zeros(beam_size, dtype=torch.float64)
    done_beams = []
    state = torch.zeros(beam_size, 8, dtype=torch.float64)
    logprobs, state = model.logprobs(torch.full((beam_size,), BOS), state, torch.full((beam_size,), image))
    for t in range(seq_length):
        logprobsf = logprobs.clone()
        # suppress previous word
        if decoding_constraint and t > 0:
            logprobsf.scatter_(1, beam_seq[t - 1].unsqueeze(1), float("-inf"))
        logprobsf[:, UNK] = logprobsf[:, UNK] - 1000  # suppress UNK tokens in the decoding
        # beam_step
        ys, ix = torch.sort(logprobsf, 1, True)
        candidates = []
        cols = min(beam_size, ys.size(1))
        rows = 1 if t == 0 else beam_size
        for c in range(cols):
            for q in range(rows):
                local_logprob = ys[q, c].item()
                candidate_logprob = beam_logprobs_sum[q] + local_logprob
                candidates.append({"c": ix[q, c], "q": q, "p": candidate_logprob, "r": logprobs[q, ix[q, c]]})
        candidates = sorted(candidates, key=lambda x: -x["p"])
        new_state = state.clone()
        if t >= 1:
            beam_seq_prev = beam_seq[:t].clone()
            beam_seq_logprobs_prev = beam_seq_logprobs[:t].clone()
        for vix in range(beam_size):
            v = candidates[vix]
            if t >= 1:
                beam_seq[:t, vix] = beam_seq_prev[:, v["q"]]
                beam_seq_logprobs[:t, vix] = beam_seq_logprobs_prev[:, v["q"]]
            new_state[vix] = state[v["q"]]
            beam_seq[t, vix] = v["c"]
            beam_seq_logprobs[t, vix] = v["r"]
            beam_logprobs_sum[vix] = v["p"]
        state = new_state
        # if time's up... or if end token is reached then copy beams
        for vix in range(beam_size):
            if beam_seq[t, vix] == EOS or t == seq_length - 1:
                final_beam = {"seq": beam_seq[:, vix].clone(), "p": beam_logprobs_sum[vix].item()}
                final_beam["p"] = length_wu(t + 1, final_beam["p"], alpha)
                done_beams.append(final_beam)
                beam_logprobs_sum[vix] = -1000  # don't continue beams from finished sequences
        it = beam_seq[t]
        logprobs, state = model.logprobs(it, state, torch.full((beam_size,), image))
    best = sorted(done_beams, key=lambda x: -x["p"])[0]
    seq = best["seq"].tolist()
    return (seq[:seq.index(EOS) + 1] if EOS in seq else seq), best["p"]


def self_critical_greedy_blocking(model: ToyDecoder, image: int, seq_length: int, alpha: float = 1e20):
    """self-critical.pytorch ``AttModel._sample`` (greedy, ``block_trigrams=1``) for one image, transcribed; ``alpha``
    is the code's 2.0 taken to the limit its comment recommends."""
    seq = torch.zeros(1, seq_length, dtype=torch.long)
    trigrams = []  # will be a list of batch_size dictionaries
    state = torch.zeros(1, 8, dtype=torch.float64)
    it = torch.tensor([BOS])
    for t in range(seq_length + 1):
        logprobs, state = model.logprobs(it, state, torch.tensor([image]))
        logprobs = logprobs.clone()
        logprobs[:, UNK] = float("-inf")  # the project's <unk> rule, tested on its own elsewhere
        if t >= 3:
            # Store trigram generated at last step
            prev_two_batch = seq[:, t - 3:t - 1]
            for i in range(1):
                prev_two = (prev_two_batch[i][0].item(), prev_two_batch[i][1].item())
                current = seq[i][t - 1].item()
                if t == 3:  # initialize
                    trigrams.append({prev_two: [current]})
                elif t > 3:
                    if prev_two in trigrams[i]:
                        trigrams[i][prev_two].append(current)
                    else:
                        trigrams[i][prev_two] = [current]
            # Block used trigrams at next step
            prev_two_batch = seq[:, t - 2:t]
            mask = torch.zeros(logprobs.size(), dtype=torch.float64)
            for i in range(1):
                prev_two = (prev_two_batch[i][0].item(), prev_two_batch[i][1].item())
                if prev_two in trigrams[i]:
                    for j in trigrams[i][prev_two]:
                        mask[i, j] += 1
            logprobs = logprobs + (mask * -0.693 * alpha)
        if t == seq_length:
            break
        it = logprobs.argmax(1)
        seq[:, t] = it
        if it.item() == EOS:
            return seq[0, :t + 1].tolist()
    return seq[0].tolist()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_plain_beam_search_equals_self_critical(seed, k):
    images, max_len = 4, 9
    model = ToyDecoder(seed, images, eos_bias=-0.5)
    ours = project_beam(model, images, k, max_len, DecodingRules())
    for image in range(images):
        theirs, score = self_critical_beam(model, image, k, max_len, 0.0)
        assert ours[image][0].token_ids == theirs
        assert UNK not in theirs
        assert ours[image][0].score == pytest.approx(score, abs=1e-4)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0])
def test_final_length_normalisation_is_length_wu_with_the_end_token_counted(seed, alpha):
    """The final score of a caption is self-critical.pytorch's ``length_wu(t + 1, p)``: its summed log-prob over
    ((5 + length) / 6)^α, the length counting the end token."""
    images, k, max_len = 3, 3, 9
    model = ToyDecoder(seed, images)
    for hyps in project_beam(model, images, k, max_len, DecodingRules(length_penalty=alpha)):
        for hyp in hyps:
            assert hyp.score == pytest.approx(length_wu(len(hyp.token_ids), sum(hyp.token_logprobs), alpha),
                                              rel=1e-5)


@pytest.mark.parametrize("seed", range(8))
def test_trigram_blocking_is_self_criticals_block_trigrams_in_its_hard_limit(seed):
    images, max_len = 4, 16
    model = ToyDecoder(seed, images, eos_bias=-3.0, repeat=True)
    ours = project_beam(model, images, 1, max_len, DecodingRules(block_trigrams=True))
    plain = project_beam(model, images, 1, max_len, DecodingRules())
    repeated = 0
    for image in range(images):
        assert ours[image][0].token_ids == self_critical_greedy_blocking(model, image, max_len)
        tokens = plain[image][0].token_ids
        grams = [tuple(tokens[i:i + 3]) for i in range(len(tokens) - 2)]
        repeated += len(grams) != len(set(grams))
    assert seed or repeated, "the toy model repeats trigrams without the rule"


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_doubled_word_blocking_is_self_criticals_decoding_constraint(seed, k):
    """``block_doubled_words`` is self-critical.pytorch's ``decoding_constraint``: the same captions and scores from
    a toy model that doubles words without it.  Its captions run to the length limit (no end token), where the
    searches' documented difference about captions that finished early cannot arise."""
    images, max_len = 4, 12
    model = ToyDecoder(seed, images, eos_bias=-50.0, repeat=True)
    ours = project_beam(model, images, k, max_len, DecodingRules(block_doubled_words=True))
    plain = project_beam(model, images, k, max_len, DecodingRules())
    doubled = 0
    for image in range(images):
        theirs, score = self_critical_beam(model, image, k, max_len, 0.0, decoding_constraint=True)
        tokens = ours[image][0].token_ids
        assert tokens == theirs and ours[image][0].score == pytest.approx(score, abs=1e-4)
        assert all(a != b for a, b in zip(tokens, tokens[1:]))
        doubled += any(a == b for a, b in zip(plain[image][0].token_ids, plain[image][0].token_ids[1:]))
    assert doubled, "the toy model doubles words without the rule"
