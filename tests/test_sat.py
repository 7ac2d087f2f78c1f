"""SAT soft attention: equations against naive references, gradients, auxiliary loss."""

import pytest
import torch

from captioner.models.evaluation.params import PAPER_SIZES
from captioner.models.protocol import VisualBatch
from captioner.models.sat import SAT_OPTIONS
from captioner.models.zoo import create

from .model_checks import RecordingDropout

# tiny tensors gain nothing from a second thread, and on a busy machine waiting for it dominates (the gradcheck
# below took 170 s, not 1 s, while other test processes held both cores)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["sat", "sat-hard"])
def test_the_counted_sizes_are_the_documented_ones(name):
    """The parameter table counts the sizes of docs/decisions.md#sat-sizes (word embedding 512, LSTM 1024, attention
    MLP 512), which test_params holds as the defaults ``captioner train --model sat`` builds."""
    sizes = dict(embed_dim=512, hidden_dim=1024, attn_dim=512)
    assert {key: PAPER_SIZES[name][key] for key in sizes} == sizes


@pytest.mark.parametrize("option", sorted(SAT_OPTIONS))
def test_an_option_outside_its_values_is_refused_naming_them(option):
    """A mistyped option (``--model-arg gate=chanel``) is refused with the values it takes: taken, any value but
    the default builds the tutorial's other form silently, and the checkpoint records the typo as its config."""
    with pytest.raises(ValueError, match=rf"{option} must be one of \(.*\), got 'typo'"):
        create("sat", vocab_size=23, feat_dim=16, embed_dim=24, hidden_dim=32, attn_dim=20, **{option: "typo"})


def test_attention_matches_naive_equation(tiny_sat, random_visuals):
    enc = tiny_sat.encode(random_visuals)
    state = tiny_sat.init_state(enc)
    alpha = tiny_sat.attention(state, enc)
    att = tiny_sat.attend
    for b in range(3):
        scores = torch.stack([
            att.score.weight[0] @ torch.tanh(att.key.weight @ random_visuals.feats[b, i]
                                            + att.query.weight @ state["h"][b]
                                            + att.query.bias) + att.score.bias[0]
            for i in range(9)])
        torch.testing.assert_close(alpha[b], scores.softmax(0))
    mean = random_visuals.feats.mean(1)
    torch.testing.assert_close(state["h"], torch.tanh(tiny_sat.init_h(mean)))


def test_context_is_gated_expectation(tiny_sat, random_visuals):
    enc = tiny_sat.encode(random_visuals)
    state = tiny_sat.init_state(enc)
    alpha = tiny_sat.attention(state, enc)
    z, extras = tiny_sat.context(alpha, state, enc)
    beta = torch.sigmoid(tiny_sat.gate(state["h"]))
    naive = torch.stack([beta[b] * sum(alpha[b, i] * random_visuals.feats[b, i] for i in range(9)) for b in range(3)])
    torch.testing.assert_close(z, naive)
    torch.testing.assert_close(extras["beta_gate"], beta)


def test_channel_gate_scales_each_channel_and_reports_their_mean(random_visuals):
    """``gate="channel"`` (sgrvinod's ``f_beta``): ẑ_t = β_t ⊙ Σ_i α_{t,i} a_i with one gate per feature channel;
    the reported ``beta_gate`` is one number per word, the mean of the channels' gates."""
    torch.manual_seed(0)
    model = create("sat", vocab_size=23, feat_dim=16, embed_dim=24, hidden_dim=32, attn_dim=20, dropout=0.0,
                   gate="channel").eval()
    enc = model.encode(random_visuals)
    state = model.init_state(enc)
    alpha = model.attention(state, enc)
    z, extras = model.context(alpha, state, enc)
    beta = torch.sigmoid(model.gate(state["h"]))
    assert beta.shape == (3, 16)
    naive = torch.stack([torch.stack([beta[b, d] * sum(alpha[b, i] * random_visuals.feats[b, i, d] for i in range(9))
                                      for d in range(16)]) for b in range(3)])
    torch.testing.assert_close(z, naive)
    torch.testing.assert_close(extras["beta_gate"], torch.stack([sum(beta[b]) / 16 for b in range(3)])[:, None])


def test_masked_items_get_no_attention(tiny_sat):
    feats = torch.randn(2, 9, 16)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 5:] = False
    enc = tiny_sat.encode(VisualBatch(feats, mask))
    alpha = tiny_sat.attention(tiny_sat.init_state(enc), enc)
    assert torch.all(alpha[1, 5:] == 0) and torch.allclose(alpha.sum(-1), torch.ones(2))


def test_initial_state_is_from_the_mean_of_the_real_annotations_only(tiny_sat):
    """h_0 = tanh(f_init,h(ā)), c_0 = tanh(f_init,c(ā)) with ā the mean of the image's real items: padding
    (a shorter region set in a batch) must not move the initial state."""
    feats = torch.randn(2, 9, 16)
    feats[1, 5:] = 50.0
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 5:] = False
    state = tiny_sat.init_state(tiny_sat.encode(VisualBatch(feats, mask)))
    mean = torch.stack([feats[0].mean(0), feats[1, :5].mean(0)])
    torch.testing.assert_close(state["h"], torch.tanh(tiny_sat.init_h(mean)))
    torch.testing.assert_close(state["c"], torch.tanh(tiny_sat.init_c(mean)))


def test_training_drops_out_the_deep_output_sum_before_l_o(random_visuals):
    """Dropout sits on h_t *and* on E y_{t-1} + L_h h_t + L_z ẑ_t before L_o (our placement, §4.3 names no place):
    with L_h zeroed, h_t's dropout cannot reach the words, so any randomness left is the sum's."""
    torch.manual_seed(0)
    model = create("sat", vocab_size=23, feat_dim=16, embed_dim=24, hidden_dim=32, attn_dim=20, dropout=0.5)
    with torch.no_grad():
        model.out_h.weight.zero_()
    enc = model.encode(random_visuals)
    state = model.init_state(enc)
    prev = torch.full((3,), model.bos_id)
    first, second = (model.step(prev, state, enc)[0] for _ in range(2))
    assert not torch.allclose(first, second)
    model.eval()
    torch.testing.assert_close(model.step(prev, state, enc)[0], model.step(prev, state, enc)[0])


def test_deep_output_drops_out_h_t_and_the_sum_and_nothing_else(random_visuals):
    """The deep output layer's dropout (our placement, §4.3 names no place: :meth:`step`) acts on ``h_t`` before
    ``L_h`` and on ``E y_{t-1} + L_h h_t + L_z ẑ_t`` before ``L_o``, and on nothing else: with one of them left out,
    or ``ẑ_t`` dropped too, training regularises another model than the one documented, and no eval-mode output
    shows it."""
    torch.manual_seed(0)
    model = create("sat", vocab_size=23, feat_dim=16, embed_dim=24, hidden_dim=32, attn_dim=20, dropout=0.5)
    model.drop = RecordingDropout()
    enc = model.encode(random_visuals)
    prev, state = torch.full((3,), model.bos_id), model.init_state(enc)
    z, _ = model.context(model.attention(state, enc), state, enc)
    logprobs, new_state, _ = model.step(prev, state, enc)
    deep = model.embed(prev) + model.out_h(new_state["h"]) + model.out_z(z)
    assert len(model.drop.inputs) == 2 and model.drop.inputs[0] is new_state["h"]
    torch.testing.assert_close(model.drop.inputs[1], deep)
    torch.testing.assert_close(logprobs, model.out_word(deep).log_softmax(-1))


def test_hidden_output_drops_out_h_t_before_fc_and_nothing_else(random_visuals):
    """``output="hidden"`` is sgrvinod's ``fc(dropout(h))``: in training the dropout sits on ``h_t`` and on nothing
    else (an imported tutorial checkpoint fine-tuned here is regularised as the tutorial trained it)."""
    torch.manual_seed(0)
    model = create("sat", vocab_size=23, feat_dim=16, embed_dim=24, hidden_dim=32, attn_dim=20, dropout=0.5,
                   init_activation="none", attention_score="relu", gate="channel", output="hidden")
    model.drop = RecordingDropout()
    enc = model.encode(random_visuals)
    logprobs, state, _ = model.step(torch.full((3,), model.bos_id), model.init_state(enc), enc)
    assert len(model.drop.inputs) == 1 and model.drop.inputs[0] is state["h"]
    torch.testing.assert_close(logprobs, model.out_word(state["h"]).log_softmax(-1))


def test_doubly_stochastic_penalty_is_eq14_per_word(tiny_sat):
    attention = torch.rand(2, 5, 9).softmax(-1)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    tiny_sat.doubly_stochastic = 0.7
    got = tiny_sat.auxiliary_losses(attention, mask)["doubly_stochastic"]
    naive = sum(0.7 * sum((1 - sum(attention[b, t, i] for t in range(5) if mask[b, t])) ** 2 for i in range(9))
                / int(mask[b].sum()) for b in range(2)) / 2  # Eq. 14 per caption, over its words (XE is per word)
    torch.testing.assert_close(got, naive)


def test_forward_xe_shapes_and_gradcheck(tiny_sat):
    feats = torch.randn(2, 9, 16, dtype=torch.float64)
    model = tiny_sat.double()
    captions = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 0]])
    logprobs, aux = model.forward_xe(VisualBatch.from_features(feats), captions)
    assert logprobs.shape == (2, 4, 23) and "doubly_stochastic" in aux

    def loss_of(f):
        out, extra = model.forward_xe(VisualBatch.from_features(f), captions)
        return out.gather(-1, captions.unsqueeze(-1)).sum() + extra["doubly_stochastic"]

    assert torch.autograd.gradcheck(loss_of, (feats.requires_grad_(),), eps=1e-6, atol=1e-5)


def test_scheduled_sampling_feeds_the_models_own_word_and_teacher_forcing_the_captions(tiny_sat, random_visuals,
                                                                                         monkeypatch):
    """``ss_prob`` (Bengio et al.'s scheduled sampling) in the protocol's ``step`` loop: at 1 every step after the
    first reads the word the model sampled, and by default (validation, a library caller) every step reads the
    caption's previous word."""
    fed, step = [], tiny_sat.step

    def recording_step(prev_tokens, state, enc):
        fed.append(prev_tokens.tolist())
        return step(prev_tokens, state, enc)

    monkeypatch.setattr(tiny_sat, "step", recording_step)
    with torch.no_grad():
        tiny_sat.out_word.bias[11] = 1e4  # the model is sure of word 11, so its sample is 11
    captions = torch.tensor([[5, 6, 7, 2]] * 3)
    bos = tiny_sat.bos_id
    tiny_sat.forward_xe_attended(random_visuals, captions)
    assert fed == [[bos] * 3, [5] * 3, [6] * 3, [7] * 3]
    fed.clear()
    tiny_sat.forward_xe(random_visuals, captions, ss_prob=1.0)
    assert fed == [[bos] * 3, [11] * 3, [11] * 3, [11] * 3]
    # words 11 and 12 equally likely, their logits equal: what is fed is a sample of the model's distribution, not
    # its most likely word (argmax takes the first of a tie)
    with torch.no_grad():
        tiny_sat.out_word.weight[12], tiny_sat.out_word.bias[12] = tiny_sat.out_word.weight[11], 1e4
    fed.clear()
    torch.manual_seed(0)
    tiny_sat.forward_xe(random_visuals, captions, ss_prob=1.0)
    assert {token for tokens in fed[1:] for token in tokens} == {11, 12}


def test_captions_grouped_by_image_are_scored_against_their_own_image(tiny_sat, random_visuals):
    """``rows`` (``captioner train --group-by-image``): each image is encoded once and caption ``i`` reads the
    encoding of image ``rows[i]``, as if every caption came with its own copy of the image."""
    captions, rows = torch.tensor([[5, 6, 2], [7, 2, 0], [8, 9, 2]]), torch.tensor([2, 0, 2])
    grouped, _ = tiny_sat.forward_xe(random_visuals, captions, rows=rows)
    copied, _ = tiny_sat.forward_xe(VisualBatch(random_visuals.feats[rows], random_visuals.mask[rows]), captions)
    torch.testing.assert_close(grouped, copied)


def test_teacher_forcing_penalises_the_attention_of_every_word_but_the_padding(tiny_sat, random_visuals):
    """Eq. 14 sums the attention of the words a caption has, its ``<eos>`` included; the padding after it is no
    word (the token mask is ``captions != pad``)."""
    tiny_sat.doubly_stochastic = 1.0
    captions = torch.tensor([[5, 6, 2, 0], [7, 2, 0, 0], [8, 9, 10, 2]])
    _, aux, attention = tiny_sat.forward_xe_attended(random_visuals, captions)
    words = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    want = tiny_sat.auxiliary_losses(attention, words)["doubly_stochastic"]
    torch.testing.assert_close(aux["doubly_stochastic"], want)


def test_features_of_another_dtype_are_read_in_the_models_own(tiny_sat, random_visuals):
    """A library caller's model in float64 (as the gradcheck above uses) reads float32 features, as a float32
    model reads float16 ones from a user's own store: ``encode`` casts them to the model's dtype rather than
    failing in the first layer on a dtype mismatch."""
    model = tiny_sat.double()
    enc = model.encode(random_visuals)
    assert enc["feats"].dtype == enc["keys"].dtype == enc["mean"].dtype == torch.float64
    logprobs, _, _ = model.step(torch.full((3,), model.bos_id), model.init_state(enc), enc)
    assert logprobs.dtype == torch.float64
