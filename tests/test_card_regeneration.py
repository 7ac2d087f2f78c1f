"""A shipped scene checkpoint's ``MODEL_CARD.md`` is what ``make train-NAME`` writes: the Makefile's own ``captioner
card`` command, run on the committed checkpoint with its committed reports (``docs/results/NAME.json`` and
``NAME.ood.json``) and notes (``docs/cards/scenes/NAME.md``), in a folder holding the data set it was trained on as
the Makefile's target writes it, gives the committed card byte for byte. A card edited by hand, a note the Makefile
does not pass, or a card line the generator no longer writes fails here.

The data sets are made by the Makefile's own ``captioner data generate`` command with the images left undrawn
(13,500 per set): a card reads only what the set's ``dataset_scenes.json`` records about how it was generated.

The Flickr8k cards are not checked this way: their ``val`` rows come from ``runs/STAGE/eval.val.json``, which is not
committed (``make ship-f8k-NAME``)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from captioner.models.checkpoint import CARD
from captioner.models.data import scenes
from captioner.service.cli import main

ROOT = Path(__file__).resolve().parents[1]
SCENE_CHECKPOINTS = sorted(card.parent.name for card in (ROOT / "weights").glob(f"*/{CARD}"))

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make to read the Makefile's commands")


def make_commands(target: str) -> list[str]:
    """The commands ``make TARGET`` would run (``make -n``: nothing runs, the virtual environment is taken as made),
    one string each, continuation lines joined."""
    printed = subprocess.run(["make", "-s", "-n", "-o", ".venv/.installed", "-o", ".venv/.installed-runtime", target],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return printed.replace("\\\n", " ").splitlines()


def captioner_arguments(target: str, subcommand: str) -> list[str]:
    """The arguments after ``captioner`` of the one ``captioner SUBCOMMAND`` line that ``make TARGET`` runs."""
    (line,) = [line for line in make_commands(target) if f"/captioner {subcommand}" in line]
    return shlex.split(line)[1:]


def test_the_make_targets_a_card_names_write_the_scenes_it_describes():
    for arguments, target in scenes.MAKE_TARGETS.items():
        command = captioner_arguments(target.removeprefix("make "), "data generate")
        out = command.index("--out")
        del command[out:out + 2]
        command.remove("--if-stale")
        assert command == ["data", "generate", *arguments.split()], f"`{target}` runs `captioner {' '.join(command)}`"


def undrawn_image(job: tuple) -> dict:
    index, split = job[:2]
    return {"imgid": index, "split": split}


@pytest.fixture(scope="module")
def trained_on(tmp_path_factory) -> Path:
    """A working folder holding ``.cache/scenes-varied`` and ``.cache/scenes-varied-small`` as ``make data-varied``
    and ``make data-varied-small`` write them (the images undrawn), where the checkpoints' recorded paths lead."""
    folder = tmp_path_factory.mktemp("workdir")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setattr(scenes, "_make_image", undrawn_image)
        for target in ("data-varied", "data-varied-small"):
            main([*captioner_arguments(target, "data generate"), "--workers", "1"])
    return folder


@pytest.mark.parametrize("name", SCENE_CHECKPOINTS)
def test_a_scene_card_is_what_its_make_target_writes(name, trained_on, tmp_path, monkeypatch, capsys):
    checkpoint = shutil.copytree(ROOT / "weights" / name, tmp_path / name)  # its card too: the manifest lists it
    # the run's files, as `make train-NAME` has them, are the committed ones: the checkpoint and its reports
    shipped = {f"runs/{name}/final": str(checkpoint), f"runs/{name}/eval.json": str(ROOT / f"docs/results/{name}.json"),
               f"runs/{name}/eval.ood.json": str(ROOT / f"docs/results/{name}.ood.json")}
    command = captioner_arguments(f"train-{name}", "card")
    assert command[0] == "card" and f"docs/cards/scenes/{name}.md" in command, "the card's notes are not passed"
    command = [shipped.get(arg, str(ROOT / arg) if (ROOT / arg).is_file() else arg) for arg in command]
    monkeypatch.chdir(trained_on)
    main(command)
    printed = capsys.readouterr()
    assert f"wrote {checkpoint / CARD}" in printed.out and "is not here" not in printed.err
    assert (checkpoint / CARD).read_text() == (ROOT / "weights" / name / CARD).read_text()
    assert (checkpoint / "manifest.json").read_text() == (ROOT / "weights" / name / "manifest.json").read_text()
