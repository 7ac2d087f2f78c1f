"""Self-critical sequence training (Rennie et al. 2017, arXiv:1612.00563; AoANet §3.3, X-LAN §3.3.1): reward,
advantages and loss against naive code; SCST raises training CIDEr-D; the phase trains from an XE checkpoint, saves,
and resumes exactly."""

import inspect
import json
from pathlib import Path

import pytest
import torch
from pycocoevalcap.cider.cider import Cider
from safetensors.torch import load_file

from captioner.models.checkpoint import load_checkpoint, save_checkpoint
from captioner.models.data.karpathy import CaptionedImage
from captioner.models.decoding import greedy, sample
from captioner.models.evaluation.metrics import CiderD
from captioner.models.training import TrainConfig, prepare_run, train
from captioner.models.training.scst import SCSTPhase, scst_advantages, scst_batch_loss, scst_loss
from captioner.models.vocab import Vocabulary
from captioner.models.zoo import create

from .model_checks import VOCAB, keys_store, memorisation_task, train_to_memorise

# tiny tensors gain nothing from a second thread, and on a busy machine waiting for it dominates
pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(embed_dim=32, hidden_dim=48, attn_dim=32, dropout=0.3)


def _words(ids):
    """Memorisation-task ids → text, up to EOS (id 2) and without padding (id 0), as ``vocab.decode`` does."""
    ids = ids[:ids.index(2)] if 2 in ids else ids
    return " ".join(f"w{i}" for i in ids if i != 0)


def _little_xe_sat(vis, targets):
    """A small SAT after a little XE on the memorisation task: far from memorised, so SCST has work to do."""
    torch.manual_seed(0)
    model = create("sat", vocab_size=VOCAB, feat_dim=32, embed_dim=32, hidden_dim=64, attn_dim=32, dropout=0.0)
    train_to_memorise(model, vis, targets, steps=25, stop_loss=0.0)
    return model


def _scst_steps(model, vis, refs, cider, steps, samples):
    """``steps`` Adam steps on the SCST loss; the last step's logs."""
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        loss, logs = scst_batch_loss(model, vis, refs, cider, _words, samples=samples, max_len=12)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return logs


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("features")


def test_cider_d_matches_pycocoevalcap_with_fixed_document_frequencies():
    refs = [["a red circle on the left", "a red circle", "one red circle and a blue square"],
            ["two green stars", "green stars on a striped background"],
            ["a blue square above a yellow triangle", "a square and a triangle"],
            ["three purple diamonds", "purple diamonds from left to right", "diamonds"]]
    captions = ["a red circle", "two green green stars", "a blue square and a triangle", ""]
    cider = CiderD(refs)
    ours = cider.score(captions, refs)
    _, theirs = Cider().compute_score({i: r for i, r in enumerate(refs)},
                                      {i: [c] for i, c in enumerate(captions)})
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs, dtype=torch.float64))
    # the reward of a caption does not depend on what else is in the mini-batch
    assert cider.score([captions[2]], [refs[2]])[0] == pytest.approx(ours[2])


def test_advantages_and_loss_match_the_naive_formula():
    torch.manual_seed(0)
    rewards, greedy = torch.rand(3, 4), torch.rand(3)
    naive = torch.tensor([[rewards[b, j] - greedy[b] for j in range(4)] for b in range(3)])
    torch.testing.assert_close(scst_advantages(rewards, greedy), naive)
    loo = torch.tensor([[rewards[b, j] - sum(rewards[b, i] for i in range(4) if i != j) / 3 for j in range(4)]
                        for b in range(3)])
    torch.testing.assert_close(scst_advantages(rewards, None), loo)

    logprobs = (-torch.rand(12, 5)).requires_grad_()
    lengths = torch.randint(1, 6, (12,))
    mask = torch.arange(5)[None, :] < lengths[:, None]
    advantages = naive.flatten()
    loss = scst_loss(logprobs, mask, advantages)
    expected = -sum(advantages[r] * logprobs[r, t] for r in range(12) for t in range(int(lengths[r]))) / lengths.sum()
    torch.testing.assert_close(loss, expected)
    # a gradient step raises the log-probability of samples that beat the baseline, lowers the others
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert torch.all(grad[mask] * advantages[:, None].expand(-1, 5)[mask] <= 0) and torch.all(grad[~mask] == 0)


def test_scst_raises_the_expected_training_cider_d():
    """SCST maximises E_{y~p}[CIDEr-D(y)]; estimated with 40 fixed-seed samples per image, it rises."""
    vis, targets, captions = memorisation_task()
    refs = [[_words(c)] for c in captions]
    cider = CiderD(refs)

    def expected_reward(model):
        with torch.random.fork_rng():
            torch.manual_seed(123)
            with torch.no_grad():
                drawn = sample(model, vis, n=40, max_len=12)
        return cider.score([_words(row) for row in drawn.tokens.tolist()], [refs[r // 40] for r in range(400)]).mean()

    model = _little_xe_sat(vis, targets)
    before = expected_reward(model)
    logs = _scst_steps(model, vis, refs, cider, steps=40, samples=16)
    assert {"scst", "reward", "greedy_reward", "tokens"} == set(logs)
    after = expected_reward(model)
    assert after > 1.25 * before, (before, after)


def test_scst_phase_from_an_xe_checkpoint_saves_and_resumes(scenes, tmp_path, cache):
    common = dict(dataset=str(scenes), cache_dir=str(cache), train_limit=16, val_limit=4, progress=False)
    xe = train(TrainConfig(out=str(tmp_path / "xe"), model_args=SMALL, epochs=1, batch_size=16, lr=3e-3,
                           encoder={"image_size": 128}, **common))
    scst = dict(phase="scst", init=str(xe), epochs=2, batch_size=4, lr=1e-4, scst_samples=2, max_decode_len=8,
                **common)
    best = train(TrainConfig(out=str(tmp_path / "straight"), **scst))
    ckpt = load_checkpoint(best)
    assert ckpt.meta["phase"] == "scst" and ckpt.meta["selected_by"] == "CIDEr-D"
    assert ckpt.encoder.image_size == 128 and ckpt.vocab.itos == load_checkpoint(xe).vocab.itos
    history = json.loads((tmp_path / "straight" / "train_state.json").read_text())["progress"]["history"]
    assert len(history) == 2 and {"scst", "reward", "greedy_reward", "CIDEr-D"} <= set(history[-1])

    train(TrainConfig(out=str(tmp_path / "resumed"), max_steps=5, **scst))  # 4 steps an epoch: stops in epoch 2
    state = json.loads((tmp_path / "resumed" / "train_state.json").read_text())["progress"]
    assert (state["epoch"], state["step_in_epoch"]) == (1, 1)
    # the resume takes its model, vocabulary and lineage from its own state, not from the --init checkpoint, which
    # may have been moved (or retrained) since the run started
    xe.rename(tmp_path / "xe-moved")
    train(TrainConfig(out=str(tmp_path / "resumed"), **scst), resume=True)
    a = load_file(tmp_path / "straight" / "last" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "last" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], msg=f"{key} differs after resume")
    began = load_checkpoint(tmp_path / "resumed" / "last").meta["started_from"]
    assert began == ckpt.meta["started_from"] and began["checkpoint"] == str(xe) and began["phase"] == "xe"


def test_the_scst_phase_begins_from_its_init_checkpoints_weights(scenes, tmp_path, cache):
    """SCST improves the model it samples from (its XE stage, given as --init): a run that built fresh weights
    instead sampled from a random model, whose samples all score about 0, and nothing said so (the phase's other
    tests train on, and a resume takes its weights from its own state)."""
    common = dict(dataset=str(scenes), cache_dir=str(cache), train_limit=8, val_limit=2, progress=False)
    xe = prepare_run(TrainConfig(out=str(tmp_path / "xe"), model_args=SMALL, encoder={"image_size": 128}, seed=5,
                                 **common))  # another seed: the SCST run's own fresh weights are other ones
    init = save_checkpoint(tmp_path / "xe" / "best", xe.model, xe.vocab, xe.spec, {"phase": "xe"})
    scst = prepare_run(TrainConfig(out=str(tmp_path / "scst"), phase="scst", init=str(init), **common))
    trained = load_checkpoint(init).model.state_dict()
    began = scst.model.state_dict()
    assert began.keys() == trained.keys()
    for key in began:
        torch.testing.assert_close(began[key], trained[key], rtol=0, atol=0, msg=f"{key} is not --init's")


def test_scst_pushes_down_the_tokens_the_beam_search_never_emits():
    """The sampler draws from the whole softmax (``<unk>`` included), as REINFORCE's gradient needs: then a caption
    holding ``<unk>`` earns a low reward and SCST lowers ``<unk>``'s probability.  A sampler that never drew it, with
    the loss on the full softmax, only ever pushed it up under the mostly negative advantages (the collapse in
    docs/decisions.md, "Flickr8k: SCST")."""
    vis, targets, captions = memorisation_task()
    refs = [[_words(c)] for c in captions]
    cider = CiderD(refs)
    unk = 3  # Vocabulary.unk_id; _words writes it "w3", a word no reference holds

    def unk_mass(model):
        model.eval()
        with torch.no_grad():
            logprobs, _ = model.forward_xe(vis, targets)
        return float(logprobs[..., unk].exp()[targets != 0].mean())

    model = _little_xe_sat(vis, targets)
    with torch.no_grad():
        model.out_word.bias[unk] += 3.0  # give <unk> a large share to start from
    before = unk_mass(model)
    _scst_steps(model, vis, refs, cider, steps=30, samples=8)
    assert unk_mass(model) < 0.75 * before, (before, unk_mass(model))  # the old sampler: ×10 (0.013 → 0.139)


@pytest.mark.parametrize("with_end", [False, True])
def test_the_reward_counts_the_end_token_only_when_asked(tmp_path, with_end):
    """``--scst-reward-eos`` (self-critical.pytorch's ``array_to_str`` keeps the trailing 0, and its references hold
    it): the references and a caption that ended get the end token; one that ran to the length limit does not.
    Without the flag both are their words alone."""
    references = [["a", "dog", "runs", "through", "the", "grass"], ["a", "brown", "dog", "runs"]]
    vocab = Vocabulary.build(references)
    images = [CaptionedImage(1, Path("p.jpg"), "train", references)]
    cfg = TrainConfig(out=str(tmp_path), phase="scst", scst_reward_eos=with_end)
    model = create("sat", vocab_size=len(vocab), feat_dim=8, embed_dim=8, hidden_dim=8, attn_dim=8)
    phase = SCSTPhase(cfg, model, vocab, None, images, torch.device("cpu"))
    end = " <eos>" if with_end else ""
    assert phase.references == [["a dog runs through the grass" + end, "a brown dog runs" + end]]
    cut_short = vocab.encode(["a", "dog", "runs", "through", "the"])  # ends with <eos>
    assert cut_short[-1] == vocab.eos_id
    assert phase.reward_text(cut_short) == "a dog runs through the" + end
    assert phase.reward_text(cut_short[:-1] + [vocab.pad_id]) == "a dog runs through the"  # never ended
    # a sampled row is padded after its end: it ended all the same
    assert phase.reward_text(cut_short + [vocab.pad_id] * 2) == "a dog runs through the" + end


def test_the_rewards_document_frequencies_count_the_end_token_the_references_hold(tmp_path):
    """With ``--scst-reward-eos`` the document frequencies come from the references as they are scored, end token
    and all (self-critical.pytorch's count the trailing 0 too): the end token, in every image's references, then
    weighs nothing, as in pycocoevalcap's CIDEr-D of the same strings.  Frequencies taken from the bare words gave
    it the weight of a word no reference holds."""
    references = [[["a", "dog", "runs"], ["a", "brown", "dog"]], [["two", "cats", "sleep"], ["cats", "on", "a", "bed"]],
                  [["a", "red", "ball"]]]
    vocab = Vocabulary.build([ref for refs in references for ref in refs])
    images = [CaptionedImage(i, Path(f"{i}.jpg"), "train", refs) for i, refs in enumerate(references)]
    phase = SCSTPhase(TrainConfig(out=str(tmp_path), phase="scst", scst_reward_eos=True), None, vocab, None, images,
                      torch.device("cpu"))
    captions = [phase.reward_text(vocab.encode(words)) for words in (["a", "dog"], ["cats", "sleep"], ["a", "ball"])]
    assert all(caption.endswith(" <eos>") for caption in captions)
    _, theirs = Cider().compute_score(dict(enumerate(phase.references)), {i: [c] for i, c in enumerate(captions)})
    torch.testing.assert_close(torch.from_numpy(phase.cider.score(captions, phase.references)),
                               torch.tensor(theirs, dtype=torch.float64))


def test_the_greedy_baseline_is_decoded_in_eval_mode_and_the_model_is_left_training():
    """Rennie et al.'s baseline is the test-time (greedy, dropout off) caption: with dropout in the model, the
    logged greedy reward is that of the eval-mode greedy captions, whatever mode the model came in, and the
    samples (and the step after) see the model in train mode."""
    vis, targets, _ = memorisation_task()
    torch.manual_seed(0)
    model = create("sat", vocab_size=VOCAB, feat_dim=32, embed_dim=32, hidden_dim=64, attn_dim=32, dropout=0.5)
    train_to_memorise(model, vis, targets, steps=25, stop_loss=0.0)
    model.eval()
    texts = [_words(h.token_ids) for h in greedy(model, vis, max_len=12)]
    refs = [[text] for text in texts]  # the eval-mode greedy captions are the references: they score the most
    cider = CiderD(refs)
    expected = float(cider.score(texts, refs).mean())
    model.train()
    torch.manual_seed(1)
    with torch.random.fork_rng():
        noisy = [_words(h.token_ids) for h in greedy(model, vis, max_len=12)]
    assert noisy != texts, "dropout changes the train-mode greedy captions (else this test tells nothing)"
    _, logs = scst_batch_loss(model, vis, refs, cider, _words, samples=2, max_len=12)
    assert logs["greedy_reward"] == pytest.approx(expected)
    assert model.training
    model.eval()
    scst_batch_loss(model, vis, refs, cider, _words, samples=2, max_len=12)
    assert model.training


@pytest.mark.parametrize("baseline", ["greedy", "mean"])
def test_the_loss_is_eq_9_against_each_images_own_baseline(baseline, monkeypatch):
    """Rennie et al.'s Eq. 9 from the samples the model draws in train mode, each sample's advantage taken against
    its own image's greedy caption's reward, or (``--scst-baseline mean``, which decodes no greedy caption and logs
    none) against the mean reward of its image's other samples: here the one other, the fewest it takes."""
    vis, targets, captions = memorisation_task()
    refs = [[_words(c)] for c in captions]
    cider = CiderD(refs)
    model = _little_xe_sat(vis, targets)
    baselines = None
    if baseline == "greedy":
        model.eval()
        baselines = torch.from_numpy(cider.score([_words(h.token_ids) for h in greedy(model, vis, max_len=12)], refs))
        assert baselines.unique().numel() > 2, "the images' greedy rewards differ (else their order tells nothing)"
    else:
        monkeypatch.setattr("captioner.models.training.scst.greedy", lambda *args, **kwargs: pytest.fail("decoded"))
    torch.manual_seed(3)
    loss, logs = scst_batch_loss(model, vis, refs, cider, _words, samples=2, max_len=12, baseline=baseline)
    assert ("greedy_reward" in logs) == (baseline == "greedy")
    model.train()
    torch.manual_seed(3)
    drawn = sample(model, vis, n=2, max_len=12)
    rewards = torch.from_numpy(cider.score([_words(row) for row in drawn.tokens.tolist()],
                                           [refs[r // 2] for r in range(20)])).view(10, 2)
    expected = scst_loss(drawn.logprobs, drawn.mask, scst_advantages(rewards, baselines).flatten().float())
    torch.testing.assert_close(loss, expected)
    assert logs["reward"] == pytest.approx(float(rewards.mean()))
    assert logs["tokens"] == float(drawn.mask.sum())  # the step's token count: the samples' tokens up to their EOS


def test_the_loss_takes_the_advantages_as_constants_and_divides_by_the_tokens_however_few():
    """REINFORCE differentiates the log-probabilities alone: an advantage that carries a gradient (a learned
    baseline, say) gets none through the loss.  The normaliser is the token count however small: one sample that
    ended at once (its EOS the one token) weighs that token fully, and no token at all gives 0, not NaN."""
    logprobs = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    advantages = torch.tensor([2.0], requires_grad=True)
    loss = scst_loss(logprobs, torch.tensor([[True, False]]), advantages)
    torch.testing.assert_close(loss, torch.tensor(1.0))  # -(2 × -0.5) / 1
    assert torch.autograd.grad(loss, advantages, allow_unused=True) == (None,)
    torch.testing.assert_close(scst_loss(logprobs, torch.zeros(1, 2, dtype=torch.bool), advantages), torch.tensor(0.0))


def test_the_greedy_baseline_and_the_samples_are_decoded_to_the_same_length(monkeypatch):
    """The baseline is what the model earns greedily under the samples' own length limit: a greedy caption cut
    shorter scores less, and every sample's advantage grows by the difference."""
    vis, targets, captions = memorisation_task()
    refs = [[_words(c)] for c in captions]
    model = create("sat", vocab_size=VOCAB, feat_dim=32, embed_dim=8, hidden_dim=8, attn_dim=8)
    lengths = {}

    def spy(name, decode):
        def decoded(*args, **kwargs):
            lengths[name] = kwargs["max_len"]
            return decode(*args, **kwargs)
        return decoded

    monkeypatch.setattr("captioner.models.training.scst.greedy", spy("greedy", greedy))
    monkeypatch.setattr("captioner.models.training.scst.sample", spy("sample", sample))
    scst_batch_loss(model, vis, refs, CiderD(refs), _words, samples=2, max_len=7)
    assert lengths == {"greedy": 7, "sample": 7}


def test_the_batch_losss_defaults_are_the_training_commands():
    """Code that calls ``scst_batch_loss`` without the run's values samples, decodes and baselines as
    ``captioner train --phase scst`` does by default (5 samples an image, 20 steps, the greedy baseline)."""
    defaults = {name: p.default for name, p in inspect.signature(scst_batch_loss).parameters.items()}
    cfg = TrainConfig(out="run")
    assert (defaults["samples"], defaults["max_len"], defaults["baseline"]) == \
        (cfg.scst_samples, cfg.max_decode_len, cfg.scst_baseline) == (5, 20, "greedy")


def test_an_unknown_baseline_or_a_lone_sample_against_the_mean_is_refused():
    """A misspelt baseline is an error, not the mean baseline in silence; and the mean of an image's other samples
    needs another sample (with one it is 0/0, NaN advantages that would poison every weight)."""
    vis, targets, captions = memorisation_task()
    refs = [[_words(c)] for c in captions]
    model = create("sat", vocab_size=VOCAB, feat_dim=32, embed_dim=8, hidden_dim=8, attn_dim=8)
    with pytest.raises(ValueError, match="unknown SCST baseline 'Greedy'"):
        scst_batch_loss(model, vis, refs, CiderD(refs), _words, samples=2, max_len=4, baseline="Greedy")
    with pytest.raises(ValueError, match="at least 2 samples"):
        scst_advantages(torch.rand(3, 1), None)


def test_a_ranks_scst_loss_is_weighted_by_its_share_of_the_global_batchs_images(tmp_path, monkeypatch):
    """Under DDP a rank's SCST loss is scaled by its share of the global batch's images times the ranks (3 of 5 on
    the first of two ranks: 1.2 times); on one process, with or without the global batch, it is the loss itself."""
    references = [["a", "dog"], ["a", "cat"]]
    vocab = Vocabulary.build(references)
    images = [CaptionedImage(i, Path(f"{i}.jpg"), "train", references) for i in range(5)]
    store = keys_store()
    monkeypatch.setattr("captioner.models.training.scst.scst_batch_loss",
                        lambda *args: (torch.tensor(2.0), {"scst": 2.0, "tokens": 7.0}))
    phase = SCSTPhase(TrainConfig(out=str(tmp_path), phase="scst"), None, vocab, store, images, torch.device("cpu"))
    everything = [0, 1, 2, 3, 4]
    for shard, global_batch in ((everything, everything), (everything, None)):
        out = phase.loss(shard, global_batch)
        assert (out.loss.item(), out.tokens) == (2.0, 7)
    phase.world = 2
    assert phase.loss([0, 1, 2], everything).loss.item() == pytest.approx(2.0 * 3 * 2 / 5)


def test_a_batchs_loss_scores_its_own_images_with_the_runs_samples_length_and_baseline(tmp_path, monkeypatch):
    """The phase hands the batch loss the features and references of the batch's own images, in the batch's order,
    and the run's ``--scst-samples``, ``--max-decode-len`` and ``--scst-baseline``: the references of other images
    reward captions of the wrong picture, and a swapped sample count and length limit still trains, on 8 samples
    cut at 3 words, with nothing to say so."""
    references = [[["a", "dog"]], [["a", "cat"]], [["two", "birds"]]]
    vocab = Vocabulary.build([ref for refs in references for ref in refs])
    images = [CaptionedImage(i, Path(f"{i}.jpg"), "train", refs) for i, refs in enumerate(references)]
    calls = []

    def batch_loss(*args):
        calls.append(args)
        return torch.tensor(1.0), {"scst": 1.0, "tokens": 4.0}

    monkeypatch.setattr("captioner.models.training.scst.scst_batch_loss", batch_loss)
    cfg = TrainConfig(out=str(tmp_path), phase="scst", scst_samples=8, max_decode_len=3, scst_baseline="mean")
    phase = SCSTPhase(cfg, None, vocab, keys_store(), images, torch.device("cpu"))
    phase.loss([2, 0])
    ((model, vis, refs, cider, to_text, samples, max_len, baseline),) = calls
    assert (vis, refs) == ([images[2].key, images[0].key], [["two birds"], ["a dog"]])
    assert (samples, max_len, baseline) == (8, 3, "mean")
    assert cider is phase.cider and to_text == phase.reward_text
