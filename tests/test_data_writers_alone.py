"""One writer per data set folder: ``captioner data generate`` writes its images in place, so a second run into the
same ``--out`` at once (another seed, say) mixed its images into the first's, whose ``dataset_scenes.json`` then
described pictures it never drew.  While another process writes the folder, a second writer (``data generate`` or
``data ood``) is refused in one line before it writes anything; once the first has ended, the folder is free."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from captioner.service.cli import main

from .conftest import cli_error

#: holds the folder as a writer does (files.held_alone) until its stdin closes
HOLDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from captioner.models.files import FolderInUse, held_alone
    with held_alone(Path(sys.argv[1]), FolderInUse("busy")):
        print("held", flush=True)
        sys.stdin.read()
""")

COMMANDS = {"generate": ["data", "generate", "--train", "2", "--val", "1", "--test", "1", "--heldout", "1",
                         "--workers", "1"],
            "ood": ["data", "ood", "--images", "2"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_second_writer_of_a_data_set_folder_is_refused_until_the_first_ends(command, tmp_path, capsys):
    argv = [*COMMANDS[command], "--out", str(tmp_path)]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        message = cli_error(capsys, *argv)
        assert message == (f"error: {tmp_path} is being written by another `captioner data {command}`: wait for it "
                           "to end, or give --out another folder; nothing was written")
        assert list(tmp_path.iterdir()) == []
    finally:
        holder.communicate("", timeout=30)
    main(argv)
    assert (tmp_path / "dataset_scenes.json").is_file()
