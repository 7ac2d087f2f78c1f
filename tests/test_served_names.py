"""Which checkpoints the service serves under which names: the real-photo checkpoints of ``weights/flickr8k`` under
their folder names by default, and any folder's checkpoints under a name prefix (``CAPTIONER_PREFIXED_WEIGHTS_DIRS``,
``make serve-scenes``: the generated-scene checkpoints of ``weights/`` as ``scenes-NAME``), without moving a file
(docs/decisions.md, "Flickr8k: where the checkpoints live and which are served")."""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from PIL import Image
from pydantic import ValidationError

from captioner.models.checkpoint import find_checkpoints, save_checkpoint
from captioner.models.export import onnx
from captioner.models.placement import (checkpoints_from_env, default_checkpoint, onnx_dir_from_env,
                                        prefixed_dirs_from_env, weights_dir_from_env)
from captioner.service.app import create_app
from captioner.service.cli import build_parser, main, read_settings
from captioner.service.runtime import load_runtimes
from captioner.service.settings import Settings

from .conftest import ROOT, WEIGHTS
from .serving_helpers import TINY_SPEC, VOCAB, tiny_model

#: the variables that say where the models are, read by the model-side commands and the service alike (written out,
#: not taken from the code's own list, so that a variable the code forgets still fails here)
PLACEMENT_VARIABLES = ("CAPTIONER_WEIGHTS_DIR", "CAPTIONER_ONNX_DIR", "CAPTIONER_PREFIXED_WEIGHTS_DIRS",
                       "CAPTIONER_CHECKPOINTS")

pytestmark = pytest.mark.usefixtures("one_thread")

PHOTOS_DATASET = "data/flickr8k/dataset_flickr8k.json"
SCENES_DATASET = ".cache/scenes/dataset_scenes.json"


def save_tiny(path: Path, dataset: str, seed: int = 0) -> Path:
    return save_checkpoint(path, tiny_model("sat", seed), VOCAB, TINY_SPEC, meta={"dataset": dataset})


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """The repository's layout in small: scene checkpoints in ``weights/``, real-photo ones in ``weights/flickr8k``
    (a folder that is not itself a checkpoint), and a folder that holds no checkpoint."""
    root = tmp_path_factory.mktemp("layout") / "weights"
    for name in ("sat", "aoanet"):
        save_tiny(root / name, SCENES_DATASET)
    save_tiny(root / "flickr8k" / "sat", PHOTOS_DATASET, seed=1)
    (root / "notes").mkdir()
    return root


def test_a_prefixed_folder_serves_its_checkpoints_under_the_prefix(weights):
    found = find_checkpoints(weights / "flickr8k", prefixed={"scenes-": weights})
    assert found == {"sat": weights / "flickr8k" / "sat", "scenes-aoanet": weights / "aoanet",
                     "scenes-sat": weights / "sat"}  # weights/flickr8k and weights/notes are no checkpoints
    # several prefixes, an empty one (plain names), and the order of precedence: weights_dir, prefixed, extra
    both = find_checkpoints(None, prefixed={"a-": weights, "b-": weights / "flickr8k"})
    assert set(both) == {"a-sat", "a-aoanet", "b-sat"}
    assert find_checkpoints(weights / "flickr8k", prefixed={"": weights})["sat"] == weights / "sat"
    photo_sat = weights / "flickr8k" / "sat"
    assert find_checkpoints(weights, [photo_sat], {"": weights})["sat"] == photo_sat
    # a missing or unset prefixed folder adds nothing; without the mapping the names are what they always were
    assert find_checkpoints(weights, prefixed={"x-": weights / "missing"}) == find_checkpoints(weights)
    assert set(find_checkpoints(weights)) == {"sat", "aoanet"}


def test_the_prefix_setting_is_read_from_the_environment_as_json(monkeypatch):
    monkeypatch.setenv("CAPTIONER_PREFIXED_WEIGHTS_DIRS", '{"scenes-": "weights", "mine-": "/data/checkpoints"}')
    assert Settings().prefixed_weights_dirs == {"scenes-": Path("weights"), "mine-": Path("/data/checkpoints")}
    monkeypatch.delenv("CAPTIONER_PREFIXED_WEIGHTS_DIRS")
    assert Settings().prefixed_weights_dirs == {}
    # a model's name is also its ONNX export's folder: a prefix with a path in it is refused
    for prefix in ("../", "a/b-", "x y"):
        with pytest.raises(ValidationError, match="name prefixes"):
            Settings(prefixed_weights_dirs={prefix: "weights"})


def test_a_prefix_may_hold_every_character_the_refusal_names(monkeypatch):
    """A prefix may hold letters, digits, '.', '_' and '-', as the refusal of one with a path in it says: ``v1.2_`` (an
    earlier release's checkpoints served beside today's) is taken by the service and ``captioner export`` alike,
    not refused as if it left the exports' folder."""
    for prefix in ("v1.2_", "Run7-", "a.b_c-D9"):
        monkeypatch.setenv("CAPTIONER_PREFIXED_WEIGHTS_DIRS", json.dumps({prefix: "weights"}))
        assert Settings().prefixed_weights_dirs == prefixed_dirs_from_env() == {prefix: Path("weights")}, prefix


def test_by_default_the_real_photo_checkpoints_take_the_plain_names():
    """The repository as it ships: ``make serve`` serves weights/flickr8k, ``make serve-scenes`` adds weights/ as
    scenes-NAME (names and folders only: nothing is loaded)."""
    fields = Settings.model_fields  # the defaults, whatever CAPTIONER_* variables this shell holds
    weights_dir = fields["weights_dir"].default
    assert weights_dir == Path("weights/flickr8k") and fields["default_model"].default == "sat-supervised"
    assert fields["prefixed_weights_dirs"].get_default(call_default_factory=True) == {}
    served = find_checkpoints(ROOT / weights_dir)
    assert served["sat"] == WEIGHTS / "flickr8k" / "sat" and "sat-supervised" in served  # the default is served
    assert not [name for name in served if name.startswith("scenes-")]

    recipe = re.search(r"^serve-scenes:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    mapping = re.search(r"CAPTIONER_PREFIXED_WEIGHTS_DIRS='([^']+)'", recipe).group(1)
    scenes = Settings(prefixed_weights_dirs=json.loads(mapping)).prefixed_weights_dirs
    assert scenes == {"scenes-": Path("weights")} and "captioner serve" in recipe
    with_scenes = find_checkpoints(ROOT / weights_dir, prefixed={p: ROOT / f for p, f in scenes.items()})
    assert with_scenes["sat"] == WEIGHTS / "flickr8k" / "sat" and with_scenes["scenes-sat"] == WEIGHTS / "sat"
    assert "scenes-flickr8k" not in with_scenes


def test_the_service_lists_and_captions_with_prefixed_models(weights):
    settings = Settings(weights_dir=weights / "flickr8k", prefixed_weights_dirs={"scenes-": weights},
                        default_model="sat", device="cpu", backend="torch", warmup=False, release_memory=False)
    image = io.BytesIO()
    Image.new("RGB", (120, 80), (200, 30, 30)).save(image, format="PNG")
    with TestClient(create_app(settings)) as client:
        models = {m["name"]: m for m in client.get("/models").json()}
        assert set(models) == {"sat", "scenes-sat", "scenes-aoanet"}
        assert models["sat"]["default"] and not models["scenes-sat"]["default"]
        assert models["sat"]["trained_on"].startswith("Flickr8k")
        assert models["scenes-sat"]["trained_on"].startswith("generated scenes")
        answers = {}
        for model in ("scenes-sat", None):
            response = client.post("/caption", params={"model": model} if model else {},
                                   files={"file": ("scene.png", image.getvalue(), "image/png")})
            assert response.status_code == 200, response.text
            answers[model] = response.json()
        assert answers["scenes-sat"]["model"] == "scenes-sat" and answers[None]["model"] == "sat"
        assert client.post("/caption", params={"model": "flickr8k"},
                           files={"file": ("scene.png", image.getvalue(), "image/png")}).status_code == 404


def test_readiness_lists_the_served_models_by_name_not_in_the_order_they_loaded(weights):
    """``/readyz`` names its models sorted; they load in folder order (``weights_dir`` first, then each prefixed
    folder), so a prefix that sorts first shows whether the list was sorted or only loaded in order."""
    settings = Settings(weights_dir=weights / "flickr8k", prefixed_weights_dirs={"a-": weights}, default_model="sat",
                        device="cpu", backend="torch", warmup=False, release_memory=False)
    with TestClient(create_app(settings)) as client:
        loaded = [model["name"] for model in client.get("/models").json()]
        assert loaded != sorted(loaded)  # this layout loads them out of name order
        assert client.get("/readyz").json() == {"status": "ready", "models": ["a-aoanet", "a-sat", "sat"]}


def test_export_reads_the_same_variables_and_refuses_a_malformed_one(monkeypatch):
    """The model-side commands read the service's variables in models/placement.py (models/ never imports
    service/); a value that is not a JSON object of folders, or a prefix with a path in it, is refused with the
    variable named, as ``Settings`` refuses it."""
    monkeypatch.setenv("CAPTIONER_PREFIXED_WEIGHTS_DIRS", '{"scenes-": "weights"}')
    monkeypatch.setenv("CAPTIONER_CHECKPOINTS", '["runs/mine/best"]')
    assert prefixed_dirs_from_env() == Settings().prefixed_weights_dirs == {"scenes-": Path("weights")}
    assert checkpoints_from_env() == Settings().checkpoints == [Path("runs/mine/best")]
    monkeypatch.delenv("CAPTIONER_PREFIXED_WEIGHTS_DIRS")
    monkeypatch.delenv("CAPTIONER_CHECKPOINTS")
    assert prefixed_dirs_from_env() == {} and checkpoints_from_env() == []
    for bad in ("{scenes-: weights}", '["weights"]', '{"scenes-": 3}'):
        monkeypatch.setenv("CAPTIONER_PREFIXED_WEIGHTS_DIRS", bad)
        with pytest.raises(ValueError, match="CAPTIONER_PREFIXED_WEIGHTS_DIRS"):
            prefixed_dirs_from_env()
    for bad in ('{"../x-": "weights"}', '{"a/b-": "weights"}'):
        monkeypatch.setenv("CAPTIONER_PREFIXED_WEIGHTS_DIRS", bad)
        with pytest.raises(ValueError, match="name prefixes"):
            prefixed_dirs_from_env()


def test_export_writes_what_the_service_serves_and_nothing_outside_its_folder(weights, tmp_path, monkeypatch,
                                                                              capsys):
    """``captioner export`` exports the checkpoints the service would serve, ``CAPTIONER_CHECKPOINTS`` included
    (it read the prefixes but not the extra folders); a prefix such as ``../x-`` is refused before anything is
    written (export took it, and would have written ``OUT/../x-sat``)."""
    exported = {}
    monkeypatch.setattr(onnx, "export_checkpoints", lambda found, out, log: exported.update(found) or {})
    extra = tmp_path / "mine"
    save_tiny(extra, PHOTOS_DATASET)
    monkeypatch.setenv("CAPTIONER_CHECKPOINTS", json.dumps([str(extra)]))
    monkeypatch.setenv("CAPTIONER_PREFIXED_WEIGHTS_DIRS", json.dumps({"scenes-": str(weights)}))
    main(["export", "--weights-dir", str(weights / "flickr8k"), "--out", str(tmp_path / "onnx")])
    assert exported == {"sat": weights / "flickr8k" / "sat", "scenes-sat": weights / "sat",
                        "scenes-aoanet": weights / "aoanet", "mine": extra}
    exported.clear()
    monkeypatch.setenv("CAPTIONER_PREFIXED_WEIGHTS_DIRS", json.dumps({"../x-": str(weights)}))
    with pytest.raises(SystemExit) as stopped:
        main(["export", "--weights-dir", str(weights / "flickr8k"), "--out", str(tmp_path / "onnx")])
    assert stopped.value.code == 2 and not exported
    assert "name prefixes" in capsys.readouterr().err and not (tmp_path / "onnx").exists()


def test_a_checkpoint_replaced_by_one_named_the_same_is_reported(weights):
    # it was dropped in silence: `captioner export --all CKPT` exported one of the two and said nothing of the other
    replaced = []
    photo_sat = weights / "flickr8k" / "sat"
    found = find_checkpoints(weights, [photo_sat, weights / "aoanet"],
                             on_replaced=lambda *names: replaced.append(names))
    assert found["sat"] == photo_sat and replaced == [("sat", photo_sat, weights / "sat")]  # aoanet is itself


def test_the_server_names_the_checkpoint_it_does_not_serve_for_one_named_the_same(weights, caplog):
    """The server's log is where an operator learns that one of two checkpoints named the same is not served."""
    photo_sat = weights / "flickr8k" / "sat"
    with caplog.at_level(logging.WARNING, logger="captioner.runtime"):
        runtimes = load_runtimes(weights, [photo_sat], default_backend="torch", only=["sat"])
    assert set(runtimes) == {"sat"}
    assert f"model 'sat' is {photo_sat}; {weights / 'sat'}, named the same, is not served" in caplog.text


def test_extra_folders_that_hold_no_checkpoint_are_named_in_the_log(tmp_path, caplog):
    # CAPTIONER_CHECKPOINTS='["runs/mine"]' (the run, not runs/mine/best) or a typo was dropped without a word,
    # and the model's requests got 404
    run = tmp_path / "mine"
    save_tiny(run / "best", PHOTOS_DATASET)
    with caplog.at_level(logging.ERROR, logger="captioner.runtime"):
        runtimes = load_runtimes(None, [run, tmp_path / "typo", run / "best"], default_backend="torch")
    assert set(runtimes) == {"mine"}
    assert f"skipping checkpoint {run}: {run} is a training run, not a checkpoint: give {run / 'best'}" in caplog.text
    assert f"skipping checkpoint {tmp_path / 'typo'}: {tmp_path / 'typo'} does not exist" in caplog.text


def test_the_model_side_commands_folders_follow_the_variables_and_an_empty_one_counts_as_unset(monkeypatch):
    monkeypatch.setenv("CAPTIONER_WEIGHTS_DIR", "mine/weights")
    monkeypatch.setenv("CAPTIONER_ONNX_DIR", "mine/onnx")
    assert (weights_dir_from_env(), onnx_dir_from_env()) == (Path("mine/weights"), Path("mine/onnx"))
    export = build_parser().parse_args(["export"])
    assert (export.weights_dir, export.out) == ("mine/weights", "mine/onnx")
    assert build_parser().parse_args(["eval", "c"]).onnx_dir == "mine/onnx"
    # a variable set to nothing (``CAPTIONER_ONNX_DIR= captioner export``) is the default, not the working folder
    for name in PLACEMENT_VARIABLES:
        monkeypatch.setenv(name, "")
    assert (weights_dir_from_env(), onnx_dir_from_env()) == (Path("weights/flickr8k"), Path(".cache/onnx"))
    assert prefixed_dirs_from_env() == {} and checkpoints_from_env() == []
    for bad, reason in (('"runs/mine/best"', "must be a JSON list"), ("[3]", "must be a JSON list"),
                        ("[runs/mine]", r"is not JSON \(.+\): '\[runs/mine\]'$")):  # the error, then the value
        monkeypatch.setenv("CAPTIONER_CHECKPOINTS", bad)
        with pytest.raises(ValueError, match=f"^CAPTIONER_CHECKPOINTS {reason}"):
            checkpoints_from_env()


def test_the_service_reads_an_empty_placement_variable_as_the_model_side_does_and_nothing_else_so(monkeypatch):
    """`captioner serve` and `captioner export` agree where the exports are: an empty placement variable is unset to
    both (the service took the working folder for an empty CAPTIONER_ONNX_DIR, and refused an empty
    CAPTIONER_CHECKPOINTS that the export took for none)."""
    for name in PLACEMENT_VARIABLES:
        monkeypatch.setenv(name, "")
    settings = Settings()
    assert (settings.weights_dir, settings.onnx_dir) == (weights_dir_from_env(), onnx_dir_from_env()) == (
        Path("weights/flickr8k"), Path(".cache/onnx"))
    assert settings.prefixed_weights_dirs == prefixed_dirs_from_env() == {}
    assert settings.checkpoints == checkpoints_from_env() == []
    monkeypatch.setenv("CAPTIONER_ONNX_DIR", "mine/onnx")  # a value is read as before
    assert Settings().onnx_dir == onnx_dir_from_env() == Path("mine/onnx")
    # another setting left empty is still refused: an empty CAPTIONER_API_KEYS never serves without keys
    monkeypatch.setenv("CAPTIONER_API_KEYS", "")
    with pytest.raises(SystemExit, match="api_keys|API_KEYS"):
        read_settings()


def test_the_default_checkpoint_is_the_working_folders_or_else_this_checkouts(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    assert default_checkpoint() == Path("weights/flickr8k/sat-supervised")
    monkeypatch.chdir(tmp_path)  # a folder without weights/: the checkout's own, wherever the command runs
    assert default_checkpoint() == WEIGHTS / "flickr8k" / "sat-supervised" and default_checkpoint().is_dir()


def test_a_json_object_is_not_a_list_of_checkpoint_folders_to_the_model_side_commands_either(monkeypatch):
    """``CAPTIONER_CHECKPOINTS`` holds a list: the service refuses an object, so ``captioner export`` must too, rather
    than export its keys as folders the service would never serve."""
    monkeypatch.setenv("CAPTIONER_CHECKPOINTS", '{"runs/mine/best": "mine"}')
    with pytest.raises(ValidationError):
        Settings()
    with pytest.raises(ValueError, match="^CAPTIONER_CHECKPOINTS must be a JSON list"):
        checkpoints_from_env()
