"""``create(name, **config)``, the registry's one way to build a model: what a mistaken call is told."""

import pytest

from captioner.models.zoo import UnknownModel, available, create


def test_every_registered_model_is_built_from_its_sizes():
    for name in available():
        if name != "ensemble":  # built from its members' checkpoints (build_ensemble)
            assert create(name, vocab_size=12, feat_dim=8).arch == name


@pytest.mark.parametrize("name, config, message", [
    ("nosuch", {}, "unknown model 'nosuch'; registered: "),
    ("sat", {"vocab_size": 12, "feat_dim": 8, "bogus": 1}, "model 'sat' has no option 'bogus'; its options: "),
    # a bare TypeError ("missing 2 required positional arguments") named neither the model nor the fix
    ("sat", {}, "model 'sat' needs 'vocab_size', 'feat_dim'"),
    ("aoanet", {"vocab_size": 12}, "model 'aoanet' needs 'feat_dim'"),
])
def test_a_mistaken_call_is_a_value_error_that_names_what_to_give(name, config, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        create(name, **config)
    assert issubclass(UnknownModel, ValueError)
