"""SAT hard attention (Xu et al. 2015, arXiv:1502.03044, §4.1): sampling, arg-max decoding, the REINFORCE estimator
and memorisation."""

import itertools

import pytest
import torch

from captioner.models.decoding import beam_search, expand_rows
from captioner.models.protocol import VisualBatch
from captioner.models.training.recipes import load_recipe
from captioner.models.training.xe import xe_loss
from captioner.models.zoo import create, options

from .model_checks import VOCAB, memorisation_cider, memorisation_task, stepwise, train_to_memorise

# tiny tensors gain nothing from a second thread, and on a busy machine waiting for it dominates
pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(vocab_size=11, feat_dim=6, embed_dim=8, hidden_dim=10, attn_dim=7, dropout=0.0)


def _model(**overrides):
    torch.manual_seed(0)
    return create("sat-hard", **{**TINY, **overrides})


def _force(model, choose):
    """Replace the Multinoulli draw by ``choose(alpha, t)`` (t counts calls), to enumerate or repeat paths."""
    counter = itertools.count()
    model.draw_location = lambda alpha: choose(alpha, next(counter))


def test_training_samples_locations_with_probability_alpha():
    model = _model().train()
    vis = VisualBatch.from_features(torch.randn(1, 5, 6))
    enc = expand_rows(model.encode(vis), [20000])
    state = model.init_state(enc)
    alpha = model.attention(state, enc)
    enc["expected"] = torch.rand(20000) < 0.5
    z, extras = model.context(alpha, state, enc)
    hard, soft = ~enc["expected"], enc["expected"]
    chosen = extras["location"][hard]
    assert torch.all(chosen.sum(-1) == 1) and torch.all((chosen == 0) | (chosen == 1))
    freq, p = chosen.mean(0), alpha[0]
    assert torch.all((freq - p).abs() < 5 * (p * (1 - p) / hard.sum()).sqrt() + 1e-3), (freq, p)
    # ẑ_t = a_{s̃_t} for sampled rows (Eq. 9), the expectation Σ α a for the others (§4.1)
    torch.testing.assert_close(z[hard], chosen @ vis.feats[0])
    torch.testing.assert_close(z[soft], (alpha[soft] @ vis.feats[0]))
    torch.testing.assert_close(extras["location"][soft], alpha[soft])
    # the 0.5 expectation trick is drawn per caption, also for captions that share their image's encoding
    flags = model.encode_rows(VisualBatch.from_features(torch.randn(4, 5, 6)),
                              torch.arange(4).repeat_interleave(1000))["expected"]
    assert abs(flags.float().mean().item() - 0.5) < 0.04


def test_evaluation_uses_the_expected_context_by_default_as_the_authors_generator_does():
    """arctic-captions' generate_caps.py builds its sampler with sampling=False (argmax=False): the context is
    Σ_i α_i a_i, the soft model's, and α is both the heatmap and the exported location."""
    model = _model().eval()
    vis = VisualBatch.from_features(torch.randn(3, 5, 6))
    enc = model.encode(vis)
    state = model.init_state(enc)
    _, _, attn = model.step(torch.full((3,), model.bos_id), state, enc)
    alpha = model.attention(state, enc)
    torch.testing.assert_close(attn.extras["location"], alpha)
    z, _ = model.context(alpha, state, enc)
    torch.testing.assert_close(z, (alpha.unsqueeze(-1) * vis.feats).sum(1))
    with pytest.raises(ValueError, match="decode_location"):
        _model(decode_location="mode")


@pytest.mark.parametrize("option", [dict(location_samples=0), dict(expectation_prob=-0.1),
                                    dict(expectation_prob=1.1), dict(baseline_decay=-0.1), dict(baseline_decay=1.0)])
def test_options_outside_their_ranges_are_refused(option):
    """§4.1's moving average ``b_k = d b_{k-1} + (1 - d) r_k`` needs ``d < 1``: at ``d = 1`` the baseline would stay
    the first mini-batch's mean for the whole run, so it is refused with the range the message states."""
    with pytest.raises(ValueError, match="0 <= baseline_decay < 1"):
        _model(**option)


@pytest.mark.parametrize("option", [dict(expectation_prob=0.0), dict(expectation_prob=1.0), dict(baseline_decay=0.0)])
def test_options_at_the_ends_of_their_ranges_are_taken(option):
    assert _model(**option).config()[next(iter(option))] == next(iter(option.values()))


def test_evaluation_can_use_the_argmax_location_and_exports_alpha():
    model = _model(decode_location="argmax").eval()
    vis = VisualBatch.from_features(torch.randn(3, 5, 6))
    enc = model.encode(vis)
    assert "expected" not in enc
    state = model.init_state(enc)
    logprobs, _, attn = model.step(torch.full((3,), model.bos_id), state, enc)
    alpha = model.attention(state, enc)
    torch.testing.assert_close(attn.primary, alpha)
    best = alpha.argmax(-1)
    torch.testing.assert_close(attn.extras["location"], torch.nn.functional.one_hot(best, 5).float())
    z, _ = model.context(alpha, state, enc)
    torch.testing.assert_close(z, vis.feats[torch.arange(3), best])
    for hyps in beam_search(model, vis, k=2, max_len=6):
        h = hyps[0]  # every emitted token: α is the heatmap, its arg-max cell is the chosen location
        assert torch.equal(h.extras["location"].argmax(-1), h.attention.argmax(-1))
        torch.testing.assert_close(h.attention.sum(-1), torch.ones(len(h.token_ids)))


def test_evaluation_forward_xe_is_the_step_loop_with_no_terms_and_leaves_the_baseline():
    """Outside training (a validation loss) nothing is sampled: the log-probs are the decode-location step loop's,
    there is no REINFORCE or entropy term, and the training baseline b_k does not move."""
    model = _model().eval()
    vis = VisualBatch.from_features(torch.randn(2, 5, 6))
    captions = torch.tensor([[5, 6, 2], [8, 2, 0]])
    model.baseline.fill_(-1.3)
    logprobs, aux = model.forward_xe(vis, captions)
    torch.testing.assert_close(logprobs, stepwise(model, vis, captions)[0])
    assert aux == {}
    assert model.baseline.item() == pytest.approx(-1.3) and int(model.baseline_batches) == 0


def test_reinforce_gradient_is_unbiased_for_the_lower_bound():
    """Eq. 10–11: averaged over all location paths, the surrogate's gradient is -∇L_s / #tokens, whatever b."""
    model = _model(entropy_weight=0.0, expectation_prob=0.0).double().train()
    vis = VisualBatch.from_features(torch.randn(1, 3, 6, dtype=torch.float64))
    captions = torch.tensor([[5, 2]])
    params = [p for p in model.parameters()]
    expected_grad = [torch.zeros_like(p) for p in params]
    lower_bound = torch.zeros((), dtype=torch.float64)
    for path in itertools.product(range(3), repeat=2):
        _force(model, lambda alpha, t, path=path: torch.full((alpha.shape[0],), path[t]))
        model.baseline.fill_(-1.7)  # an arbitrary fixed baseline leaves the expectation unchanged
        model.baseline_batches.fill_(1)
        logprobs, aux = model.forward_xe(vis, captions)
        surrogate = xe_loss(logprobs, captions, model.pad_id) + sum(aux.values())
        grads = torch.autograd.grad(surrogate, params, allow_unused=True)
        # the same path again, for log p(s|a) and log p(y|s,a) as differentiable functions
        _force(model, lambda alpha, t, path=path: torch.full((alpha.shape[0],), path[t]))
        logprobs, records, _ = model.teacher_force(vis, captions)
        logp_s = sum(torch.log(r.primary[0, s]) for r, s in zip(records, path))
        logp_y = logprobs[0, [0, 1], captions[0]].sum()
        weight = logp_s.detach().exp()
        for acc, g in zip(expected_grad, grads):
            if g is not None:
                acc += weight * g
        lower_bound = lower_bound + logp_s.exp() * logp_y  # L_s = Σ_s p(s|a) log p(y|s,a)
    exact = torch.autograd.grad(lower_bound, params, allow_unused=True)
    n_tokens = 2
    checked = 0
    for name_param, acc, g in zip(model.named_parameters(), expected_grad, exact):
        if g is None:
            assert torch.all(acc == 0), name_param[0]
            continue
        torch.testing.assert_close(acc, -g / n_tokens, msg=name_param[0])
        checked += int(g.abs().sum() > 0)
    assert checked >= 8  # attention parameters included: they only get gradient through REINFORCE


def test_terms_and_moving_average_baseline_match_the_learning_rule():
    model = _model(reinforce_weight=0.7, entropy_weight=0.05, expectation_prob=0.0).train()
    _force(model, lambda alpha, t: alpha.argmin(-1))  # deterministic paths, so a second pass can replay them
    vis = VisualBatch.from_features(torch.randn(3, 5, 6))
    captions = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 0], [4, 2, 0, 0]])

    def naive(baseline):
        logprobs, records, _ = model.teacher_force(vis, captions)
        terms = []
        for b in range(3):
            steps = int((captions[b] != 0).sum())
            logp_y = sum(logprobs[b, t, captions[b, t]] for t in range(steps))
            chosen = [int(records[t].extras["location"][b].argmax()) for t in range(steps)]
            logp_s = sum(torch.log(records[t].primary[b, chosen[t]]) for t in range(steps))
            entropy = sum(-(records[t].primary[b] * records[t].primary[b].log()).sum() for t in range(steps))
            terms.append((logp_y.detach(), logp_s, entropy))
        rewards = torch.stack([r for r, _, _ in terms])
        reinforce = -0.7 * sum((r - baseline) * s for r, s, _ in terms) / 9
        entropy = -0.05 * sum(h for _, _, h in terms) / 9  # 9 target tokens
        return rewards, reinforce, entropy

    rewards, _, _ = naive(0.0)
    _, aux = model.forward_xe(vis, captions)
    first = rewards.mean()  # the first mini-batch is its own baseline
    _, reinforce, entropy = naive(first)
    torch.testing.assert_close(aux["reinforce"], reinforce)
    torch.testing.assert_close(aux["entropy"], entropy)
    torch.testing.assert_close(model.baseline, first)

    with torch.no_grad():
        model.out_word.bias += 0.3 * torch.randn(11)  # another model: other rewards in mini-batch 2
    rewards, reinforce, _ = naive(first)  # b_{k-1} is used for mini-batch k
    _, aux = model.forward_xe(vis, captions)
    torch.testing.assert_close(aux["reinforce"], reinforce)
    torch.testing.assert_close(model.baseline, 0.9 * first + 0.1 * rewards.mean())  # b_k = 0.9 b_{k-1} + 0.1 r_k
    assert int(model.baseline_batches) == 2

    # captions that took the expectation get no REINFORCE term and do not move the baseline
    model.expectation_prob = 1.0
    before = model.baseline.clone()
    _, aux = model.forward_xe(vis, captions)
    assert aux["reinforce"].item() == 0 and torch.equal(model.baseline, before)
    # the baseline is model state: it is saved with the weights and restored on load (and on --resume)
    clone = create("sat-hard", **TINY)
    clone.load_state_dict(model.state_dict())
    assert torch.equal(clone.baseline, model.baseline) and int(clone.baseline_batches) == 2


def _coin(model, expected):
    """Fix §4.1's expectation coin: caption ``i`` takes the expected context where ``expected[i]``."""
    encode_rows = model.encode_rows

    def fixed(vis, rows=None):
        enc = encode_rows(vis, rows)
        enc["expected"] = torch.tensor(expected)
        return enc
    model.encode_rows = fixed


def test_a_mixed_batch_gives_the_same_terms_and_baseline_as_its_sampled_captions_alone():
    """Captions that took the expectation are not part of REINFORCE: in a mini-batch where some did, the baseline
    (the first mini-batch's own mean included) and the advantages come from the sampled captions' rewards alone,
    so the summed REINFORCE term is the one of a batch of only those captions (the terms are divided by all target
    tokens, hence the rescaling)."""
    vis = VisualBatch.from_features(torch.randn(3, 5, 6))
    captions = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 0], [4, 2, 0, 0]])
    mixed = _model(entropy_weight=0.0).train()
    _coin(mixed, [False, True, False])
    alone = _model(entropy_weight=0.0).train()
    _coin(alone, [False, False])
    for model in (mixed, alone):
        _force(model, lambda alpha, t: alpha.argmin(-1))
    for batch in range(2):  # the first mini-batch (its own mean as b) and the second (b_1)
        _, aux_mixed = mixed.forward_xe(vis, captions)
        _, aux_alone = alone.forward_xe(vis, captions[[0, 2]], rows=torch.tensor([0, 2]))
        torch.testing.assert_close(aux_mixed["reinforce"] * 9, aux_alone["reinforce"] * 6, msg=f"batch {batch}")
        torch.testing.assert_close(mixed.baseline, alone.baseline)
        assert aux_alone["reinforce"].item() != 0  # two different rewards: the advantages are not all zero


def test_a_first_mini_batch_with_nothing_sampled_leaves_the_baseline_unset():
    """If every caption of the first mini-batch took the expectation there are no rewards to average: the REINFORCE
    term is zero (not the NaN of an empty mean) and the next mini-batch is still the first to set b."""
    model = _model(expectation_prob=1.0).train()
    vis = VisualBatch.from_features(torch.randn(2, 5, 6))
    captions = torch.tensor([[5, 6, 2], [8, 2, 0]])
    _, aux = model.forward_xe(vis, captions)
    assert aux["reinforce"].item() == 0 and torch.isfinite(aux["entropy"])
    assert model.baseline.item() == 0 and int(model.baseline_batches) == 0


def test_padded_regions_give_finite_terms_and_gradients():
    """Region features come padded (α = 0 on the padding): H(α_t) takes 0 · log 0 as 0, not NaN, so the entropy
    term, the REINFORCE term and every gradient stay finite."""
    model = _model(expectation_prob=0.0).train()
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    vis = VisualBatch(torch.randn(2, 5, 6), mask)
    captions = torch.tensor([[5, 6, 2], [8, 2, 0]])
    logprobs, aux = model.forward_xe(vis, captions)
    assert set(aux) == {"reinforce", "entropy"} and all(torch.isfinite(term) for term in aux.values())
    (xe_loss(logprobs, captions, model.pad_id) + sum(aux.values())).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_several_location_samples_average_the_xe_term():
    """N_s paths per caption give the mean of their log-probs: sample j of each caption forced to location j equals
    the mean of N_s single-path runs, run j forced to location j (identical paths, as this test once forced, could
    not tell an N_s-sample mean from one sample)."""
    vis = VisualBatch.from_features(torch.randn(2, 5, 6))
    captions = torch.tensor([[5, 6, 2], [8, 2, 0]])
    model = _model(location_samples=3, expectation_prob=0.0).train()
    _force(model, lambda alpha, t: torch.arange(alpha.shape[0]) % 3)  # rows are caption-major: sample j → item j
    lp3, aux3 = model.forward_xe(vis, captions)
    singles = []
    for j in range(3):
        model.location_samples = 1
        _force(model, lambda alpha, t, j=j: torch.full((alpha.shape[0],), j))
        singles.append(model.forward_xe(vis, captions)[0])
    assert lp3.shape == singles[0].shape == (2, 3, 11)
    assert not torch.allclose(singles[0], singles[1])  # the paths do differ, so the mean below says something
    torch.testing.assert_close(lp3, torch.stack(singles).mean(0))
    assert set(aux3) == {"reinforce", "entropy"}


def test_memorises_ten_images_with_reinforce():
    """Memorisation smoke test through the hard-attention objective: training samples locations, decoding takes the
    arg-max."""
    vis, targets, captions = memorisation_task()
    torch.manual_seed(0)
    model = create("sat-hard", vocab_size=VOCAB, feat_dim=32, embed_dim=32, hidden_dim=64, attn_dim=32, dropout=0.0)
    loss = train_to_memorise(model, vis, targets, steps=200)
    cider, exact, hyps = memorisation_cider(model, vis, captions)
    assert cider > 2.0, (cider, exact, loss)
    assert int(model.baseline_batches) > 0 and model.baseline.item() < 0


def test_the_hard_model_has_no_beta_gate():
    """The β gate is the soft model's (§4.2.1; docs/decisions.md#sat-hard-decoding): the hard model's context never
    reads it, so a gate built anyway would be weights no step trains, saved in every checkpoint and counted in the
    zoo table's parameters, and a checkpoint saved without it would no longer load."""
    model = _model()
    assert model.gate is None
    assert not [name for name in model.state_dict() if name.startswith("gate.")]
    assert "gate" not in model.config()


def test_default_training_weights_are_the_documented_ones_and_the_recipes():
    """``captioner train --model sat-hard`` with no model options trains with the docstring's λ_r = 1, λ_e = 0.002,
    N_s = 1, §4.1's expectation coin of 0.5 and baseline decay of 0.9, and decodes with the expected context (the
    authors' generator); the paper recipe states the same numbers, so the two ways to train agree."""
    documented = dict(reinforce_weight=1.0, entropy_weight=0.002, location_samples=1, expectation_prob=0.5,
                      baseline_decay=0.9, decode_location="expectation")
    defaults = options("sat-hard")
    assert {key: defaults[key] for key in documented} == documented
    recipe = load_recipe("sat-hard")["model_args"]
    assert recipe == {key: documented[key] for key in recipe}


def test_the_options_are_kept_in_the_config_a_checkpoint_rebuilds_from():
    """A checkpoint rebuilds the model from ``config()``: every option of the hard model must be there (a resumed
    run sampling one path where it had three), and the soft model's ``doubly_stochastic``, which it does not take,
    must not."""
    chosen = dict(reinforce_weight=0.5, entropy_weight=0.01, location_samples=3, expectation_prob=0.25,
                  baseline_decay=0.8, decode_location="argmax")
    config = _model(**chosen).config()
    assert {key: config[key] for key in chosen} == chosen and "doubly_stochastic" not in config
    rebuilt = create("sat-hard", **config)
    assert {key: getattr(rebuilt, key) for key in chosen} == chosen


def test_with_no_dropout_option_the_hard_model_drops_as_the_soft_model_does():
    """The hard model is the soft decoder with another context (docs/decisions.md#sat-hard-decoding), so
    ``captioner train --recipe sat-hard``, whose recipe names no dropout, must train with the soft model's 0.5: a
    default of 1.0 would zero every word predictor's input in training, and the run would learn no words."""
    assert options("sat-hard")["dropout"] == options("sat")["dropout"] == 0.5
    model = create("sat-hard", **{key: value for key, value in TINY.items() if key != "dropout"})
    assert model.drop.p == 0.5


def test_the_hard_model_is_sized_as_the_soft_model_by_default():
    """The hard model is the soft decoder with another context (docs/decisions.md#sat-hard-decoding), and neither
    recipe names a size: ``captioner train --recipe sat-hard`` must build the soft model's word embedding, LSTM and
    attention layer, or a comparison of the two attentions would also compare two networks of different widths."""
    hard, soft = options("sat-hard"), options("sat")
    sizes = ("embed_dim", "hidden_dim", "attn_dim", "dropout")
    assert {key: hard[key] for key in sizes} == {key: soft[key] for key in sizes}
    assert not set(load_recipe("sat-hard")["model_args"]) & set(sizes)
