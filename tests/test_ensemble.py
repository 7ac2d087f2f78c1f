"""Ensembles of trained captioners (models/ensemble.py): the step against a naive mean of the members' probabilities,
decoding through the one beam search, the checkpoint format, the members' checks, greedy selection and the command."""

import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from captioner.models.checkpoint import load_checkpoint, save_checkpoint
from captioner.models.decoding import beam_search
from captioner.models.ensemble import Ensemble, build_ensemble, select_members
from captioner.models.evaluation.card import write_card
from captioner.models.protocol import VisualBatch
from captioner.models.vocab import Vocabulary
from captioner.models.zoo import create

from .conftest import WEIGHTS
from .model_checks import assert_checkpoint_round_trip, rescored_beams
from .serving_helpers import ENSEMBLE_MEMBERS, FEAT_DIM, TINY_SPEC, VOCAB, tiny_checkpoint
from .test_cli import captioner

pytestmark = pytest.mark.usefixtures("one_thread")


def members(*archs: str):
    return [tiny_checkpoint(arch, seed) for seed, arch in enumerate(archs or ENSEMBLE_MEMBERS)]


def visuals(images: int = 2, items: int = 9, seed: int = 0) -> VisualBatch:
    torch.manual_seed(seed)
    return VisualBatch.from_features(torch.randn(images, items, FEAT_DIM))


def test_a_step_is_the_log_of_the_mean_of_the_members_probabilities():
    checkpoints = members("sat", "area-transformer", "sparsecap")
    ensemble = build_ensemble(checkpoints)
    vis = visuals()
    enc = ensemble.encode(vis)
    state = ensemble.init_state(enc)
    own = [c.model for c in checkpoints]
    own_enc = [m.encode(vis) for m in own]
    own_state = [m.init_state(e) for m, e in zip(own, own_enc)]
    prev = torch.full((2,), ensemble.bos_id)
    for word in (5, 9, 4):
        logprobs, state, attn = ensemble.step(prev, state, enc)
        steps = [m.step(prev, s, e) for m, s, e in zip(own, own_state, own_enc)]
        own_state = [s for _, s, _ in steps]
        probabilities = sum(lp.exp() for lp, _, _ in steps) / len(steps)  # naive: in probability space
        torch.testing.assert_close(logprobs, probabilities.log(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(attn.primary, sum(a.primary for _, _, a in steps) / len(steps))
        prev = torch.full((2,), word)


def test_the_mean_stays_finite_where_every_member_rules_a_word_out():
    ensemble = build_ensemble(members())
    enc = ensemble.encode(visuals(1))
    state = ensemble.init_state(enc)
    for member in ensemble.members:  # a word each member gives log-prob about -1e4: exp underflows in float32
        with torch.no_grad():
            [m for m in member.modules() if isinstance(m, torch.nn.Linear) and m.out_features == len(VOCAB)][-1] \
                .bias[7] = -1e4
    with torch.no_grad():
        logprobs, _, _ = ensemble.step(torch.tensor([ensemble.bos_id]), state, enc)
    assert torch.isfinite(logprobs[0, 7]) and logprobs[0, 7] < -1000
    assert math.isclose(float(logprobs.exp().sum()), 1.0, rel_tol=1e-5)


def test_an_ensemble_of_one_model_twice_decodes_as_that_model():
    checkpoint = tiny_checkpoint("sat", 3)
    vis = visuals(3)
    for alone, twice in zip(beam_search(checkpoint.model, vis, k=3, max_len=8),
                            beam_search(build_ensemble([checkpoint, checkpoint]), vis, k=3, max_len=8)):
        assert alone[0].token_ids == twice[0].token_ids
        torch.testing.assert_close(alone[0].attention, twice[0].attention)
        torch.testing.assert_close(torch.tensor(alone[0].token_logprobs), torch.tensor(twice[0].token_logprobs))


def test_a_built_ensemble_is_in_eval_mode_as_a_loaded_checkpoint_is():
    """A library user decodes what ``build_ensemble`` returns directly (``beam_search``): a new module is in
    training mode, and its members' dropout would make two searches of one photo disagree."""
    ensemble = build_ensemble(members())
    assert not [name for name, module in ensemble.named_modules() if module.training]


def test_beam_search_keeps_the_attention_rows_with_their_tokens():
    ensemble = build_ensemble(members())
    vis = visuals(2)
    vis.mask[1, -3:] = False  # padded items get no attention from any member
    assert sum(1 for _ in rescored_beams(ensemble, vis, tolerance=dict(atol=1e-5, rtol=1e-5))) == 4


def test_one_checkpoint_format(tmp_path):
    ensemble = build_ensemble(members())
    assert_checkpoint_round_trip(ensemble, visuals(2), tmp_path / "ensemble")
    assert load_checkpoint(tmp_path / "ensemble").model.config()["members"][1]["arch"] == ENSEMBLE_MEMBERS[1]


def test_members_may_be_given_by_their_folders(tmp_path):
    # a library user's audit: folders were an AttributeError ('str' object has no attribute 'name')
    folders = []
    for index, member in enumerate(members()):
        save_checkpoint(tmp_path / f"m{index}", member.model, member.vocab, member.encoder)
        folders.append(str(tmp_path / f"m{index}"))
    from_folders, loaded = build_ensemble(folders), build_ensemble(members())
    assert all(torch.equal(a, b) for a, b in zip(from_folders.state_dict().values(), loaded.state_dict().values()))


def test_members_may_be_given_as_paths_as_well_as_strings(tmp_path):
    """The docstring's "or its folder": a ``pathlib.Path`` (what a library user's ``Path("weights") / name``
    gives) is a folder as much as a string is, not a checkpoint to read ``.name`` from."""
    for index, member in enumerate(members()):
        save_checkpoint(tmp_path / f"m{index}", member.model, member.vocab, member.encoder)
    from_paths, loaded = build_ensemble([tmp_path / "m0", tmp_path / "m1"]), build_ensemble(members())
    assert all(torch.equal(a, b) for a, b in zip(from_paths.state_dict().values(), loaded.state_dict().values()))


def test_an_ensemble_takes_its_members_special_ids():
    """A checkpoint records its model's pad, bos and eos ids (``special_ids``): the ensemble's beam search starts
    from its members' bos and stops at their eos, not at the protocol's defaults."""
    ids = dict(pad_id=2, bos_id=0, eos_id=1)
    ensemble = build_ensemble([tiny_checkpoint(arch, seed, **ids) for seed, arch in enumerate(ENSEMBLE_MEMBERS)])
    assert (ensemble.pad_id, ensemble.bos_id, ensemble.eos_id) == (2, 0, 1)


def test_fewer_than_two_members_are_refused_by_name_however_the_ensemble_is_built():
    """No checkpoint at all is the builder's own refusal (it was about to read the first one), and a config of one
    member does not build: an ensemble of one is that model under another name."""
    with pytest.raises(ValueError, match="at least two checkpoints"):
        build_ensemble([])
    # one checkpoint (`captioner ensemble OUT ONE` parses) is the builder's refusal too, not the config's, whose
    # message sends the user of `captioner ensemble` to `captioner ensemble`
    with pytest.raises(ValueError, match="^an ensemble needs at least two checkpoints$"):
        build_ensemble([tiny_checkpoint("sat")])
    sat = tiny_checkpoint("sat").model
    with pytest.raises(ValueError, match="at least two members"):
        create("ensemble", vocab_size=len(VOCAB), feat_dim=FEAT_DIM, members=[{"arch": "sat", "model": sat.config()}])


def test_members_must_share_words_and_visual_items():
    a, b = members("sat", "sparsecap")
    with pytest.raises(ValueError, match="another vocabulary"):
        build_ensemble([a, replace(b, vocab=Vocabulary([f"v{i}" for i in range(20)]))])
    with pytest.raises(ValueError, match="encoder spec"):
        build_ensemble([a, replace(b, encoder=replace(TINY_SPEC, image_size=128))])
    named_grid = replace(b, meta={**b.meta, "train_config": {"features": "grid"}})
    assert build_ensemble([a, named_grid]).members  # a run that named the grid read what one that did not read
    on_regions = replace(b, meta={**b.meta, "train_config": {"features": "regions:/data/boxes"}})
    with pytest.raises(ValueError, match="other features"):
        build_ensemble([a, on_regions])
    with pytest.raises(ValueError, match="at least two"):
        build_ensemble([a])
    nested = replace(a, model=build_ensemble([a, b]))
    with pytest.raises(ValueError, match="not ensembles"):
        build_ensemble([nested, b])


def test_members_named_the_same_are_told_apart_by_their_folders():
    # "error: sat has another vocabulary than sat" said nothing of which was which
    a, b = members("sat", "sat")
    scenes, photos = replace(a, path=Path("weights/sat")), replace(b, path=Path("weights/flickr8k/sat"))
    with pytest.raises(ValueError, match="^weights/flickr8k/sat has another vocabulary than weights/sat "):
        build_ensemble([scenes, replace(photos, vocab=Vocabulary([f"v{i}" for i in range(20)]))])


def test_its_attention_is_named_by_its_members():
    sparse = tiny_checkpoint("sparsecap", 1, attention="sparsemax")
    ensemble = build_ensemble([tiny_checkpoint("sat"), sparse])
    assert ensemble.attention_name == "mean of softmax and sparsemax"
    # the kind that /models and every caption result name: a mean of maps, not the protocol's generic "attention"
    # nor a member's own (a sparsecap member's "output_attention" would draw its heatmaps in blocks)
    assert ensemble.attention_kind == "ensemble_mean_attention"


def test_an_ensemble_is_built_not_trained():
    with pytest.raises(ValueError, match="captioner ensemble"):
        create("ensemble", vocab_size=len(VOCAB), feat_dim=FEAT_DIM)
    ensemble = build_ensemble(members())
    with pytest.raises(ValueError, match="not trained"):
        ensemble.forward_xe(visuals(1), torch.tensor([[4, 2]]))


def test_a_config_whose_members_have_other_sizes_is_refused_naming_the_member():
    """A config.json edited by hand (or one member's vocabulary regrown) builds members of other sizes than the
    ensemble's: the mean would mix distributions over different words."""
    sat = tiny_checkpoint("sat").model
    members = [{"arch": "sat", "model": sat.config()}, {"arch": "sat", "model": {**sat.config(), "vocab_size": 30}}]
    with pytest.raises(ValueError, match=f"member sat has 30 words over {FEAT_DIM}-d features; the ensemble has "
                                         f"{len(VOCAB)} over {FEAT_DIM}"):
        create("ensemble", vocab_size=len(VOCAB), feat_dim=FEAT_DIM, members=members)


def test_a_config_whose_members_read_other_features_is_refused_naming_the_member():
    """The members attend over the ensemble's visual items: one built for features of another width could not read
    them."""
    sat = tiny_checkpoint("sat").model
    members = [{"arch": "sat", "model": sat.config()}, {"arch": "sat", "model": {**sat.config(), "feat_dim": 64}}]
    with pytest.raises(ValueError, match=f"member sat has {len(VOCAB)} words over 64-d features; the ensemble has "
                                         f"{len(VOCAB)} over {FEAT_DIM}"):
        create("ensemble", vocab_size=len(VOCAB), feat_dim=FEAT_DIM, members=members)


@pytest.mark.parametrize("tvmax_first", [False, True], ids=["last", "first"])
def test_a_member_that_cannot_be_exported_blocks_the_ensemble_naming_it(tvmax_first):
    """Every member is asked, the first as much as the rest: an ensemble led by a TVmax member would otherwise pass
    ``captioner export``'s check, and its graph would freeze the prox's iteration count of the example and serve
    uncertified maps on other photos instead of being refused naming the member."""
    tvmax = tiny_checkpoint("sparsecap", 1, attention="tvmax")
    assert build_ensemble(members()).export_blocker() is None
    led = [tvmax, tiny_checkpoint("sat")] if tvmax_first else [tiny_checkpoint("sat"), tvmax]
    blocked = build_ensemble(led).export_blocker()
    assert blocked == f"member sparsecap: {tvmax.model.export_blocker()}"


def test_greedy_forward_selection_adds_the_best_member_until_the_gain_is_too_small(monkeypatch):
    names = ("start", "weak", "strong", "helper", "noise")
    candidates = [SimpleNamespace(name=n, model=SimpleNamespace(member_names=(n,))) for n in names]
    worth = {"start": 0.50, "weak": -0.01, "strong": 0.04, "helper": 0.012, "noise": 0.002}
    monkeypatch.setattr("captioner.models.ensemble.build_ensemble",
                        lambda chosen: SimpleNamespace(member_names=tuple(c.name for c in chosen)))

    def score(model):  # a member's worth adds up; the start alone is 0.50
        return sum(worth[n] for n in model.member_names)

    lines = []
    chosen = select_members(candidates, score, max_members=4, min_gain=0.005, report=lines.append)
    assert [c.name for c in chosen] == ["start", "strong", "helper"]  # noise's +0.002 is below the bar
    assert lines[0] == "start: 0.5000"
    # the stop line gives the gain a user sets --min-gain against, signed as gained: noise adds 0.002, not -0.002
    assert lines[-1] == "stop: the best addition, noise, gains +0.0020 (< 0.005)"
    assert len(lines) == 1 + 4 + 3 + 2 + 1  # every trial of every round is reported
    assert [c.name for c in select_members(candidates, score, max_members=2, min_gain=0.0)] == ["start", "strong"]
    assert [c.name for c in select_members(candidates, score, max_members=1)] == ["start"]  # the start alone
    with pytest.raises(ValueError, match="max_members >= 1"):
        select_members(candidates, score, max_members=0)


def test_an_addition_that_gains_exactly_the_minimum_joins(monkeypatch):
    """The docstring's rule: selection stops when the best addition gains *less than* ``min_gain``; a gain of
    exactly ``min_gain`` (binary fractions here, so the sums are exact) is enough."""
    candidates = [SimpleNamespace(name=n, model=SimpleNamespace(member_names=(n,))) for n in ("start", "even")]
    worth = {"start": 0.5, "even": 0.25}
    monkeypatch.setattr("captioner.models.ensemble.build_ensemble",
                        lambda chosen: SimpleNamespace(member_names=tuple(c.name for c in chosen)))
    chosen = select_members(candidates, lambda model: sum(worth[n] for n in model.member_names), min_gain=0.25)
    assert [c.name for c in chosen] == ["start", "even"]


def test_the_command_selects_members_on_val_and_writes_a_checkpoint_that_says_what_it_holds(tmp_path, scenes):
    out = tmp_path / "ensemble"
    common = ("--dataset", str(scenes), "--cache-dir", str(tmp_path / "cache"), "--limit", "6")
    refused = captioner("ensemble", str(out), str(WEIGHTS / "sat"), str(WEIGHTS / "sat-hard"), "--select-on", "test",
                        *common, check=False)
    assert refused.returncode != 0 and "--select-on val" in refused.stderr and not out.exists()

    none_gains = captioner("ensemble", str(out), str(WEIGHTS / "sat"), str(WEIGHTS / "sat-hard"), "--select-on",
                           "val", "--min-gain", "10", *common, check=False)
    assert none_gains.returncode != 0 and "no ensemble written" in none_gains.stderr and not out.exists()

    done = captioner("ensemble", str(out), str(WEIGHTS / "sat"), str(WEIGHTS / "sat-hard"),
                     str(WEIGHTS / "sparsecap-softmax"), "--select-on", "val", "--min-gain", "-1", "--max-members", "2",
                     "--storage", "float16", *common, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    scored = [line for line in done.stdout.splitlines() if line.rpartition(": ")[2].replace(".", "").isdigit()]
    assert scored[0].startswith("sat: ") and len(scored) == 3  # the start, then one trial per candidate
    ckpt = load_checkpoint(out)
    assert isinstance(ckpt.model, Ensemble) and len(ckpt.model.members) == 2 and ckpt.storage == "float16"
    members_meta = ckpt.meta["ensemble_of"]
    assert members_meta[0]["name"] == "sat" and ckpt.meta["members_chosen_on"]["split"] == "val"
    assert "an ensemble of sat (" in ckpt.meta["trained_on"]
    assert members_meta[0]["checksum"] == load_checkpoint(WEIGHTS / "sat").checksum

    card = write_card(out, {"beam_size": 3, "val": {"images": 6, "CIDEr-D": 1.5}}).read_text()
    assert "## Members" in card and "## Training" not in card and "greedy forward selection on the val split" in card
    for member in members_meta:
        assert f"| `{member['name']}` | `{member['arch']}` |" in card


def test_the_command_refuses_members_that_do_not_fit_in_one_line(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    save_checkpoint(a, tiny_checkpoint("sat").model, VOCAB, TINY_SPEC)
    save_checkpoint(b, tiny_checkpoint("sat", 1).model, Vocabulary([f"v{i}" for i in range(20)]), TINY_SPEC)
    done = captioner("ensemble", str(tmp_path / "out"), str(a), str(b), check=False)
    assert done.returncode != 0 and done.stderr.strip().splitlines()[-1].startswith("error: b has another vocabulary")
    assert not (tmp_path / "out").exists()
    config = (a / "config.json").read_text()
    over_a_member = captioner("ensemble", str(a), str(a), str(tmp_path / ".." / tmp_path.name / "a"), check=False)
    assert over_a_member.returncode != 0 and "is one of the members" in over_a_member.stderr
    assert (a / "config.json").read_text() == config  # the members are untouched
