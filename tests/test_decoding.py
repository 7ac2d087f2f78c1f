"""Decoding invariants (docs/decisions.md#model-protocol-and-alignment-rule) on a tiny random SAT."""

import dataclasses

import pytest
import torch

from captioner.models.decoding import NO_RULES, ROW_FIELDS, BeamLayout, DecodingRules, RowHistory, backtrack, \
    beam_search, beam_step, check_search, collect_hypotheses, greedy, never_emitted, record_step, sample, search_rows
from captioner.models.evaluation import tuning
from captioner.models.evaluation.tuning import best_row, rules_of
from captioner.models.protocol import AttnRecord, VisualBatch, index_rows
from captioner.models.vocab import Vocabulary

from .model_checks import assert_beam_one_is_greedy


@torch.no_grad()
def _teacher_forced(model, vis, hyp, row):
    """Re-score a decoded caption with teacher forcing: per-token log-probs and attention rows."""
    single = VisualBatch(vis.feats[row:row + 1], vis.mask[row:row + 1])
    tokens = torch.tensor([hyp.token_ids])
    enc = model.encode(single)
    state = model.init_state(enc)
    prev = torch.tensor([model.bos_id])
    logps, attns = [], []
    for t in range(tokens.shape[1]):
        logprobs, state, attn = model.step(prev, state, enc)
        logps.append(float(logprobs[0, tokens[0, t]]))
        attns.append(attn.primary[0])
        prev = tokens[:, t]
    return logps, torch.stack(attns)


def test_beam_one_equals_greedy(tiny_sat, random_visuals):
    assert_beam_one_is_greedy(tiny_sat, random_visuals, max_len=12)


def test_beam_attention_is_aligned_with_tokens(tiny_sat, random_visuals):
    results = beam_search(tiny_sat, random_visuals, k=4, max_len=12, n_best=3)
    for row, hyps in enumerate(results):
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        for hyp in hyps:
            assert hyp.attention.shape == (len(hyp.token_ids), 9)
            logps, attention = _teacher_forced(tiny_sat, random_visuals, hyp, row)
            # re-scoring the returned tokens gives the same attention rows and log-probs: reordering is right
            torch.testing.assert_close(hyp.attention, attention, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(torch.tensor(hyp.token_logprobs), torch.tensor(logps), atol=1e-5, rtol=1e-5)
            assert abs(hyp.score - sum(logps)) < 1e-4


def test_rows_sum_to_one_and_eos_is_flagged(tiny_sat, random_visuals):
    tiny_sat.out_word.bias.data[tiny_sat.eos_id] += 3.0  # make captions end early so EOS is emitted
    for hyps in beam_search(tiny_sat, random_visuals, k=3, max_len=12):
        hyp = hyps[0]
        torch.testing.assert_close(hyp.attention.sum(-1), torch.ones(len(hyp.token_ids)))
        assert hyp.ended_with_eos and hyp.token_ids[-1] == tiny_sat.eos_id
        assert hyp.is_eos == [False] * (len(hyp.token_ids) - 1) + [True]
        assert "beta_gate" in hyp.extras and hyp.extras["beta_gate"].shape == (len(hyp.token_ids), 1)


def test_extras_keeps_only_the_extra_maps_asked_for(tiny_sat, random_visuals):
    """``extras=True`` keeps every extra map the model reports, a tuple only those it names: evaluation and
    grounding pass ``()`` and keep none, instead of a map per token of every hypothesis."""
    every = beam_search(tiny_sat, random_visuals, k=2, max_len=4, extras=True)
    assert all("beta_gate" in hyps[0].extras for hyps in every)
    assert all(hyps[0].extras == {} for hyps in beam_search(tiny_sat, random_visuals, k=2, max_len=4, extras=()))
    named = beam_search(tiny_sat, random_visuals, k=2, max_len=4, extras=("beta_gate",))
    assert all(set(hyps[0].extras) == {"beta_gate"} for hyps in named)
    assert all(hyps[0].extras == {} for hyps in beam_search(tiny_sat, random_visuals, k=2, max_len=4,
                                                            extras=("not_reported",)))
    # extras=False (the annotation's other switch) keeps none too, rather than asking whether a name is "in" False
    assert all(hyps[0].extras == {} for hyps in beam_search(tiny_sat, random_visuals, k=2, max_len=4, extras=False))


def test_beam_search_beats_or_equals_greedy_score(tiny_sat, random_visuals):
    for beam, single in zip(beam_search(tiny_sat, random_visuals, k=5, max_len=8), greedy(tiny_sat, random_visuals, 8)):
        if single.ended_with_eos and beam[0].ended_with_eos:
            assert beam[0].score >= single.score - 1e-5


def test_batch_does_not_change_results(tiny_sat, random_visuals):
    together = beam_search(tiny_sat, random_visuals, k=3, max_len=10)
    for row in range(3):
        alone = beam_search(tiny_sat, VisualBatch(random_visuals.feats[row:row + 1], random_visuals.mask[row:row + 1]),
                            k=3, max_len=10)
        assert alone[0][0].token_ids == together[row][0].token_ids


def test_sample_masks_after_eos(tiny_sat, random_visuals):
    torch.manual_seed(0)
    out = sample(tiny_sat, random_visuals, n=4, max_len=10)
    assert out.tokens.shape[0] == 12 and out.logprobs.requires_grad
    for row in range(12):
        ids = out.tokens[row].tolist()
        if tiny_sat.eos_id in ids:
            end = ids.index(tiny_sat.eos_id)
            assert out.mask[row, : end + 1].all() and not out.mask[row, end + 1:].any()
            assert all(token == tiny_sat.pad_id for token in ids[end + 1:])  # padded after EOS


def test_sample_masks_are_laid_out_like_its_tokens_up_to_each_rows_first_eos(tiny_sat, random_visuals):
    """``Samples.mask`` is ``[R, T]`` like ``tokens`` and ``logprobs`` (SCST's loss multiplies them): True up to and
    including each row's EOS.  The EOS bias makes rows end at different steps, which the tiny SAT alone too seldom
    does within ``max_len``."""
    with torch.no_grad():
        tiny_sat.out_word.bias[tiny_sat.eos_id] += 3.0
    torch.manual_seed(0)
    drawn = sample(tiny_sat, random_visuals, n=4, max_len=10)
    assert drawn.mask.shape == drawn.tokens.shape == drawn.logprobs.shape
    ended = (drawn.tokens == tiny_sat.eos_id).long()
    assert len({row.index(1) for row in ended.tolist() if 1 in row}) > 1, "rows end at different steps"
    assert torch.equal(drawn.mask, ended.cumsum(1) - ended == 0)


def test_sample_stops_at_the_step_every_row_has_ended(tiny_sat, random_visuals):
    """SCST draws five captions an image each batch: steps past the last row's EOS would change no loss or reward,
    only run the decoder up to ``max_len`` for padding (about twice the steps of a batch of short captions).  The
    EOS bias makes every row end well within ``max_len``."""
    with torch.no_grad():
        tiny_sat.out_word.bias[tiny_sat.eos_id] += 3.0
    torch.manual_seed(0)
    drawn = sample(tiny_sat, random_visuals, n=4, max_len=30)
    last_step = max(row.index(tiny_sat.eos_id) for row in drawn.tokens.tolist())
    assert drawn.tokens.shape[1] == last_step + 1 < 30


def test_sample_draws_one_caption_per_image_unless_told_more(tiny_sat, random_visuals):
    """``sample(model, vis)`` as a library caller writes it: one caption per image, row ``b`` for image ``b``
    (every caller in the project names ``n``, so only this call holds the default)."""
    torch.manual_seed(0)
    drawn = sample(tiny_sat, random_visuals, max_len=5)
    assert drawn.tokens.shape[0] == random_visuals.feats.shape[0] == drawn.mask.shape[0]
    assert bool(drawn.mask[:, 0].all())  # every image's caption has its first word


def test_greedy_score_and_attention_are_those_of_its_own_tokens_only(tiny_sat, random_visuals):
    """Rows of a batch end at different steps; a row's score and its attention rows stop at its EOS while the
    others go on (one attention row per token, as every :class:`Hypothesis` holds, not the batch's longest)."""
    tiny_sat.out_word.bias.data[tiny_sat.eos_id] -= 0.2
    vis = VisualBatch.from_features(random_visuals.feats * torch.tensor([0.1, 1.0, 4.0])[:, None, None])
    hyps = greedy(tiny_sat, vis, max_len=12)
    assert len({len(h.token_ids) for h in hyps}) > 1 and all(h.ended_with_eos for h in hyps), "rows end apart"
    for row, hyp in enumerate(hyps):
        # its words stop at its own EOS: none of the steps the later rows went on for
        assert hyp.token_ids.index(tiny_sat.eos_id) == len(hyp.token_ids) - 1
        logps, attention = _teacher_forced(tiny_sat, vis, hyp, row)
        assert hyp.score == pytest.approx(sum(logps), abs=1e-4)
        torch.testing.assert_close(hyp.attention, attention, atol=1e-5, rtol=1e-5)


def test_pad_and_bos_are_never_emitted(tiny_sat, random_visuals):
    with torch.no_grad():  # make <pad> and <bos> the model's favourite words
        tiny_sat.out_word.bias[tiny_sat.pad_id] = 50.0
        tiny_sat.out_word.bias[tiny_sat.bos_id] = 40.0
    specials = {tiny_sat.pad_id, tiny_sat.bos_id}
    for hyps in beam_search(tiny_sat, random_visuals, k=3, max_len=6):
        assert not specials & set(hyps[0].token_ids)
    for hyp in greedy(tiny_sat, random_visuals, max_len=6):
        assert not specials & set(hyp.token_ids)


def test_sample_draws_from_the_whole_softmax(tiny_sat, random_visuals):
    """SCST's sampler forbids nothing (REINFORCE needs samples from the distribution it differentiates): a model
    whose favourite word is ``<unk>`` draws it, with the log-probability of the full softmax."""
    with torch.no_grad():
        tiny_sat.out_word.bias[Vocabulary.unk_id] = 50.0
    torch.manual_seed(0)
    drawn = sample(tiny_sat, random_visuals, n=2, max_len=6)
    assert bool((drawn.tokens[:, 0] == Vocabulary.unk_id).all())
    torch.testing.assert_close(drawn.logprobs[:, 0], torch.zeros(6), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------------------------------------
# Decoding rules (length penalty, trigram blocking, <unk>) against a naive beam search over Python lists
# --------------------------------------------------------------------------------------------------------------
def _naive_search(next_logprobs, forbidden, eos, k, max_len, alpha, block_trigrams, block_doubled_words=False):
    """Beam search written the slow way over Python lists: ``next_logprobs(tokens)`` scores every word after a
    prefix; candidates are ranked by summed log-prob / ((5 + length) / 6)^alpha (self-critical.pytorch's
    ``length_wu``), a finished hypothesis keeps its length and its score; EOS never comes first, and with
    ``block_trigrams`` no word completes a trigram the prefix already holds, with ``block_doubled_words`` none
    repeats the prefix's last word.  Every final hypothesis, best first, with its ranked score."""
    def rank(score, length):
        return score / ((5.0 + length) ** alpha / 6.0 ** alpha)

    beams = [([], 0.0, False)]
    for _ in range(max_len):
        candidates = []
        for tokens, score, done in beams:
            if done:
                candidates.append((tokens, score, True))
                continue
            banned = {tokens[i + 2] for i in range(len(tokens) - 2)
                      if block_trigrams and tokens[i:i + 2] == tokens[-2:]}
            if not tokens:  # a caption has a word before its EOS
                banned.add(eos)
            elif block_doubled_words:
                banned.add(tokens[-1])
            for word, lp in enumerate(next_logprobs(tokens).tolist()):
                if word not in forbidden and word not in banned:
                    candidates.append((tokens + [word], score + lp, word == eos))
        candidates.sort(key=lambda c: rank(c[1], len(c[0])), reverse=True)
        beams = candidates[:k]
        if all(done for _, _, done in beams):
            break
    return sorted(((tokens, rank(score, len(tokens))) for tokens, score, _ in beams), key=lambda b: b[1],
                  reverse=True)


def _naive_beam(model, vis, row, k, max_len, alpha=0.0, block_trigrams=False, block_doubled_words=False):
    """:func:`_naive_search` over a model: every hypothesis re-runs it over its prefix.  The best caption."""
    single = VisualBatch(vis.feats[row:row + 1], vis.mask[row:row + 1])

    def next_logprobs(tokens):
        enc = model.encode(single)
        state = model.init_state(enc)
        prev = torch.tensor([model.bos_id])
        for token in tokens:
            _, state, _ = model.step(prev, state, enc)
            prev = torch.tensor([token])
        return model.step(prev, state, enc)[0][0].double()

    return _naive_search(next_logprobs, set(never_emitted(model)), model.eos_id, k, max_len, alpha,
                         block_trigrams, block_doubled_words)[0][0]


def _repeats_a_trigram(tokens):
    trigrams = [tuple(tokens[i:i + 3]) for i in range(len(tokens) - 2)]
    return len(trigrams) != len(set(trigrams))


@pytest.fixture
def repetitive_sat(tiny_sat):
    """The tiny SAT pushed towards a few words and away from EOS, so that captions run long and repeat."""
    with torch.no_grad():
        tiny_sat.out_word.bias[4:7] += 4.0
        tiny_sat.out_word.bias[tiny_sat.eos_id] -= 2.0
    return tiny_sat


@pytest.mark.parametrize("alpha,block,doubled", [(0.0, True, False), (1.0, False, False), (2.0, True, False),
                                                 (0.0, False, True), (1.0, True, True)])
def test_rules_equal_a_naive_beam_search(repetitive_sat, random_visuals, alpha, block, doubled):
    rules = DecodingRules(length_penalty=alpha, block_trigrams=block, block_doubled_words=doubled)
    for row, hyps in enumerate(beam_search(repetitive_sat, random_visuals, k=3, max_len=9, rules=rules)):
        assert hyps[0].token_ids == _naive_beam(repetitive_sat, random_visuals, row, 3, 9, alpha, block, doubled)


def test_trigram_blocking_removes_repeats_that_happen_without_it(repetitive_sat, random_visuals):
    plain = beam_search(repetitive_sat, random_visuals, k=3, max_len=15)
    assert any(_repeats_a_trigram(h[0].token_ids) for h in plain)  # the model does repeat
    blocked = beam_search(repetitive_sat, random_visuals, k=3, max_len=15, rules=DecodingRules(block_trigrams=True))
    assert not any(_repeats_a_trigram(h[0].token_ids) for h in blocked)


def _doubles_a_word(tokens):
    return any(a == b for a, b in zip(tokens, tokens[1:]))


def test_doubled_word_blocking_removes_doubled_words_that_happen_without_it(repetitive_sat, random_visuals):
    plain = beam_search(repetitive_sat, random_visuals, k=3, max_len=15)
    assert any(_doubles_a_word(h[0].token_ids) for h in plain)  # the model does double words
    blocked = beam_search(repetitive_sat, random_visuals, k=3, max_len=15,
                          rules=DecodingRules(block_doubled_words=True))
    assert not any(_doubles_a_word(h[0].token_ids) for h in blocked)


def test_a_length_penalty_lengthens_captions_and_zero_changes_nothing(tiny_sat, random_visuals):
    plain = beam_search(tiny_sat, random_visuals, k=3, max_len=12)
    zero = beam_search(tiny_sat, random_visuals, k=3, max_len=12, rules=DecodingRules(length_penalty=0.0))
    assert [h[0].token_ids for h in plain] == [h[0].token_ids for h in zero]
    long = beam_search(tiny_sat, random_visuals, k=3, max_len=12, rules=DecodingRules(length_penalty=3.0))
    assert sum(len(h[0].token_ids) for h in long) > sum(len(h[0].token_ids) for h in plain)


def test_unk_is_never_emitted_the_next_best_word_is(tiny_sat, random_visuals):
    with torch.no_grad():
        tiny_sat.out_word.bias[Vocabulary.unk_id] += 50.0  # <unk> would win every step
    for hyps in beam_search(tiny_sat, random_visuals, k=3, max_len=6):
        assert Vocabulary.unk_id not in hyps[0].token_ids and len(hyps[0].token_ids) > 0
    assert all(Vocabulary.unk_id not in h.token_ids for h in greedy(tiny_sat, random_visuals, 6))


def test_a_caption_is_never_empty_whatever_the_beam(tiny_sat, random_visuals):
    # with EOS the likeliest first token, the one-token "<eos>" kept its single log-prob against real captions'
    # sums and won: Pipeline(...)(cat, beam_size=500) answered "" with a shipped checkpoint
    with torch.no_grad():
        tiny_sat.out_word.bias[tiny_sat.eos_id] += 50.0
    for k in (1, 3, 8):
        for hyps in beam_search(tiny_sat, random_visuals, k=k, max_len=6, rules=DecodingRules(length_penalty=1.0)):
            assert hyps[0].token_ids[-1] == tiny_sat.eos_id and len(hyps[0].token_ids) == 2, hyps[0].token_ids
    assert all(len(h.token_ids) == 2 for h in greedy(tiny_sat, random_visuals, 6))
    assert [h[0].token_ids for h in beam_search(tiny_sat, random_visuals, k=3, max_len=6)] == \
        [_naive_beam(tiny_sat, random_visuals, row, 3, 6) for row in range(random_visuals.feats.shape[0])]


def test_rules_are_validated():
    with pytest.raises(ValueError, match="length_penalty"):
        DecodingRules(length_penalty=-1.0)
    # both ends of [0, 5] are rules (the service's schema takes α = 5 and passes it on), one step past is not
    assert [DecodingRules(length_penalty=alpha).length_penalty for alpha in (0.0, 5.0)] == [0.0, 5.0]
    with pytest.raises(ValueError, match=r"length_penalty must lie in \[0, 5\], got 5.01"):
        DecodingRules(length_penalty=5.01)


def test_the_rules_a_request_names_replace_the_checkpoints_one_by_one():
    """``overridden`` (a request's options, a command line's flags): each rule named replaces the checkpoint's
    default, each left None keeps it, so a checkpoint that blocks doubled words still does for a request that names
    only a length penalty."""
    stored = DecodingRules.of_checkpoint({"decoding": {"length_penalty": 0.5, "block_trigrams": True,
                                                       "block_doubled_words": True}})
    assert stored.overridden() == stored
    assert stored.overridden(length_penalty=0.0) == DecodingRules(0.0, True, True)
    assert stored.overridden(block_trigrams=False, block_doubled_words=False) == DecodingRules(0.5, False, False)
    assert DecodingRules().overridden(block_doubled_words=True) == DecodingRules(block_doubled_words=True)


# --------------------------------------------------------------------------------------------------------------
# The table-level search (search_rows, which the service's batcher shares) against the naive beam search over a
# scripted language model: the next word's log-probs depend on the last two words only, drawn at random and peaked
# so that captions repeat trigrams and end at different lengths, which the tiny SAT above does too seldom to tell
# apart a finished caption's length from a live one's
# --------------------------------------------------------------------------------------------------------------
PAD, BOS, EOS, UNK = Vocabulary.pad_id, Vocabulary.bos_id, Vocabulary.eos_id, Vocabulary.unk_id


def _scripted_step(table):
    """A ``step`` whose log-probs are ``table[word before prev, prev]`` (``[V, V, V]``); its state holds the word
    before ``prev``; it attends to ``prev`` (one-hot over ``V`` items) and reports the word before as an extra."""

    def step(prev, state, enc):
        one_hot = torch.nn.functional.one_hot
        record = AttnRecord(one_hot(prev, table.shape[0]).float(), {"before": one_hot(state["before"], table.shape[0])})
        return table[state["before"], prev], {"before": prev}, record

    return step


def _naive_table_beam(table, k, max_len, alpha, block):
    """:func:`_naive_search` over the scripted model: every hypothesis, best first, with its ranked score."""
    def next_logprobs(tokens):
        before, prev = ([BOS] + tokens)[-2:] if tokens else (BOS, BOS)
        return table[before, prev]

    return _naive_search(next_logprobs, {PAD, BOS, UNK}, EOS, k, max_len, alpha, block)


@pytest.mark.parametrize("alpha,block", [(0.0, False), (0.0, True), (0.8, False), (2.5, True)])
def test_search_rows_equals_a_naive_beam_search_on_scripted_models(alpha, block):
    """Every hypothesis of every group (groups of different widths in one table), in order, with its score: a
    finished caption keeps its length in the penalty while live ones grow, a row's ``finished`` flag follows
    its back-pointer, and the returned score is the length-normalised one."""
    widths, max_len, vocab = [2, 3, 4], 7, 9
    generator = torch.Generator().manual_seed(5)
    for trial in range(12):
        table = (torch.randn(vocab, vocab, vocab, generator=generator) * 2.5).log_softmax(-1)
        table[:, :, EOS] += torch.rand(vocab, vocab, generator=generator) * 3.0 - 1.0  # captions end at various lengths
        table = table.log_softmax(-1)
        rows = sum(widths)
        start = {"before": torch.full((rows,), BOS)}
        found = search_rows(_scripted_step(table), index_rows, {"rows": torch.zeros(rows, 1)}, start, widths, BOS,
                            EOS, (PAD, BOS, UNK), max_len, DecodingRules(alpha, block), n_best=min(widths))
        for width, hyps in zip(widths, found):
            expected = _naive_table_beam(table.double(), width, max_len, alpha, block)[:len(hyps)]
            assert [h.token_ids for h in hyps] == [tokens for tokens, _ in expected], (trial, width)
            assert [h.score for h in hyps] == pytest.approx([score for _, score in expected], abs=1e-4)
            for hyp in hyps:  # the attention and the extras of token t are those of its own prefix
                prefix = [BOS, BOS] + hyp.token_ids
                assert hyp.attention.argmax(-1).tolist() == prefix[1:-1]
                assert hyp.extras["before"].argmax(-1).tolist() == prefix[:-2]


def test_search_rows_keeps_each_group_to_its_own_rows_when_several_groups_share_a_width():
    """Groups of equal width are ranked together in one top-k (``BeamLayout.by_width``), and with several widths in
    the table each group's back-pointers are offset by its own first row: a group pointing into another group of its
    width would continue that image's captions.  Each group here is scored by its own table (read through ``enc``,
    which the search never reorders), so a group's captions are the naive search's over its table alone."""
    widths, max_len, vocab = [2, 3, 2, 3], 6, 9
    generator = torch.Generator().manual_seed(11)
    tables = (torch.randn(len(widths), vocab, vocab, vocab, generator=generator) * 2.5).log_softmax(-1)
    tables[..., EOS] += torch.rand(len(widths), vocab, vocab, generator=generator) * 3.0 - 1.0
    tables = tables.log_softmax(-1)

    def step(prev, state, enc):
        record = AttnRecord(torch.nn.functional.one_hot(prev, vocab).float(), {})
        return tables[enc["group"], state["before"], prev], {"before": prev}, record

    group = torch.repeat_interleave(torch.arange(len(widths)), torch.tensor(widths))
    start = {"before": torch.full((sum(widths),), BOS)}
    found = search_rows(step, index_rows, {"group": group}, start, widths, BOS, EOS, (PAD, BOS, UNK), max_len,
                        NO_RULES, n_best=2)
    for g, (width, hyps) in enumerate(zip(widths, found)):
        expected = _naive_table_beam(tables[g].double(), width, max_len, 0.0, False)[:2]
        assert [h.token_ids for h in hyps] == [tokens for tokens, _ in expected], g


def test_tune_decodings_choice_prefers_the_simpler_rules_on_a_tie_and_reads_rows_older_than_a_rule():
    """``best_row`` breaks a tie towards no penalty, then no trigram blocking, then no doubled-word blocking; a row
    written before doubled-word blocking existed (no such field) is read with it off."""
    def row(alpha, trigrams, doubled, cider):
        return {"length_penalty": alpha, "block_trigrams": trigrams, "block_doubled_words": doubled, "CIDEr-D": cider}

    tied = [row(0.5, False, False, 0.5), row(0.0, True, True, 0.5), row(0.0, True, False, 0.5),
            row(0.0, False, True, 0.5), row(1.0, True, True, 0.4)]
    assert rules_of(best_row(tied, "CIDEr-D")) == DecodingRules(block_doubled_words=True)
    assert rules_of(best_row(tied + [row(0.0, False, False, 0.5)], "CIDEr-D")) == DecodingRules()
    assert rules_of(best_row([row(1.0, True, True, 0.6), *tied], "CIDEr-D")) == DecodingRules(1.0, True, True)
    assert rules_of({"length_penalty": 0.5, "block_trigrams": True, "CIDEr-D": 0.1}) == DecodingRules(0.5, True)


def test_tune_decodings_tie_between_a_penalty_and_a_blocking_rule_goes_to_the_smaller_penalty():
    """``best_row``'s order of preference is the penalty first, blocking second (its docstring): a tie between a
    penalty with no blocking and no penalty with trigram blocking stores no penalty, whichever row comes first."""
    def row(alpha, trigrams, cider):
        return {"length_penalty": alpha, "block_trigrams": trigrams, "block_doubled_words": False, "CIDEr-D": cider}

    tied = [row(0.5, False, 0.7), row(0.0, True, 0.7)]
    assert rules_of(best_row(tied, "CIDEr-D")) == DecodingRules(0.0, True)
    assert rules_of(best_row(tied[::-1], "CIDEr-D")) == DecodingRules(0.0, True)


def test_a_row_historys_per_row_tensors_are_all_selected_and_joined():
    """``RowHistory.select`` and ``cat`` go through ``ROW_FIELDS``: a per-row field left out of it would keep the
    rows of the table before the step (or before a request joined), and the next rule would read another row's."""
    assert ROW_FIELDS == tuple(f.name for f in dataclasses.fields(RowHistory) if f.type == "Tensor")
    first = RowHistory.start([2], [DecodingRules(0.5, True, False)], 4, "cpu")
    second = RowHistory.start([1], [DecodingRules(1.0, False, True)], 6, "cpu")
    joined = first.cat(second).select(torch.tensor([2, 0]))
    assert joined.tokens.shape == (2, 7) and joined.blocking and joined.penalised
    assert joined.alpha.tolist() == [1.0, 0.5] and joined.trigrams.tolist() == [False, True]
    assert joined.doubles.tolist() == [True, False]


def test_a_table_without_rules_joined_by_rows_with_rules_applies_them():
    """``RowHistory.cat``'s ``penalised`` and ``blocking`` flags tell ``beam_step`` whether to apply any row's rules
    at all: a server's table whose rows have none, joined by a request with a length penalty or a blocking rule,
    must take the joining rows' flags, or their rules would be skipped for as long as they share that table."""
    plain = RowHistory.start([2], [NO_RULES], 4, "cpu")
    assert not plain.penalised and not plain.blocking
    for rules in (DecodingRules(length_penalty=0.5), DecodingRules(block_trigrams=True),
                  DecodingRules(block_doubled_words=True)):
        joined = plain.cat(RowHistory.start([1], [rules], 4, "cpu"))
        assert (joined.penalised, joined.blocking) == (bool(rules.length_penalty), rules.blocks), rules


def test_a_group_is_done_only_when_every_one_of_its_rows_has_ended():
    """``groups_done`` (the service's step boundary) counts a group's ended rows against its width: a group with a
    row still live goes on, and groups of different widths in one table are counted apart."""
    layout = BeamLayout([2, 3, 1])
    finished = torch.tensor([True, True, True, False, True, False])
    assert layout.groups_done(finished).tolist() == [True, False, False]
    assert layout.groups_done(torch.ones(6, dtype=torch.bool)).tolist() == [True, True, True]
    assert layout.groups_done(torch.zeros(6, dtype=torch.bool)).tolist() == [False, False, False]


def test_tune_decodings_grid_crosses_every_rules_values_and_its_table_shows_each(monkeypatch):
    """``decoding_grid`` scores every combination of the values it is given, doubled-word blocking included (each
    row records the rules it was decoded with), and ``markdown_table`` has a column for each rule."""
    decoded = []

    def scores(ckpt, images, store, beam_size, max_len, metrics, *, rules, **options):
        decoded.append(rules)
        return {"CIDEr-D": 0.25 * len(decoded)}, {}

    monkeypatch.setattr(tuning, "evaluate_checkpoint", scores)
    rows = tuning.decoding_grid(None, [], None, (0.0, 1.0), (True,), doubled_options=(False, True))
    assert decoded == [DecodingRules(0.0, True, False), DecodingRules(0.0, True, True), DecodingRules(1.0, True, False),
                       DecodingRules(1.0, True, True)]
    assert [tuning.rules_of(row) for row in rows] == decoded
    table = tuning.markdown_table(rows, ["CIDEr-D"]).splitlines()
    assert table[0] == "| length penalty α | block trigrams | block doubled words | CIDEr-D |"
    assert table[2:] == ["| 0 | yes | no | 0.25 |", "| 0 | yes | yes | 0.5 |", "| 1 | yes | no | 0.75 |",
                         "| 1 | yes | yes | 1 |"]


def test_tune_decodings_default_grid_leaves_doubled_word_blocking_off(monkeypatch):
    """Without options the grid is every default penalty × trigram blocking off and on, doubled-word blocking off
    (docs/decisions.md, "Flickr8k: doubled words"), each decoded with a beam of 3 and at most 20 tokens and scored
    on BLEU, ROUGE-L and CIDEr-D."""
    searched = []

    def scores(ckpt, images, store, beam_size, max_len, metrics, *, rules, **options):
        searched.append((beam_size, max_len, tuple(metrics), rules))
        return {"CIDEr-D": 1.0}, {}

    monkeypatch.setattr(tuning, "evaluate_checkpoint", scores)
    tuning.decoding_grid(None, [], None)
    assert searched == [(3, 20, ("BLEU", "ROUGE-L", "CIDEr-D"), DecodingRules(penalty, block, False))
                        for penalty in (0.0, 0.5, 1.0) for block in (False, True)]


def test_tune_decodings_grid_decodes_every_combination_as_asked_and_rounds_its_scores_as_reports_do(monkeypatch):
    """``captioner tune-decoding --beam-size/--max-len/--device`` (and the training captions its novelty column
    needs) reach every combination's evaluation, not only the first or the defaults; its scores are rounded as a
    report's."""
    searched, training = [], [["a", "dog"], ["two", "cats"]]

    def scores(ckpt, images, store, beam_size, max_len, metrics, *, rules, **options):
        searched.append((beam_size, max_len, tuple(metrics), options["device"], options["training_captions"]))
        return {"CIDEr-D": 1.234567, "REP": 0.00012}, {}

    monkeypatch.setattr(tuning, "evaluate_checkpoint", scores)
    rows = tuning.decoding_grid(None, [], None, (0.0, 1.0), (False,), beam_size=5, max_len=9, metrics=("CIDEr-D",),
                                device="cuda:1", training_captions=training)
    assert searched == [(5, 9, ("CIDEr-D",), "cuda:1", training)] * 2
    # each row's scores as every report writes them, to four decimals (the grid's table and the stored choice)
    assert [(row["CIDEr-D"], row["REP"]) for row in rows] == [(1.2346, 0.0001)] * 2


def test_n_best_is_checked_with_the_other_options_before_anything_is_encoded():
    check_search([3, 2], 5, NO_RULES, n_best=2)
    for n_best in (0, 3):
        with pytest.raises(ValueError, match=rf"need 1 <= n_best <= every beam width, got widths=\[3, 2\], "
                                             rf"n_best={n_best}"):
            check_search([3, 2], 5, NO_RULES, n_best=n_best)


@pytest.mark.parametrize("options,message", [
    (dict(k=0), "beam_size must be a whole number of at least 1, got 0"),
    (dict(k=-1), "beam_size must be a whole number of at least 1, got -1"),
    (dict(k=3, n_best=4), r"need 1 <= n_best <= every beam width, got widths=\[3\], n_best=4"),
    (dict(n_best=0), r"need 1 <= n_best <= every beam width, got widths=\[3\], n_best=0"),
    (dict(max_len=0), "max_len must be a whole number of at least 1, got 0"),
    # a switch is no number of beams, nor a fraction a number of steps
    (dict(k=True), "beam_size must be a whole number of at least 1, got True"),
    (dict(max_len=2.5), "max_len must be a whole number of at least 1, got 2.5"),
    (dict(rules={"block_trigrams": True}), "rules must be DecodingRules"),
])
def test_beam_search_itself_refuses_options_it_cannot_run_by_their_names(tiny_sat, random_visuals, options,
                                                                        message):
    """A library user who calls ``beam_search`` directly is told which option is wrong, as the pipeline's users
    are: unchecked, ``n_best`` above the beam gave fewer hypotheses and ``n_best=0`` none, in silence, a beam of
    -1 was PyTorch's "repeats can not be negative" and ``max_len=0`` a ``KeyError``."""
    with pytest.raises((ValueError, TypeError), match=message):
        beam_search(tiny_sat, random_visuals, **options)


def test_a_one_token_limit_is_a_search_and_a_limit_of_zero_is_refused(tiny_sat, random_visuals):
    """``max_len=1`` is the least a search may be asked (``beam_search`` and a library user's runtime check it
    here): one word, cut there, since EOS cannot come first; 0 is refused by the option's name."""
    check_search([3], 1, NO_RULES)
    for hyps in beam_search(tiny_sat, random_visuals, k=3, max_len=1):
        assert len(hyps[0].token_ids) == 1 and not hyps[0].ended_with_eos
    with pytest.raises(ValueError, match="max_len must be a whole number of at least 1, got 0"):
        check_search([3], 0, NO_RULES)


def test_a_caption_cut_at_the_length_limit_is_not_flagged_as_ended(tiny_sat, random_visuals):
    """A caption that ran to ``max_len`` without EOS holds no end token and says so (``ended_with_eos`` False, no
    ``is_eos`` flag), in every one of the ``n_best`` beams, as greedy's do; one that emitted EOS says it did."""
    with torch.no_grad():
        tiny_sat.out_word.bias[tiny_sat.eos_id] -= 50.0  # EOS never wins: every caption runs to the limit
    for hyps in beam_search(tiny_sat, random_visuals, k=3, max_len=5, n_best=3):
        for hyp in hyps:
            assert len(hyp.token_ids) == 5 and tiny_sat.eos_id not in hyp.token_ids
            assert not hyp.ended_with_eos and hyp.is_eos == [False] * 5
    # greedy stops at the limit too: five words, not a sixth after them
    assert all(len(h.token_ids) == 5 and not h.ended_with_eos for h in greedy(tiny_sat, random_visuals, 5))
    with torch.no_grad():
        tiny_sat.out_word.bias[tiny_sat.eos_id] += 100.0  # EOS wins as soon as it may (after the first word)
    for hyps in beam_search(tiny_sat, random_visuals, k=3, max_len=5, n_best=3):
        for hyp in hyps:
            assert hyp.ended_with_eos and hyp.token_ids[-1] == tiny_sat.eos_id and hyp.is_eos[-1]


@pytest.mark.parametrize("n_best", [1, 2, 4])
def test_n_best_returns_that_many_hypotheses_the_best_of_the_beam(tiny_sat, random_visuals, n_best):
    """``n_best`` hypotheses per image, no more: the first ``n_best`` of the whole beam's, best first."""
    every = beam_search(tiny_sat, random_visuals, k=4, max_len=8, n_best=4)
    for hyps, all_of_them in zip(beam_search(tiny_sat, random_visuals, k=4, max_len=8, n_best=n_best), every):
        assert len(hyps) == n_best
        assert [h.token_ids for h in hyps] == [h.token_ids for h in all_of_them[:n_best]]
        assert [h.score for h in all_of_them] == sorted((h.score for h in all_of_them), reverse=True)


def _stuttering_table(vocab=9):
    """A scripted model that wants the same words whatever came before: word 4 far above 5, 5 above 6 and so on
    down to EOS, so that a plain search stutters ("4 4 4 …") and each blocking rule has something to block."""
    preference = torch.tensor([0.0, 0.0, 1.0, 0.0, 40.0, 30.0, 20.0, 10.0, 5.0])[:vocab]
    return preference.log_softmax(-1).expand(vocab, vocab, vocab).contiguous()


@pytest.mark.parametrize("trigrams,doubled,expected", [
    (False, False, [4, 4, 4, 4, 4, 4, 4]),
    # the last complete trigram counts too: "4 4 4" blocks a fourth 4 at once; doubled words stay allowed
    (True, False, [4, 4, 4, 5, 4, 4, 6]),
    # no word after itself, and nothing else: "4 5 4 5 …" repeats its trigrams freely
    (False, True, [4, 5, 4, 5, 4, 5, 4]),
    (True, True, [4, 5, 4, 5, 6, 4, 5]),
])
def test_each_blocking_rule_blocks_what_it_names_and_nothing_else(trigrams, doubled, expected):
    """A row decoded with one blocking rule is held to that rule only (the batcher's rows each carry their own), and
    trigram blocking covers the caption's last trigram, not only the earlier ones."""
    # one row per caption: a wider beam finds captions of the same words in another order, tied in score
    table, widths = _stuttering_table(), [1, 1]
    start = {"before": torch.full((sum(widths),), BOS)}
    found = search_rows(_scripted_step(table), index_rows, {"rows": torch.zeros(sum(widths), 1)}, start, widths, BOS,
                        EOS, (PAD, BOS, UNK), 7, DecodingRules(block_trigrams=trigrams, block_doubled_words=doubled))
    assert [hyps[0].token_ids for hyps in found] == [expected, expected]
    naive = _naive_search(lambda tokens: table[0, 0].double(), {PAD, BOS, UNK}, EOS, 1, 7, 0.0, trigrams, doubled)
    assert naive[0][0] == expected


@pytest.mark.parametrize("decoding", [None, {"length_penalty": True}, {"block_trigrams": 1},
                                      {"block_doubled_words": 0.0}, {"length_penalty": 9}])
def test_a_checkpoints_decoding_of_the_wrong_kind_is_refused_naming_its_file(decoding):
    """``of_checkpoint`` takes only an object of the rules' names with each of its default's kind: a switch written
    as a number, a number written as a switch, or ``null`` in place of the object is a hand edit to report (by the
    file it was read from), not rules to decode with in silence; a value out of its range is named the same way."""
    with pytest.raises(ValueError, match=r"^meta\.json: "):
        DecodingRules.of_checkpoint({"decoding": decoding}, "meta.json")
    assert DecodingRules.of_checkpoint({}) == NO_RULES  # a checkpoint without rules has none


def test_a_row_history_gives_each_group_of_a_table_its_own_rules():
    """``RowHistory.start`` over several groups (the batcher starts the rows of every request admitted at one step
    together): each group's rows carry that group's rules, in the groups' order, not another request's."""
    history = RowHistory.start([2, 1], [DecodingRules(0.5, True, False), DecodingRules(1.0, False, True)], 4, "cpu")
    assert history.alpha.tolist() == [0.5, 0.5, 1.0]
    assert history.trigrams.tolist() == [True, True, False] and history.doubles.tolist() == [False, False, True]
    assert history.tokens.shape == (3, 5) and history.penalised and history.blocking


def test_a_row_history_joined_by_a_shorter_one_keeps_every_word_of_its_own():
    """``RowHistory.cat`` pads the narrower histories to the wider one's columns, whichever comes first: a table of
    long captions (``max_len`` 8) joined by a request with a shorter limit keeps its rows' words, which the
    blocking rules read at every later step."""
    long = RowHistory.start([1], [DecodingRules(block_trigrams=True)], 8, "cpu")
    long.tokens[0] = torch.arange(4, 13)
    joined = long.cat(RowHistory.start([2], [NO_RULES], 3, "cpu"))
    assert joined.tokens.shape == (3, 9)
    assert joined.tokens[0].tolist() == list(range(4, 13)) and not joined.tokens[1:].any()


@pytest.mark.parametrize("sizes", [[], [2, 0], [0]])
def test_a_layout_refuses_a_beam_group_without_rows(sizes):
    """A group of no rows has no first row to start from: refused by name, not a top-k of none over a ``view`` of
    zero columns further on."""
    with pytest.raises(ValueError, match=r"every beam group needs at least one row, got \["):
        BeamLayout(sizes)
    assert BeamLayout([1]).rows == 1


def test_a_groups_hypotheses_come_best_first_whatever_the_order_of_its_rows():
    """``collect_hypotheses`` (which the batcher's row table calls too) promises a group's ``n_best`` best, best
    first, from rows in any order: the search's top-k happens to hand its rows over sorted, so no search test tells
    a missing sort, or ``n_best`` cut before it, from the right one.  Each caption ends at its first EOS, keeps the
    attention rows of its own tokens and is scored over its own length."""
    history = {"tokens": torch.tensor([[4, 5, EOS, EOS], [4, 6, 7, 8], [5, EOS, EOS, EOS]]),
               "logprobs": torch.tensor([[-1.0, -1.0, -1.0, 0.0], [-0.5, -0.5, -0.5, -0.5], [-0.2, -0.3, 0.0, 0.0]]),
               "attention": torch.arange(12.0).view(3, 4, 1)}
    hyps = collect_hypotheses(history, torch.tensor([-3.0, -2.0, -0.5]), EOS, 2, None)
    assert [h.token_ids for h in hyps] == [[5, EOS], [4, 6, 7, 8]] and [h.score for h in hyps] == [-0.5, -2.0]
    assert [h.ended_with_eos for h in hyps] == [True, False]
    assert [h.attention.flatten().tolist() for h in hyps] == [[8.0, 9.0], [4.0, 5.0, 6.0, 7.0]]
    assert hyps[0].token_logprobs == pytest.approx([-0.2, -0.3]) and hyps[1].token_logprobs == [-0.5] * 4
    # with a length penalty, each over ((5 + its length) / 6)^α: 2 words for the best, 4 for the next
    penalised = collect_hypotheses(history, torch.tensor([-3.0, -2.0, -0.5]), EOS, 3, 1.0)
    assert [h.score for h in penalised] == pytest.approx([-0.5 / (7 / 6), -2.0 / (9 / 6), -3.0 / (8 / 6)])


class _OnAnotherDevice(torch.Tensor):
    """A tensor standing in for one on a GPU, where CI has none: ``.cpu()`` brings it to the host as a plain
    tensor, and anything cut from it without that stays one of these."""

    def cpu(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor).clone()


def test_a_groups_hypotheses_are_brought_to_the_host_from_the_device_the_search_ran_on():
    """``collect_hypotheses`` moves a group's backtracked history to the host once: on a GPU a hypothesis whose
    attention or extra maps stayed on the device made ``captioner eval --grounding`` fail at its ``.numpy()``.  On
    the CPU the copy changes nothing, so the test stands a tensor type in for the device's."""
    on_the_host = {"tokens": torch.tensor([[4, 5, EOS], [6, EOS, EOS]]), "logprobs": torch.full((2, 3), -0.5),
                   "attention": torch.rand(2, 3, 4), "extra:gate": torch.rand(2, 3, 1)}
    history = {name: value.as_subclass(_OnAnotherDevice) for name, value in on_the_host.items()}
    scores = torch.tensor([-1.5, -1.0]).as_subclass(_OnAnotherDevice)
    hyps = collect_hypotheses(history, scores, EOS, 2, None)
    assert [h.token_ids for h in hyps] == [[6, EOS], [4, 5, EOS]]
    assert [type(h.attention) for h in hyps] == [torch.Tensor] * 2
    assert [type(h.extras["gate"]) for h in hyps] == [torch.Tensor] * 2


def test_tune_decodings_table_is_a_markdown_table_of_four_digit_scores_and_one_progress_bar(monkeypatch):
    """The grid's table renders as Markdown only with one ``---|`` cell per heading; its scores keep four
    significant digits; and the grid draws one progress bar (its own), not a bar per combination's evaluation."""
    progress = []

    def scores(ckpt, images, store, beam_size, max_len, metrics, *, rules, **options):
        progress.append(options["progress"])
        return {"CIDEr-D": 1.2346}, {}

    monkeypatch.setattr(tuning, "evaluate_checkpoint", scores)
    rows = tuning.decoding_grid(None, [], None, (0.5,), (False,))
    assert progress == [False]
    table = tuning.markdown_table(rows, ["CIDEr-D", "distinct_words"]).splitlines()
    assert table[1] == "|---|---|---|---|---|"
    assert table[2] == "| 0.5 | no | no | 1.235 |  |"  # a column a row lacks is left empty


def _search_with_each_groups_rules(step, widths, rules, max_len):
    """:func:`search_rows`'s loop over a table whose groups each keep their own rules (a row history started over
    ``rules[g]`` per group, as the service's row table starts it): every group's hypotheses, best first."""
    layout = BeamLayout(widths)
    prev, scores, finished = layout.initial_rows(BOS)
    history = RowHistory.start(widths, rules, max_len, "cpu")
    state, records = {"before": torch.full((sum(widths),), BOS)}, []
    for _ in range(max_len):
        logprobs, state, attn = step(prev, state, None)
        beam = beam_step(logprobs, scores, finished, layout, prev, BOS, EOS, (PAD, BOS, UNK), history)
        history = history.after(beam, finished)
        records.append(record_step(beam, attn))
        state = index_rows(state, beam.pointer)
        scores, finished, prev = beam.scores, beam.finished, beam.tokens
    rows = backtrack(records, torch.arange(layout.rows))
    return [collect_hypotheses({name: value[first:first + width] for name, value in rows.items()},
                               scores[first:first + width], EOS, width, group_rules.length_penalty)
            for first, width, group_rules in zip(layout.offsets, widths, rules)]


def test_groups_with_different_rules_in_one_table_each_get_their_own_caption():
    """A server's table holds requests with different rules side by side: each group's captions must be those of a
    search with its rules alone, whatever its neighbour asks and whichever of the two comes first, so a rule set by
    one request (or left out) never reaches the other."""
    widths, max_len, vocab = [3, 3], 7, 9
    generator = torch.Generator().manual_seed(7)
    table = (torch.randn(vocab, vocab, vocab, generator=generator) * 2.5).log_softmax(-1)
    table[:, :, EOS] += torch.rand(vocab, vocab, generator=generator) * 3.0 - 1.0  # captions end at various lengths
    table = table.log_softmax(-1)
    ruled = DecodingRules(2.5, True)
    for rules in ([ruled, NO_RULES], [NO_RULES, ruled]):
        found = _search_with_each_groups_rules(_scripted_step(table), widths, rules, max_len)
        for group, (width, hyps) in enumerate(zip(widths, found)):
            expected = _naive_table_beam(table.double(), width, max_len, rules[group].length_penalty,
                                         rules[group].block_trigrams)
            assert [h.token_ids for h in hyps] == [tokens for tokens, _ in expected], (rules, group)
            assert [h.score for h in hyps] == pytest.approx([score for _, score in expected], abs=1e-4)
    # the random table seldom repeats a trigram: the stuttering one always does, unless its row blocks them
    blocking, stutter = [4, 4, 4, 5, 4, 4, 6], [4] * 7
    for rules, expected in (([DecodingRules(block_trigrams=True), NO_RULES], [blocking, stutter]),
                            ([NO_RULES, DecodingRules(block_trigrams=True)], [stutter, blocking])):
        found = _search_with_each_groups_rules(_scripted_step(_stuttering_table()), [1, 1], rules, 7)
        assert [hyps[0].token_ids for hyps in found] == expected, rules


def test_a_checkpoints_decoding_naming_an_unknown_rule_is_refused_naming_its_file():
    """A rule name the decoder does not know (a typo, or a rule of a newer version) is the same hand edit to report
    by its file as a rule of the wrong kind, not a KeyError from the kind check."""
    with pytest.raises(ValueError, match=r"^meta\.json: .*block_trigram"):
        DecodingRules.of_checkpoint({"decoding": {"block_trigram": True}}, "meta.json")


def test_options_that_carry_only_some_rules_override_those_and_keep_the_others():
    """``overridden_by`` reads the rules' names off any object (a request's parameters, a command line's arguments,
    an archive's options): one that carries only some of them keeps the others, rather than failing on the first
    it lacks."""
    stored = DecodingRules(0.5, True, True)
    assert stored.overridden_by(dataclasses.make_dataclass("Options", ["block_trigrams"])(False)) == \
        DecodingRules(0.5, False, True)
    assert stored.overridden_by(object()) == stored


def test_the_search_leaves_the_models_log_probs_as_it_returned_them():
    """``step`` may hand back a view it keeps (a cached row, here one row broadcast to every row of the table): the
    search forbids words on its own copy, so the model's tensor is neither written into nor refused as a broadcast
    one that cannot be written in place."""
    preference = _stuttering_table()[0, 0]
    kept = preference.clone()

    def step(prev, state, enc):
        return preference.expand(len(prev), -1), state, AttnRecord(torch.ones(len(prev), 1), {})

    widths = [2, 1]
    found = search_rows(step, index_rows, {"rows": torch.zeros(3, 1)}, {"rows": torch.zeros(3, 1)}, widths, BOS, EOS,
                        (PAD, BOS, UNK), 4, NO_RULES)
    assert [hyps[0].token_ids for hyps in found] == [[4, 4, 4, 4], [4, 4, 4, 4]]
    assert torch.equal(preference, kept)
