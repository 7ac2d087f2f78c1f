"""SparseCap (Martins et al., arXiv:2002.05556, §3): equations, the shared decoder's alignment rule with sparse maps,
memorisation."""

import re

import pytest
import torch
import torch.nn.functional as F

from captioner.models import attention
from captioner.models.attention import NORMALISERS as REGISTERED
from captioner.models.attention import get_normaliser
from captioner.models.decoding import beam_search
from captioner.models.protocol import VisualBatch, configured_normaliser
from captioner.models.training import load_recipe
from captioner.models.zoo import available, create

from .model_checks import VOCAB, assert_beam_one_is_greedy, memorisation_cider, memorisation_task, train_to_memorise

# tiny tensors gain nothing from a second thread, and on a busy machine waiting for it dominates
pytestmark = pytest.mark.usefixtures("one_thread")

#: every normaliser of the table (a new one is checked in the model with no edit here), and those that give exact
#: zeros on the tiny model's scores (their zeros are checked to survive decoding; 1.5-entmax, say, zeroes only
#: at larger score gaps, so a new one is not assumed to)
NORMALISERS = tuple(REGISTERED)
SPARSE_HERE = ("sparsemax", "tvmax")


def _tiny(attention: str, **overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=23, feat_dim=16, embed_dim=12, hidden_dim=20, visual_dim=18, attn_dim=14,
                  dropout=0.0, attention=attention)
    config.update(overrides)
    return create("sparsecap", **config).eval()


def _visuals(batch: int = 3, seed: int = 1) -> VisualBatch:
    torch.manual_seed(seed)
    return VisualBatch.from_features(torch.randn(batch, 64, 16))


def _scores(att, feats, h):
    """``z_i = wᵀ tanh(affine([v_i; h]))`` of one of the two attentions, before its normaliser."""
    return att.score(torch.tanh(att.key(feats) + att.query(h).unsqueeze(1))).squeeze(-1)


def test_registered_with_config_round_trip():
    assert "sparsecap" in available()
    model = _tiny("tvmax", tvmax_lambda=0.05)
    assert model.arch == "sparsecap" and model.attention_kind == "output_attention"
    config = model.config()
    assert config["attention"] == "tvmax" and config["tvmax_lambda"] == 0.05
    assert config["input_attention_normalizer"] == "softmax"
    clone = create("sparsecap", **config)
    clone.load_state_dict(model.state_dict())
    with pytest.raises(ValueError):
        create("sparsecap", vocab_size=5, feat_dim=4, attention="entmax")


def test_every_option_given_is_in_the_config_a_checkpoint_is_rebuilt_from():
    """A checkpoint is rebuilt from ``config()``: an option it leaves out comes back as its default (a model trained
    with ``--set dropout=0.3`` would fine-tune with 0.5), so every one given, none at its default, is there."""
    options = dict(embed_dim=6, hidden_dim=7, visual_dim=8, attn_dim=9, dropout=0.3, attention="sparsemax",
                   tvmax_lambda=0.05, input_attention_normalizer="tvmax")
    config = create("sparsecap", vocab_size=5, feat_dim=4, **options).config()
    assert {name: config[name] for name in options} == options
    assert create("sparsecap", **config).config() == config


def test_built_bare_or_from_its_recipe_it_has_the_papers_sizes():
    """SparseCap §4: word embeddings of 256, an LSTM of d = 512, λ = 0.01 for TVmax; §3's projection to g = 512
    (docs/decisions.md#sparsecap-visual-projection), our dropout of 0.5 (docs/decisions.md#sparsecap-dropout) and
    our attention size of 512, which docs/parameters.md counts.  The recipe names only some of them, so the
    constructor's defaults are the rest of what ``captioner train --recipe sparsecap`` trains, and all of what a
    library user's ``create("sparsecap", ...)`` builds."""
    papers = dict(embed_dim=256, hidden_dim=512, visual_dim=512, attn_dim=512, dropout=0.5, tvmax_lambda=0.01)
    for model_args in ({}, load_recipe("sparsecap")["model_args"]):
        config = create("sparsecap", vocab_size=5, feat_dim=4, **model_args).config()
        assert {name: config[name] for name in papers} == papers, model_args


@pytest.mark.parametrize("option", ["attention", "input_attention_normalizer"])
def test_tvmax_lambda_is_the_strength_either_tvmax_attention_runs_with(option):
    """``--set tvmax_lambda=0.005`` trains with the authors' strength (docs/decisions.md#tvmax-lambda-convention):
    the λ given is the one TVmax runs with, in the output attention and in an input attention set to TVmax.  The
    other tests use the default λ, which a normaliser built without it would use too."""
    lam = 0.2
    model, vis = _tiny(**{"attention": "softmax", option: "tvmax"}, tvmax_lambda=lam), _visuals()
    enc = model.encode(vis)
    torch.manual_seed(2)
    state = {"h": torch.randn(3, 20), "c": torch.randn(3, 20)}
    _, new_state, record = model.step(torch.tensor([1, 5, 7]), state, enc)
    if option == "attention":  # from h_t
        weights, scores = record.primary, _scores(model.output_attention, enc["feats"], new_state["h"])
    else:  # from h_{t−1}
        weights, scores = record.extras["input_attention"], _scores(model.input_attention, enc["feats"], state["h"])
    torch.testing.assert_close(weights, get_normaliser("tvmax", lam=lam)(scores, None))
    assert not torch.allclose(weights, get_normaliser("tvmax")(scores, None), atol=1e-3)  # λ matters here


def test_a_normaliser_added_to_the_table_is_one_sparsecap_can_take(monkeypatch):
    # an unknown name is a ValueError (the CLI's one-line error), for either of SparseCap's normalisers
    for option in ("attention", "input_attention_normalizer"):
        with pytest.raises(ValueError, match="nope"):
            create("sparsecap", vocab_size=5, feat_dim=4, **{option: "nope"})

    def halved(scores, mask=None):
        return F.softmax(scores / 2, dim=-1)

    monkeypatch.setitem(attention.NORMALISERS, "halved", halved)
    model = create("sparsecap", vocab_size=5, feat_dim=4, attention="halved", input_attention_normalizer="halved")
    assert model.config()["attention"] == "halved" and model.attention_name == "halved"


def test_a_configured_attention_that_is_not_a_normaliser_name_reads_as_softmax():
    """``configured_normaliser`` reads a checkpoint's ``config.json`` for the zoo tables and ``GET /models``: only a
    string ``attention`` names a normaliser (SparseCap's); a model of a library user whose ``attention`` option is a
    switch or a number takes none, so it is softmax, not ``True`` in the table."""
    assert configured_normaliser({"attention": "sparsemax"}) == "sparsemax"
    for config in ({}, {"attention": None}, {"attention": True}, {"attention": 4}):
        assert configured_normaliser(config) == "softmax"


@pytest.mark.parametrize("option", ["attention", "input_attention_normalizer"])
def test_a_tvmax_attention_on_either_side_blocks_the_export_naming_the_prox(option):
    """TVmax's prox iterates until a certificate holds: a trace would freeze the count that certified the example's
    scores, and the graph pass its checks while returning an uncertified attention on other images.  That holds
    for an input attention set to TVmax as much as for the output one."""
    blocker = _tiny(**{"attention": "softmax", option: "tvmax"}).export_blocker()
    assert re.search(r"TVmax's 2D TV prox \(models/attention/tvmax\.py:\d+\) iterates", blocker or ""), blocker
    assert _tiny("sparsemax", input_attention_normalizer="sparsemax").export_blocker() is None


@pytest.mark.parametrize("attention", NORMALISERS)
def test_step_matches_the_equations(attention):
    model, vis = _tiny(attention), _visuals()
    enc = model.encode(vis)
    state = {"h": torch.randn(3, 20), "c": torch.randn(3, 20)}
    prev = torch.tensor([1, 5, 7])
    logprobs, new_state, record = model.step(prev, state, enc)
    assert logprobs.shape == (3, 23) and record.primary.shape == (3, 64)
    assert record.extras["input_attention"].shape == (3, 64)

    feats = F.relu(model.project(vis.feats))  # V, g-dimensional
    torch.testing.assert_close(enc["feats"], feats)
    alpha = _scores(model.input_attention, feats, state["h"]).softmax(-1)  # from h_{t−1}, always softmax
    torch.testing.assert_close(record.extras["input_attention"], alpha)
    h, c = model.lstm(torch.cat([model.embed(prev), torch.einsum("bn,bnd->bd", alpha, feats)], 1),
                      (state["h"], state["c"]))
    torch.testing.assert_close(new_state["h"], h)
    torch.testing.assert_close(new_state["c"], c)
    normalise = get_normaliser(attention, lam=0.01) if attention == "tvmax" else get_normaliser(attention)
    alpha_out = normalise(_scores(model.output_attention, feats, h), None)  # from h_t, with the normaliser under test
    torch.testing.assert_close(record.primary, alpha_out)
    readout = torch.tanh(model.readout(torch.einsum("bn,bnd->bd", alpha_out, feats)))
    torch.testing.assert_close(logprobs, model.out_word(torch.cat([readout, h], 1)).log_softmax(-1))
    if attention in SPARSE_HERE:
        assert (record.primary == 0).any()


def test_initial_state_is_zero_and_masks_are_respected():
    model = _tiny("tvmax")
    feats = torch.randn(2, 64, 16)
    mask = torch.ones(2, 64, dtype=torch.bool)
    mask[1, 48:] = False
    enc = model.encode(VisualBatch(feats, mask))
    state = model.init_state(enc)
    assert torch.all(state["h"] == 0) and torch.all(state["c"] == 0)
    _, _, record = model.step(torch.tensor([1, 1]), state, enc)
    for weights in (record.primary, record.extras["input_attention"]):
        assert torch.all(weights[1, 48:] == 0)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2))


def _step_evaluated_then_trained(model, vis):
    """One step of ``model`` (hidden size 20) from the same state and words, in evaluation mode and then in training
    mode, where its dropout acts; the model is left in training mode."""
    enc = model.encode(vis)
    torch.manual_seed(2)
    state = {"h": torch.randn(3, 20), "c": torch.randn(3, 20)}
    prev = torch.tensor([1, 5, 7])
    evaluated = model.step(prev, state, enc)
    torch.manual_seed(3)
    model.train()
    return evaluated, model.step(prev, state, enc)


def test_dropout_acts_only_where_h_feeds_the_word_predictor():
    """docs/decisions.md#sparsecap-dropout: the dropout is on ``h_t`` in Eq. 10 only, so the recurrent state (and
    the attentions computed from it) are the same in training and evaluation mode; the word distribution is not."""
    model, vis = _tiny("softmax", dropout=0.5), _visuals()
    (logprobs, evaluated, _), (trained_logprobs, trained, _) = _step_evaluated_then_trained(model, vis)
    torch.testing.assert_close(model.encode(vis)["feats"], model.eval().encode(vis)["feats"])  # nor V
    assert not torch.allclose(trained_logprobs, logprobs)  # the dropout is active
    torch.testing.assert_close(trained["h"], evaluated["h"])
    torch.testing.assert_close(trained["c"], evaluated["c"])


def test_dropout_leaves_the_visual_readout_of_eq_10_whole():
    """Eq. 10's ``affine([r_t; h_t])`` gets the dropout on ``h_t`` only (docs/decisions.md#sparsecap-dropout): with
    the word predictor reading ``r_t = tanh(affine(s̃_t))`` alone, training and evaluation give the same words."""
    model, vis = _tiny("softmax", dropout=0.5), _visuals()
    with torch.no_grad():
        model.out_word.weight[:, 20:] = 0  # the columns of h_t (hidden_dim 20) after those of r_t
    evaluated, trained = _step_evaluated_then_trained(model, vis)
    torch.testing.assert_close(trained[0], evaluated[0])


@torch.no_grad()
def _teacher_forced(model, vis, token_ids, row):
    single = VisualBatch(vis.feats[row:row + 1], vis.mask[row:row + 1])
    enc = model.encode(single)
    state = model.init_state(enc)
    prev = torch.tensor([model.bos_id])
    primary, extra = [], []
    for token in token_ids:
        _, state, record = model.step(prev, state, enc)
        primary.append(record.primary[0])
        extra.append(record.extras["input_attention"][0])
        prev = torch.tensor([token])
    return torch.stack(primary), torch.stack(extra)


@pytest.mark.parametrize("attention", NORMALISERS)
def test_beam_search_attention_is_aligned_and_keeps_exact_zeros(attention):
    model, vis = _tiny(attention), _visuals()
    model.out_word.bias.data[model.eos_id] += 2.0  # let some captions end before max_len
    results = beam_search(model, vis, k=3, max_len=8, n_best=2)
    for row, hyps in enumerate(results):
        for hyp in hyps:
            steps = len(hyp.token_ids)
            assert hyp.attention.shape == (steps, 64) and hyp.extras["input_attention"].shape == (steps, 64)
            primary, extra = _teacher_forced(model, vis, hyp.token_ids, row)
            torch.testing.assert_close(hyp.attention, primary, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(hyp.extras["input_attention"], extra, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(hyp.attention.sum(-1), torch.ones(steps))
            if attention == "softmax":
                assert (hyp.attention > 0).all()
            # exact zeros survive the beam bookkeeping, in exactly the cells the model zeroed
            assert (hyp.attention == 0).any() or attention not in SPARSE_HERE
            assert torch.equal(hyp.attention == 0, primary == 0)


def test_beam_one_equals_greedy_with_tvmax():
    model, vis = _tiny("tvmax"), _visuals()
    assert_beam_one_is_greedy(model, vis, max_len=8)


def test_forward_xe_gradients_reach_every_parameter():
    model = _tiny("tvmax").train()
    captions = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 0]])
    logprobs, aux = model.forward_xe(_visuals(2), captions)
    assert logprobs.shape == (2, 4, 23) and aux == {}
    F.nll_loss(logprobs.flatten(0, 1), captions.flatten(), ignore_index=0).backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert missing == [], missing
    assert model.output_attention.query.weight.grad.abs().sum() > 0


def test_memorises_ten_images_with_tvmax():
    """Memorisation smoke test: 10 random 8×8 feature maps with fixed random captions are memorised."""
    vis, targets, captions = memorisation_task()
    torch.manual_seed(0)
    model = create("sparsecap", vocab_size=VOCAB, feat_dim=32, embed_dim=32, hidden_dim=64, visual_dim=32,
                   attn_dim=32, dropout=0.0, attention="tvmax")
    loss = train_to_memorise(model, vis, targets)
    cider, exact, hyps = memorisation_cider(model, vis, captions)
    assert exact == 10 and cider > 2.0, (exact, cider, loss)
    assert all((h.attention == 0).any() for h in hyps)  # the trained TVmax attention is sparse
