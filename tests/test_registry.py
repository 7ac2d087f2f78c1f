"""``create(name, **config)``, the registry's one way to build a model: what a mistaken call is told, what a model's
options are (``captioner models NAME``), and models that another installed package adds by its entry points."""

import inspect
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import pytest

from captioner.models import zoo
from captioner.models.registry import MODELS, model_class, register
from captioner.models.sat import ShowAttendTell
from captioner.models.zoo import REQUIRED, UnknownModel, available, create, options


def test_every_registered_model_is_built_from_its_sizes():
    for name in available():
        if name != "ensemble":  # built from its members' checkpoints (build_ensemble)
            assert create(name, vocab_size=12, feat_dim=8).arch == name


def test_importing_the_zoo_alone_registers_every_model_file_of_the_project():
    """In a fresh process, as a command or the ONNX export child starts: every ``@register`` of the project's own
    model files is known once ``captioner.models.zoo`` is imported (here every test module has imported the model
    files itself, so a file the zoo forgot to import would still be registered in this process)."""
    folder = Path(zoo.__file__).parent
    declared = {name for path in folder.glob("*.py")
                for name in re.findall(r'^@register\("([^"]+)"\)', path.read_text(), flags=re.MULTILINE)}
    listed = subprocess.run([sys.executable, "-c", "from captioner.models.zoo import available; "
                             "print(' '.join(available()))"], capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert len(declared) >= 8 and set(listed.stdout.split()) == declared


@pytest.mark.parametrize("name, config, message", [
    ("nosuch", {}, "unknown model 'nosuch'; registered: "),
    ("sat", {"vocab_size": 12, "feat_dim": 8, "bogus": 1}, "model 'sat' has no option 'bogus'; its options: "),
    # a bare TypeError ("missing 2 required positional arguments") named neither the model nor the fix
    ("sat", {}, "model 'sat' needs 'vocab_size', 'feat_dim'"),
    ("aoanet", {"vocab_size": 12}, "model 'aoanet' needs 'feat_dim'"),
    # a value of another kind than the option's default failed deep in PyTorch ("empty(): argument 'size' ...")
    ("sat", {"vocab_size": 12, "feat_dim": 8, "embed_dim": "abc"},
     "model 'sat': option 'embed_dim' takes a whole number \\(default 512\\), got 'abc'"),
    ("sat", {"vocab_size": 12, "feat_dim": 8, "embed_dim": 32.5}, "model 'sat': option 'embed_dim' takes a whole"),
    ("sat", {"vocab_size": 12, "feat_dim": 8, "dropout": True}, "model 'sat': option 'dropout' takes a number"),
    # true is an int to isinstance: it failed in PyTorch ("empty(): argument 'size' ..."), naming no option
    ("sat", {"vocab_size": 12, "feat_dim": 8, "hidden_dim": True}, "model 'sat': option 'hidden_dim' takes a whole"),
    ("aoanet", {"vocab_size": 12, "feat_dim": 8, "pre_norm": 1}, "model 'aoanet': option 'pre_norm' takes true or"),
    # the whole message: the kind is named as the reader would say it, then the default ("a stringX" passed before)
    ("sat", {"vocab_size": 12, "feat_dim": 8, "gate": 3},
     "model 'sat': option 'gate' takes a string \\(default 'scalar'\\), got 3$"),
    # a size given as text (a config read from strings): the message names no default, a required size has none
    ("sat", {"vocab_size": "12", "feat_dim": 8}, "model 'sat': option 'vocab_size' takes a whole number, got '12'$"),
    # a sequence option given one name: "string indices must be integers" from inside the ensemble
    ("ensemble", {"vocab_size": 12, "feat_dim": 8, "members": "sat"},
     "model 'ensemble': option 'members' takes a list"),
])
def test_a_mistaken_call_is_a_value_error_that_names_what_to_give(name, config, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        create(name, **config)
    assert issubclass(UnknownModel, ValueError)


def test_the_registered_names_are_listed_sorted_whatever_order_they_were_registered_in(monkeypatch):
    monkeypatch.setitem(MODELS, "aaa-registered-last", ShowAttendTell)
    assert available()[0] == "aaa-registered-last" and available() == sorted(MODELS)


def test_an_unknown_name_is_told_every_registered_one():
    with pytest.raises(UnknownModel) as unknown:
        model_class("nosuch")
    assert f"registered: {', '.join(available())} (" in str(unknown.value) and "aoanet, " in str(unknown.value)


def test_a_name_is_registered_once():
    """A second model under a taken name (a plugin's, or a copied file's) is refused naming the first: replacing it
    would change what every checkpoint of that name loads as."""
    with pytest.raises(ValueError, match="^model 'sat' is already registered by ShowAttendTell$"):
        register("sat")(type("Copied", (ShowAttendTell,), {}))
    assert model_class("sat") is ShowAttendTell


class MaybeWide(ShowAttendTell):
    """A plugin's model with an option that may be null: no built-in model annotates a union."""

    def __init__(self, vocab_size: int, feat_dim: int, width: int | None = None, **ids: int):
        super().__init__(vocab_size, feat_dim, embed_dim=8, hidden_dim=8, attn_dim=8, **ids)


def test_an_option_that_may_be_null_takes_null_or_its_kind_and_names_both(monkeypatch):
    monkeypatch.setitem(MODELS, "maybe-wide", MaybeWide)
    for width in (None, 3):
        assert isinstance(create("maybe-wide", vocab_size=12, feat_dim=8, width=width), MaybeWide)
    with pytest.raises(ValueError, match="^model 'maybe-wide': option 'width' takes a whole number or null "
                                         "\\(default None\\), got 'abc'$"):
        create("maybe-wide", vocab_size=12, feat_dim=8, width="abc")


class OptionalWide(ShowAttendTell):
    """A plugin's model annotated in the older spelling, ``Optional[int]`` (``typing.Union``, not ``int | None``)."""

    def __init__(self, vocab_size: int, feat_dim: int, width: Optional[int] = None, **ids: int):
        super().__init__(vocab_size, feat_dim, embed_dim=8, hidden_dim=8, attn_dim=8, **ids)


def test_an_option_annotated_optional_is_checked_as_the_union_it_is(monkeypatch):
    """``Optional[int]`` is as common in plugins as ``int | None`` and resolves to another kind of union: a string
    for it must be refused naming the option, not passed on to fail deep in PyTorch."""
    monkeypatch.setitem(MODELS, "optional-wide", OptionalWide)
    for width in (None, 3):
        assert isinstance(create("optional-wide", vocab_size=12, feat_dim=8, width=width), OptionalWide)
    with pytest.raises(ValueError, match="^model 'optional-wide': option 'width' takes a whole number or null"):
        create("optional-wide", vocab_size=12, feat_dim=8, width="abc")


class KeywordWide(ShowAttendTell):
    """A plugin's model whose option is keyword-only (after ``*``): no built-in model has one."""

    def __init__(self, vocab_size: int, feat_dim: int, *, width: int = 3, **ids: int):
        super().__init__(vocab_size, feat_dim, embed_dim=8, hidden_dim=8, attn_dim=8, **ids)
        self.width = width


def test_a_keyword_only_option_is_an_option_listed_checked_and_taken(monkeypatch):
    monkeypatch.setitem(MODELS, "keyword-wide", KeywordWide)
    assert options("keyword-wide")["width"] == 3
    assert create("keyword-wide", vocab_size=12, feat_dim=8, width=5).width == 5
    with pytest.raises(ValueError, match="^model 'keyword-wide': option 'width' takes a whole number"):
        create("keyword-wide", vocab_size=12, feat_dim=8, width="abc")


class Layered(ShowAttendTell):
    """A plugin's model with a sequence option whose default is a tuple: no built-in model has one."""

    def __init__(self, vocab_size: int, feat_dim: int, widths: Sequence[int] = (8, 8), **ids: int):
        super().__init__(vocab_size, feat_dim, embed_dim=8, hidden_dim=8, attn_dim=8, **ids)
        self.widths = widths


def test_a_sequence_option_takes_a_list_or_a_tuple_and_refuses_one_string(monkeypatch):
    """JSON brings a list, a library caller may pass a tuple (the default ``options`` reports is one): both are the
    sequence the annotation names; a lone string, a sequence to Python, is refused as not a list."""
    monkeypatch.setitem(MODELS, "layered", Layered)
    for widths in ([4, 4], (4, 4), options("layered")["widths"]):
        assert list(create("layered", vocab_size=12, feat_dim=8, widths=widths).widths) == list(widths)
    with pytest.raises(ValueError, match="^model 'layered': option 'widths' takes a list"):
        create("layered", vocab_size=12, feat_dim=8, widths="44")


def test_a_plugin_whose_annotations_cannot_be_resolved_is_built_with_its_options_unchecked(monkeypatch):
    """A plugin may annotate with a name its module imports only for type checkers: its annotations cannot be
    resolved at run time, so nothing is checked, but the model is built (a None in place of no annotations was
    an AttributeError from ``create``)."""
    class Width:  # not a name of the module's globals, where the annotation is looked up
        pass

    class Unresolved(ShowAttendTell):
        def __init__(self, vocab_size: int, feat_dim: int, width: "Width | None" = None, **ids: int):
            super().__init__(vocab_size, feat_dim, embed_dim=8, hidden_dim=8, attn_dim=8, **ids)
            self.width = width

    monkeypatch.setitem(MODELS, "unresolved", Unresolved)
    assert create("unresolved", vocab_size=12, feat_dim=8, width="wide").width == "wide"


def test_values_of_the_options_kind_are_taken_and_an_int_is_a_number():
    model = create("sat", vocab_size=12, feat_dim=8, embed_dim=16, hidden_dim=16, attn_dim=8, dropout=0,
                   gate="channel")
    assert model.config()["dropout"] == 0 and model.config()["embed_dim"] == 16


def test_a_models_options_are_its_constructors_with_their_defaults():
    sat = options("sat")
    assert sat["vocab_size"] is REQUIRED and sat["feat_dim"] is REQUIRED
    assert sat["embed_dim"] == 512 and sat["dropout"] == 0.5 and sat["bos_id"] == 1
    with pytest.raises(UnknownModel, match="entry-point group captioner.models"):
        options("nosuch")
    shown = subprocess.run([sys.executable, "-m", "captioner.service.cli", "models", "xlan"], capture_output=True,
                           text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "dim=1024" in lines or any(line.startswith("dim=") for line in lines)
    assert 'activation="celu"' in lines and lines[-1].startswith("# from the data set and the encoder, not --set:")
    assert not [line for line in lines if line.startswith(("vocab_size", "bos_id"))]


def test_a_models_options_list_its_own_parameters_first_then_the_protocols_special_ids():
    """The order ``captioner models NAME`` prints them in: the constructor's own, then the special token ids the
    model passes on to ``Captioner.__init__``."""
    names = list(options("sat"))
    own = [name for name in inspect.signature(ShowAttendTell).parameters if name != "ids"]
    assert names[:len(own)] == own and names[len(own):] == ["pad_id", "bos_id", "eos_id"]


class OwnEnd(ShowAttendTell):
    """A plugin's model that names a special token id itself, with a default of its own (its vocabulary ends
    captions with id 3)."""

    def __init__(self, vocab_size: int, feat_dim: int, eos_id: int = 3, **ids: int):
        super().__init__(vocab_size, feat_dim, embed_dim=8, hidden_dim=8, attn_dim=8, eos_id=eos_id, **ids)


def test_a_special_id_the_model_names_itself_keeps_its_own_default(monkeypatch):
    """The protocol's defaults fill in only the ids a model passes on through ``**ids``: a model's own default is
    what ``captioner models NAME`` shows and what a mistaken value is told, not ``Captioner.__init__``'s."""
    monkeypatch.setitem(MODELS, "own-end", OwnEnd)
    assert options("own-end")["eos_id"] == 3 and options("own-end")["bos_id"] == 1
    with pytest.raises(ValueError, match="^model 'own-end': option 'eos_id' takes a whole number \\(default 3\\)"):
        create("own-end", vocab_size=12, feat_dim=8, eos_id="end")


class Unresolvable(ShowAttendTell):
    """A plugin's model whose annotation names something that is not a type: resolving it is a TypeError."""

    def __init__(self, vocab_size: int, feat_dim: int, width: "print | None" = None, **ids: int):
        super().__init__(vocab_size, feat_dim, embed_dim=8, hidden_dim=8, attn_dim=8, **ids)
        self.width = width


def test_annotations_that_fail_to_resolve_for_any_reason_leave_the_options_unchecked(monkeypatch):
    monkeypatch.setitem(MODELS, "unresolvable", Unresolvable)
    assert create("unresolvable", vocab_size=12, feat_dim=8, width="wide").width == "wide"


PLUGIN = textwrap.dedent("""
    from captioner.models.registry import register
    from captioner.models.sat import ShowAttendTell


    @register("plugged-sat")
    class PluggedSAT(ShowAttendTell):
        \"\"\"A model another package adds: the SAT under another name is enough to be found.\"\"\"
""")


def installed_plugin(folder, module: str, source: str, entry: str = "plugged") -> dict:
    """An installed distribution (a dist-info folder on the path) naming ``module`` under captioner.models."""
    (folder / f"{module}.py").write_text(source)
    info = folder / f"{module}_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[captioner.models]\n{entry} = {module}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}


def test_a_model_another_package_names_under_the_entry_point_group_is_registered(tmp_path):
    env = installed_plugin(tmp_path, "plugged_models", PLUGIN)
    listed = subprocess.run([sys.executable, "-m", "captioner.service.cli", "models"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert listed.returncode == 0, listed.stderr
    assert "plugged-sat" in listed.stdout.split() and "sat" in listed.stdout.split()
    built = subprocess.run([sys.executable, "-c", "from captioner.models.zoo import create; "
                            "print(create('plugged-sat', vocab_size=9, feat_dim=8).arch)"],
                           capture_output=True, text=True, timeout=120, env=env)
    assert built.stdout.strip() == "plugged-sat", built.stderr


def test_a_broken_plugin_is_named_in_a_warning_and_the_built_in_models_stay(tmp_path):
    env = installed_plugin(tmp_path, "broken_models", "raise ImportError('needs a package that is missing')",
                           entry="broken")
    listed = subprocess.run([sys.executable, "-W", "always", "-m", "captioner.service.cli", "models"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert listed.returncode == 0, listed.stderr
    assert "sat" in listed.stdout.split()
    assert "model plugin 'broken' (broken_models, entry-point group captioner.models) failed to load: " \
           "ImportError: needs a package that is missing" in listed.stderr


class BrokenEntry:
    """An entry point whose module raises what a third-party import may raise, not only ImportError."""
    name, value = "broken", "broken_models"

    def load(self):
        raise RuntimeError("a GPU library that would not start")


def test_a_plugin_failing_with_any_exception_is_returned_and_warned_about(monkeypatch):
    monkeypatch.setattr(zoo.importlib.metadata, "entry_points", lambda group: [BrokenEntry()])
    with pytest.warns(RuntimeWarning, match="model plugin 'broken' .* RuntimeError: a GPU library"):
        assert zoo.load_plugins() == {"broken": "RuntimeError: a GPU library that would not start"}


class LoadedEntry:
    """An entry point whose module loads, recording that it was asked to."""
    name, value = "working", "working_models"

    def __init__(self):
        self.loaded = []

    def load(self):
        self.loaded.append(self.name)


def test_a_broken_plugin_does_not_keep_the_plugins_after_it_from_loading(monkeypatch):
    """Every plugin is loaded whatever one before it raised: a broken package must not take another package's
    models away (their checkpoints would be unknown models)."""
    working = LoadedEntry()
    monkeypatch.setattr(zoo.importlib.metadata, "entry_points", lambda group: [BrokenEntry(), working])
    with pytest.warns(RuntimeWarning, match="model plugin 'broken'"):
        assert zoo.load_plugins() == {"broken": "RuntimeError: a GPU library that would not start"}
    assert working.loaded == ["working"]
