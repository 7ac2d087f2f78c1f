"""Decoding invariants (docs/decisions.md#model-protocol-and-alignment-rule) on a tiny random SAT."""

import torch

from captioner.models.decoding import beam_search, greedy, sample
from captioner.models.protocol import VisualBatch

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


def test_pad_and_bos_are_never_emitted(tiny_sat, random_visuals):
    with torch.no_grad():  # make <pad> and <bos> the model's favourite words
        tiny_sat.out_word.bias[tiny_sat.pad_id] = 50.0
        tiny_sat.out_word.bias[tiny_sat.bos_id] = 40.0
    specials = {tiny_sat.pad_id, tiny_sat.bos_id}
    for hyps in beam_search(tiny_sat, random_visuals, k=3, max_len=6):
        assert not specials & set(hyps[0].token_ids)
    for hyp in greedy(tiny_sat, random_visuals, max_len=6):
        assert not specials & set(hyp.token_ids)
    drawn = sample(tiny_sat, random_visuals, n=2, max_len=6)
    assert not bool(((drawn.tokens == tiny_sat.bos_id) | ((drawn.tokens == tiny_sat.pad_id) & drawn.mask)).any())
