"""``captioner caption DIR|LIST --output FILE.jsonl``: an archive captioned by the service's batcher, resumed after a
real ``kill -9``, with unreadable files reported and skipped and ``--shard`` partitioning the input."""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from skimage import data

from captioner.models.checkpoint import save_checkpoint
from captioner.models.pipeline import Pipeline
from captioner.service import archive
from captioner.service.archive import ArchiveError, ArchiveOptions, ArchiveSummary, CaptionLines, caption_archive, \
    in_flight, list_images, load_runtime, select_shard, shard_of
from captioner.service.cli import main
from captioner.service.settings import Settings

from .conftest import DEFAULT_CHECKPOINT, ROOT
from .leaks import nothing_left_open
from .serving_helpers import TINY_SPEC, VOCAB, random_images, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "cat", "hubble_deep_field")


def photo_archive(folder: Path, count: int) -> list[str]:
    """``count`` JPEGs cut from scikit-image's bundled photos, spread over nested folders, plus a file the folder
    walk must ignore; their paths as the archive lists them."""
    photos = [getattr(data, name)() for name in PHOTOS]
    paths = []
    for i in range(count):
        pixels = photos[i % len(photos)]
        h, w = pixels.shape[:2]
        top, left = (i * 37) % (h // 3), (i * 53) % (w // 3)
        path = folder / f"part{i % 3}" / ("deeper" if i % 5 == 0 else "") / f"photo{i:03d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels[top:top + h // 2 + i, left:left + w // 2 + i]).save(path, quality=90)
        paths.append(str(path))
    (folder / "part0" / "notes.txt").write_text("not an image")
    return sorted(paths)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_env(**settings: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CAPTIONER_BACKEND": "torch", "CAPTIONER_WARMUP": "false"}
    return {**env, **{f"CAPTIONER_{k.upper()}": v for k, v in settings.items()}}


def test_an_archive_killed_mid_way_is_resumed_with_every_image_exactly_once(tmp_path):
    images = photo_archive(tmp_path / "archive", 30)
    (tmp_path / "archive" / "part1" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG")
    out = tmp_path / "captions.jsonl"
    command = [sys.executable, "-m", "captioner.service.cli", "caption", str(tmp_path / "archive"), "--output",
               str(out), "--checkpoint", str(DEFAULT_CHECKPOINT), "--threads", "1", "--readers", "1"]
    # one image at a time, so that the kill surely lands with most of the archive still to do
    slow = subprocess.Popen(command, cwd=ROOT, env=run_env(max_rows="3", max_beam_size="3", max_batch_images="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (out.exists() and out.read_bytes().count(b"\n") >= 4):
        assert slow.poll() is None, slow.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "no captions after 300 s"
        time.sleep(0.02)
    slow.send_signal(signal.SIGKILL)
    slow.wait(timeout=30)
    slow.stderr.close()
    before = out.read_bytes()
    written = [json.loads(line) for line in before.splitlines()]
    assert 4 <= len(written) < len(images), "the kill must land mid-way"
    # a crash in the middle of a write (power loss, full disk) leaves a torn line: simulate one for an image
    # that is not yet in the file
    missing = sorted(set(images) - {r["path"] for r in written})
    with open(out, "ab") as file:
        file.write(json.dumps({"path": missing[0], "caption": "a torn"}).encode()[:-9])

    done = subprocess.run(command + ["--resume"], cwd=ROOT, env=run_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    after = out.read_bytes()
    assert after.startswith(before), "resuming must keep every line written before the kill, unchanged"
    records = read_lines(out)
    paths = [r["path"] for r in records]
    assert sorted(paths) == images  # every image exactly once: none lost, none twice, the broken one absent
    assert all(r["caption"] and r["tokens"] and r["model"] == "sat" for r in records)
    assert "dropped a torn last line" in done.stderr
    assert f"{len(images)} of {len(images) + 1} images captioned" in done.stderr
    broken = str(tmp_path / "archive" / "part1" / "broken.jpg")
    assert f"skipped {broken}: cannot identify a JPEG, PNG, WebP, GIF, BMP or TIFF image in the file" in done.stderr
    assert read_lines(tmp_path / "captions.errors.jsonl") == [{"path": broken, "error": read_lines(
        tmp_path / "captions.errors.jsonl")[0]["error"]}]


@pytest.fixture(scope="module")
def tiny_checkpoint_folder(tmp_path_factory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", tiny_model("sat"), VOCAB, TINY_SPEC)


@pytest.fixture
def small_archive(tmp_path) -> list[str]:
    paths = []
    for i, image in enumerate(random_images(12, seed=3)):
        path = tmp_path / "archive" / ("a" if i % 2 else "b") / f"img{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path)
        paths.append(str(path))
    return sorted(paths)


def settings(**overrides) -> Settings:
    return Settings(**{"backend": "torch", "warmup": False, "threads": 1, **overrides})


def test_unreadable_files_are_reported_skipped_and_tried_again_on_resume(tmp_path, tiny_checkpoint_folder,
                                                                         small_archive, capsys):
    truncated = tmp_path / "archive" / "a" / "truncated.png"
    truncated.write_bytes(Path(small_archive[0]).read_bytes()[:200])
    (tmp_path / "archive" / "b" / "empty.jpg").write_bytes(b"")
    listing = tmp_path / "list.txt"
    listing.write_text("# the archive, and a file that is gone\n" + "\n".join([*small_archive, str(truncated)])
                       + f"\n\n{tmp_path / 'gone.jpg'}\n")
    out = tmp_path / "out.jsonl"
    main(["caption", str(listing), "--output", str(out), "--checkpoint", str(tiny_checkpoint_folder), "--threads", "1",
          "--max-len", "4"])
    errors = {r["path"]: r["error"] for r in read_lines(tmp_path / "out.errors.jsonl")}
    assert set(errors) == {str(truncated), str(tmp_path / "gone.jpg")}
    assert "truncated or corrupt" in errors[str(truncated)]
    # the OS's reason, once: the record and the line name the file already
    assert errors[str(tmp_path / "gone.jpg")] == "cannot read it (No such file or directory)"
    assert sorted(r["path"] for r in read_lines(out)) == small_archive
    stderr = capsys.readouterr().err
    assert f"skipped {truncated}: " in stderr and "2 unreadable" in stderr
    # fixed since: --resume tries it again, and captions only it
    Image.open(small_archive[0]).save(truncated)
    main(["caption", str(listing), "--output", str(out), "--checkpoint", str(tiny_checkpoint_folder), "--threads", "1",
          "--max-len", "4", "--resume"])
    assert sorted(r["path"] for r in read_lines(out)) == sorted([*small_archive, str(truncated)])
    assert list(read_lines(tmp_path / "out.errors.jsonl")) == [{"path": str(tmp_path / "gone.jpg"),
                                                              "error": errors[str(tmp_path / "gone.jpg")]}]


def test_an_unreadable_file_is_in_the_errors_list_as_soon_as_it_is_reported(tmp_path, tiny_checkpoint_folder,
                                                                             small_archive, monkeypatch):
    """The list of errors is flushed line by line, like the captions: a run killed later (or a user watching a long
    one) still finds there every file stderr named, not only once the run has ended."""
    seen = []
    close = CaptionLines.close

    def recorded(self):  # the output is closed before the list of errors
        seen.append(read_lines(tmp_path / "out.errors.jsonl"))
        close(self)

    monkeypatch.setattr(CaptionLines, "close", recorded)
    caption_archive([small_archive[0], str(tmp_path / "gone.jpg")], tmp_path / "out.jsonl", tiny_checkpoint_folder,
                    settings(), ArchiveOptions(max_len=4), progress=False)
    assert [[r["path"] for r in errors] for errors in seen] == [[str(tmp_path / "gone.jpg")]]


def test_a_list_naming_a_fifo_a_device_or_a_huge_file_skips_them(tmp_path, tiny_checkpoint_folder, small_archive,
                                                                   monkeypatch):
    """A FIFO in a list blocked its reader for ever (and Ctrl-C with it), and /dev/zero was read until memory ran
    out: only regular files within the service's upload limit are read."""
    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    limit = Path(small_archive[0]).stat().st_size  # a file of exactly the limit is read, as the service's body is
    huge = tmp_path / "huge.jpg"
    huge.write_bytes(b"\xff" * (limit + 1))
    monkeypatch.setenv("CAPTIONER_MAX_UPLOAD_BYTES", str(limit))
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join([small_archive[0], str(fifo), "/dev/zero", str(huge)]) + "\n")
    out = tmp_path / "out.jsonl"
    main(["caption", str(listing), "--output", str(out), "--checkpoint", str(tiny_checkpoint_folder), "--threads", "1",
          "--max-len", "4"])
    errors = {r["path"]: r["error"] for r in read_lines(tmp_path / "out.errors.jsonl")}
    too_large = f"the file is larger than the upload limit of {limit} bytes (CAPTIONER_MAX_UPLOAD_BYTES)"
    assert errors == {str(fifo): "not a regular file", "/dev/zero": "not a regular file", str(huge): too_large}
    assert [r["path"] for r in read_lines(out)] == [small_archive[0]]


@pytest.fixture(autouse=True)
def torch_backend(monkeypatch):
    """In-process runs read the service's CAPTIONER_* settings like the subprocesses: PyTorch, no warm-up."""
    monkeypatch.setenv("CAPTIONER_BACKEND", "torch")
    monkeypatch.setenv("CAPTIONER_WARMUP", "false")


def test_shards_partition_the_input_deterministically(tmp_path, tiny_checkpoint_folder, small_archive):
    names = [f"photos/{i:05d}.jpg" for i in range(1000)]
    for count in (1, 2, 3, 7):
        shards = [select_shard(names, i, count) for i in range(count)]
        assert sorted(p for shard in shards for p in shard) == names  # each path in exactly one shard
        assert shards == [select_shard(list(reversed(names)), i, count)[::-1] for i in range(count)]  # order-free
        assert all(abs(len(s) - 1000 / count) < 5 * (1000 / count) ** 0.5 for s in shards)  # and about even
    # a file added to the archive moves no other file to another shard (an index-based split would)
    grown = sorted([*names, "photos/00000a.jpg"])
    assert all(p in select_shard(grown, shard_of(p, 3), 3) for p in names)
    # the rule README states (a user's own script, or another version resuming a shard, picks the same files): the
    # SHA-256 of the path as listed, UTF-8, its first 8 bytes read as a big-endian number, modulo the count
    for path in [*names, "fotos/café/Ünïcode.jpg"]:
        digest = hashlib.sha256(path.encode("utf-8")).digest()
        assert shard_of(path, 1000) == int.from_bytes(digest[:8], "big") % 1000
    outputs = []
    for index in range(3):
        run = caption_archive([str(tmp_path / "archive")], tmp_path / f"shard{index}.jsonl", tiny_checkpoint_folder,
                              settings(), ArchiveOptions(max_len=4), shard=(index, 3), progress=False)
        lines = read_lines(tmp_path / f"shard{index}.jsonl")
        outputs.append([r["path"] for r in lines])
        # a line without --attention still says how its caption was decoded
        assert all({"beam_size", "length_penalty", "block_trigrams", "block_doubled_words"} <= set(r)
                   and "attention" not in r for r in lines)
        assert run.total == len(outputs[-1]) == run.summary.captioned
    assert sorted(p for shard in outputs for p in shard) == small_archive
    # each run captioned its own share: the paths' hashes decide it (with 12 files a share may be empty: the
    # temporary folder's name is in every path, so which one changes from run to run)
    assert [sorted(shard) for shard in outputs] == [select_shard(small_archive, i, 3) for i in range(3)]


def test_archive_captions_equal_the_single_image_command_and_carry_attention_on_request(
        tmp_path, tiny_checkpoint_folder, small_archive):
    out = tmp_path / "out.jsonl"
    caption_archive([small_archive[0], str(tmp_path / "archive" / "b")], out, tiny_checkpoint_folder,
                    settings(max_batch_images=4), ArchiveOptions(beam_size=2, max_len=6, attention=True,
                                                                 heatmaps=tmp_path / "figures"), progress=False)
    records = {r["path"]: r for r in read_lines(out)}
    assert set(records) == {small_archive[0], *(p for p in small_archive if "/b/" in p)}
    pipeline = Pipeline(tiny_checkpoint_folder)
    for path, record in records.items():
        (alone,) = pipeline([path], beam_size=2, max_len=6)
        assert record["tokens"] == alone.tokens and record["beam_size"] == 2
        assert len(record["attention"]) == len(record["tokens"]) == len(record["is_eos"])
        assert all(abs(sum(row) - 1) < 1e-4 for row in record["attention"])
        assert record["geometry"]["grid_hw"] and Image.open(record["heatmap"]).format == "PNG"
        assert None not in record.values()  # a field the model has not (area boxes) is left out, not null
    assert len(list((tmp_path / "figures").iterdir())) == len(records)  # no partial files left behind


def test_a_lines_fields_come_in_the_readmes_order(tmp_path, tiny_checkpoint_folder, small_archive):
    """README lists a line's fields in the order they are written, ``path`` first: a reader of a huge archive (or a
    person paging it) finds the file a caption is of at the start of its line."""
    caption_archive(small_archive[:1], tmp_path / "out.jsonl", tiny_checkpoint_folder, settings(),
                    ArchiveOptions(max_len=4), progress=False)
    (record,) = read_lines(tmp_path / "out.jsonl")
    assert list(record) == ["path", "model", "checkpoint", "beam_size", "length_penalty", "block_trigrams",
                            "block_doubled_words", "caption", "tokens", "token_logprobs", "score"]


def test_a_figure_that_cannot_be_written_leaves_no_line_naming_it(tmp_path, tiny_checkpoint_folder, small_archive,
                                                                  monkeypatch):
    """A figure is written before its caption line: a run stopped by a figure it could not write (a full disk) has
    no line pointing at a missing figure, and ``--resume`` captions that image again."""
    def full_disk(image, result, out):
        raise OSError(errno.ENOSPC, "No space left on device", str(out))

    monkeypatch.setattr(archive, "write_figure", full_disk)
    out = tmp_path / "out.jsonl"
    with pytest.raises(OSError, match="No space left on device"):
        caption_archive(small_archive, out, tiny_checkpoint_folder, settings(),
                        ArchiveOptions(max_len=4, heatmaps=tmp_path / "figures"), progress=False)
    assert out.read_text() == ""


def test_the_figures_of_an_archive_are_drawn_on_one_thread(tmp_path, tiny_checkpoint_folder, small_archive,
                                                             monkeypatch):
    """pyplot's figure registry is not thread-safe: the figures of captions that finish together (one batch) are
    drawn one after another on the one figure thread, never on two at once."""
    threads = set()
    draw = archive.write_figure

    def recorded(image, result, out):
        threads.add(threading.get_ident())
        draw(image, result, out)

    monkeypatch.setattr(archive, "write_figure", recorded)
    caption_archive(small_archive, tmp_path / "out.jsonl", tiny_checkpoint_folder, settings(max_batch_images=4),
                    ArchiveOptions(max_len=4, heatmaps=tmp_path / "figures"), progress=False)
    assert len(list((tmp_path / "figures").iterdir())) == len(small_archive) and len(threads) == 1


def test_captions_follow_the_decoding_flags_over_the_checkpoints_defaults(tmp_path, small_archive, capsys):
    """``captioner caption`` decodes with the rules its flags name in place of the checkpoint's defaults, rule by
    rule, and each record says which: the one printed for an image (``--json``) and an archive's lines
    (``--output``), which take their flags by different paths; an archive whose options name no rule (a library
    call) keeps the checkpoint's."""
    ruled = save_checkpoint(tmp_path / "ruled", tiny_model("sat"), VOCAB, TINY_SPEC, meta={
        "decoding": {"length_penalty": 1.0, "block_trigrams": False, "block_doubled_words": True}})
    flags = ["--checkpoint", str(ruled), "--threads", "1", "--max-len", "4", "--length-penalty", "0.5",
             "--block-trigrams", "--no-block-doubled-words"]
    main(["caption", small_archive[0], "--json", *flags])
    shown = json.loads(capsys.readouterr().out)
    main(["caption", small_archive[0], "--output", str(tmp_path / "flags.jsonl"), *flags])
    caption_archive(small_archive[:1], tmp_path / "defaults.jsonl", ruled, settings(), ArchiveOptions(max_len=4),
                    progress=False)
    (archived,), (kept,) = read_lines(tmp_path / "flags.jsonl"), read_lines(tmp_path / "defaults.jsonl")
    rules = ("length_penalty", "block_trigrams", "block_doubled_words")
    assert [tuple(r[name] for name in rules) for r in (shown, archived, kept)] == [(0.5, True, False)] * 2 + [
        (1.0, False, True)]


def test_an_output_is_never_overwritten_or_resumed_from_a_foreign_file(tmp_path, tiny_checkpoint_folder,
                                                                       small_archive):
    out = tmp_path / "out.jsonl"
    out.write_text('{"path": "x.jpg", "caption": "c"}\n')
    with pytest.raises(ArchiveError, match="--resume"):
        CaptionLines(out, resume=False)
    foreign = tmp_path / "notes.jsonl"
    foreign.write_text('{"note": 1}\n{"path": "x.jpg"}\n')
    with pytest.raises(ArchiveError, match="line 1"):
        CaptionLines(foreign, resume=True)
    assert foreign.read_text() == '{"note": 1}\n{"path": "x.jpg"}\n'
    writing = CaptionLines(tmp_path / "shard.jsonl", resume=True)
    try:  # a second writer (a shard restarted while its first run still ends) is refused, not interleaved
        with pytest.raises(ArchiveError, match="another process is writing"):
            CaptionLines(tmp_path / "shard.jsonl", resume=True)
    finally:
        writing.close()
    CaptionLines(tmp_path / "shard.jsonl", resume=True).close()  # the lock goes with the file
    assert list_images([str(tmp_path / "archive")]) == small_archive


def test_a_folder_named_like_an_image_is_walked_not_listed(tmp_path, small_archive):
    """A folder whose name ends in ``.jpg`` (an album, say) is no image: listed, it was reported unreadable ("Is a
    directory") on every run and every resume; the photos inside it are listed."""
    album = tmp_path / "archive" / "b" / "summer.jpg"
    album.mkdir()
    inside = album / "beach.png"
    Image.open(small_archive[0]).save(inside)
    assert list_images([str(tmp_path / "archive")]) == sorted([*small_archive, str(inside)])


def test_caption_lines_reach_the_disk_every_interval_and_at_close(tmp_path, monkeypatch):
    """A killed process loses no line written (each is flushed); a machine crash loses at most ``fsync_every_s`` of
    them: the file is synced with the first line written that long after the last sync, and when it is closed."""
    clock, synced = [0.0], []
    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(archive, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(archive.os, "fsync", lambda fd: synced.append(out.read_bytes().count(b"\n")))
    lines = CaptionLines(out, resume=False, fsync_every_s=2.0)
    for now, path in ((1.0, "a.jpg"), (2.5, "b.jpg"), (3.0, "c.jpg"), (4.6, "d.jpg")):
        clock[0] = now
        lines.write({"path": path, "caption": "a cat"})
    lines.close()
    assert synced == [2, 4, 4]  # at 2.5 s (2 lines), 2.1 s later (4), and at close
    assert lines.done == {"a.jpg", "b.jpg", "c.jpg", "d.jpg"}


def test_closing_caption_lines_twice_is_harmless(tmp_path):
    """``close`` is idempotent, as a file's is: a library caller that closes in an ``except`` and again in a
    ``finally`` (or in a context manager's exit after an explicit close) must not meet "I/O operation on closed
    file", a ValueError that would hide the error being handled."""
    out = tmp_path / "out.jsonl"
    lines = CaptionLines(out, resume=False)
    lines.write({"path": "a.jpg", "caption": "a cat"})
    lines.close()
    lines.close()
    assert [r["path"] for r in read_lines(out)] == ["a.jpg"]


def test_the_errors_list_makes_its_folder_when_a_library_caller_names_a_new_one(tmp_path):
    """``ErrorLog`` makes the folder it writes in, as ``CaptionLines`` does: a library caller that lists a run's
    unreadable files in a folder not yet made must get the list, not "cannot write the list of errors"."""
    where = tmp_path / "not" / "yet" / "made.errors.jsonl"
    errors = archive.ErrorLog(where, say=lambda line: None)
    errors("a.jpg", "not a regular file")
    errors.close()
    assert read_lines(where) == [{"path": "a.jpg", "error": "not a regular file"}]


def test_a_refused_output_closes_the_file_it_opened(tmp_path):
    """The output is opened (and locked) before it is checked: a refusal, a second writer's or a foreign file's on
    resume, must close it then, not leave it to the garbage collector (a library caller's process holds the file,
    and on resume its lock, for as long as the error's traceback lives)."""
    foreign = tmp_path / "notes.jsonl"
    foreign.write_text('{"note": 1}\n')
    writing = CaptionLines(tmp_path / "shard.jsonl", resume=True)
    try:
        with nothing_left_open():
            with pytest.raises(ArchiveError, match="another process is writing"):
                CaptionLines(tmp_path / "shard.jsonl", resume=True)
            with pytest.raises(ArchiveError, match="line 1"):
                CaptionLines(foreign, resume=True)
    finally:
        writing.close()


def test_a_users_files_beside_the_output_are_never_cut_or_emptied(tmp_path, tiny_checkpoint_folder,
                                                                     small_archive):
    """The security audit: --resume took a one-line file of somebody else's for a crash's torn tail and replaced
    it by captions; the errors list emptied a user's file of its name, and the file a link of its name pointed to."""
    config = tmp_path / "config.json"
    config.write_text('{"theme":"dark","font":12}')  # one line, no newline
    with pytest.raises(ArchiveError, match="holds no caption line"):
        caption_archive(small_archive, config, tiny_checkpoint_folder, settings(), ArchiveOptions(), resume=True)
    notes = tmp_path / "notes.txt"
    notes.write_text("remember the milk\n")
    with pytest.raises(ArchiveError, match="line 1, is not a caption line"):
        caption_archive(small_archive, notes, tiny_checkpoint_folder, settings(), ArchiveOptions(), resume=True)
    assert config.read_text() == '{"theme":"dark","font":12}' and notes.read_text() == "remember the milk\n"
    report = tmp_path / "report.errors.csv"
    report.write_text("a,b\n1,2\n")
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    (tmp_path / "run.errors.jsonl").symlink_to(precious)
    for output, kept in ((tmp_path / "report.csv", report), (tmp_path / "run.jsonl", precious)):
        with pytest.raises(ArchiveError, match="nothing was changed"):
            caption_archive(small_archive, output, tiny_checkpoint_folder, settings(), ArchiveOptions())
        assert not output.exists()
    assert report.read_text() == "a,b\n1,2\n" and precious.read_text() == "keep me"
    # a crash's torn tail is still cut: a piece of a caption line after the last newline
    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"path": "x.jpg", "caption": "a cat"}\n{"path": "y.jp')
    lines = CaptionLines(torn, resume=True)
    lines.close()
    assert lines.done == {"x.jpg"} and torn.read_text() == '{"path": "x.jpg", "caption": "a cat"}\n'
    assert lines.dropped_tail == len('{"path": "y.jp')  # the bytes cut, which the command reports
    torn.write_text('{"path": "x.jpg", "caption": "a cat"}\n{"pa')  # torn before its first field was whole
    CaptionLines(torn, resume=True).close()
    assert torn.read_text() == '{"path": "x.jpg", "caption": "a cat"}\n'
    alone = tmp_path / "alone.jsonl"  # killed while writing its first line
    alone.write_text('{"path": "x.j')
    CaptionLines(alone, resume=True).close()
    assert alone.read_text() == ""


def test_an_image_the_folder_walk_found_is_never_taken_for_the_output(tmp_path, tiny_checkpoint_folder,
                                                                        small_archive):
    """An image reached through a folder (or a list), not named itself, given as the output is one of the inputs:
    it was answered "already holds captions: add --resume to continue it, or remove it"."""
    photo = Path(small_archive[0])
    kept = photo.read_bytes()
    for resume in (False, True):
        with pytest.raises(ArchiveError, match="one of the command's inputs"):
            caption_archive([str(tmp_path / "archive")], photo, tiny_checkpoint_folder, settings(), ArchiveOptions(),
                            resume=resume, progress=False)
    assert photo.read_bytes() == kept


def test_a_link_in_place_of_the_errors_list_is_refused_before_anything_is_written(tmp_path, tiny_checkpoint_folder,
                                                                                    small_archive):
    """A link is refused for what it is, even to an earlier run's list of errors or to nothing yet: rewriting through
    it would empty the file it names, and opening it without following it failed only once the output was made."""
    earlier = tmp_path / "kept.errors.jsonl"
    earlier.write_text(json.dumps({"path": "x.jpg", "error": "not a regular file"}) + "\n")
    (tmp_path / "run.errors.jsonl").symlink_to(earlier)
    (tmp_path / "new.errors.jsonl").symlink_to(tmp_path / "nowhere.jsonl")
    for output in (tmp_path / "run.jsonl", tmp_path / "new.jsonl"):
        with pytest.raises(ArchiveError, match="is a link: the list of errors is not written through one"):
            caption_archive(small_archive, output, tiny_checkpoint_folder, settings(), ArchiveOptions(max_len=4),
                            progress=False)
        assert not output.exists()
    assert read_lines(earlier) == [{"path": "x.jpg", "error": "not a regular file"}]
    assert not (tmp_path / "nowhere.jsonl").exists()


def test_a_run_with_unreadable_files_leaves_no_file_open(tmp_path, tiny_checkpoint_folder, small_archive):
    """The output and the list of errors are closed when the run ends, not left to the garbage collector."""
    with nothing_left_open():
        run = caption_archive([small_archive[0], str(tmp_path / "gone.jpg")], tmp_path / "out.jsonl",
                              tiny_checkpoint_folder, settings(), ArchiveOptions(max_len=4), progress=False)
    assert (run.summary.captioned, run.summary.skipped) == (1, 1)
    assert read_lines(tmp_path / "out.errors.jsonl")[0]["path"] == str(tmp_path / "gone.jpg")


def test_the_progress_bar_counts_skipped_images_and_those_done_before_a_resume(tmp_path, tiny_checkpoint_folder,
                                                                              small_archive, capsys):
    """The bar ends at the shard's total: an unreadable file counts once it is skipped, and a resumed run's bar
    starts at the images the output already holds (either bar ended short of its total)."""
    out, gone = tmp_path / "out.jsonl", str(tmp_path / "gone.jpg")
    for images in (small_archive[:5], small_archive):
        caption_archive([*images, gone], out, tiny_checkpoint_folder, settings(), ArchiveOptions(max_len=4),
                        resume=True, progress=True)
        bar = [line for line in capsys.readouterr().err.splitlines() if line.startswith("captioning: ")]
        total = len(images) + 1
        assert f"| {total}/{total} [" in bar[-1]


def test_the_images_read_ahead_fill_the_rows_and_one_encoder_batch():
    """More images in flight than the batcher's rows take (``max_rows`` / beam) plus one encoder batch waiting would
    only hold decoded images in memory; at least one image is always read."""
    assert in_flight(Settings(max_rows=12, max_batch_images=4), beam_size=3) == 4 + 4
    assert in_flight(Settings(max_rows=5, max_beam_size=5, max_batch_images=2), beam_size=5) == 1 + 2
    assert in_flight(Settings(max_rows=5, max_beam_size=5, max_batch_images=2), beam_size=3) == 1 + 2


def test_the_rate_of_a_run_is_images_per_second():
    assert ArchiveSummary(captioned=10, seconds=4.0).images_per_s == 2.5
    assert ArchiveSummary(captioned=0, skipped=3).images_per_s == 0.0  # a run that captioned nothing took no time


def test_a_failure_while_writing_stops_the_run_and_is_raised(tmp_path, tiny_checkpoint_folder, small_archive,
                                                             monkeypatch):
    """A line the disk cannot hold is not an unreadable image: the run stops (no more images are read once the
    captions in flight are done) and the error reaches the caller, where a run that went on would end "captioned"
    with lines missing."""
    attempts = []

    def full_disk(self, record):
        attempts.append(record["path"])
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(CaptionLines, "write", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        caption_archive(small_archive, tmp_path / "out.jsonl", tiny_checkpoint_folder,
                        settings(max_rows=3, max_beam_size=3, max_batch_images=1), ArchiveOptions(max_len=4),
                        progress=False)
    assert 1 <= len(attempts) < len(small_archive)


def test_an_interrupted_run_keeps_its_lines_and_resumes_at_once_in_the_same_process(tmp_path, tiny_checkpoint_folder,
                                                                                   small_archive, monkeypatch):
    """Ctrl-C (a KeyboardInterrupt) keeps every line written and closes the output, its lock with it: a library
    caller (a notebook) resuming at once, the interrupt's traceback still held, was told another process wrote it."""
    write = CaptionLines.write

    def interrupted(self, record):
        write(self, record)
        if len(self.done) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(CaptionLines, "write", interrupted)
    out = tmp_path / "out.jsonl"
    with pytest.raises(KeyboardInterrupt) as stopped:
        caption_archive(small_archive, out, tiny_checkpoint_folder, settings(), ArchiveOptions(max_len=4),
                        progress=False)
    written = out.read_bytes()
    assert len(written.splitlines()) == 3 and stopped.type is KeyboardInterrupt  # `stopped` holds the traceback
    monkeypatch.setattr(CaptionLines, "write", write)
    run = caption_archive(small_archive, out, tiny_checkpoint_folder, settings(), ArchiveOptions(max_len=4),
                          resume=True, progress=False)
    assert out.read_bytes().startswith(written) and sorted(r["path"] for r in read_lines(out)) == small_archive
    assert (run.already_done, run.summary.captioned) == (3, len(small_archive) - 3)


def test_a_stopped_run_leaves_no_reader_thread_running(tmp_path, tiny_checkpoint_folder, small_archive,
                                                       monkeypatch):
    """A run stopped by a failure shuts its reader threads down, the reads not yet begun cancelled: they waited on
    in a library caller's process (reading on, even) for as long as the error's traceback lived."""
    readers = set()

    def full_disk(self, record):
        readers.update(t for t in threading.enumerate() if t.name.startswith("archive-reader"))
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(CaptionLines, "write", full_disk)
    with pytest.raises(OSError, match="No space left on device") as failed:
        caption_archive(small_archive, tmp_path / "out.jsonl", tiny_checkpoint_folder, settings(),
                        ArchiveOptions(max_len=4), progress=False)
    for thread in readers:
        thread.join(timeout=10)
    assert readers and not [t.name for t in readers if t.is_alive()], failed.value  # the traceback is still held


def test_resuming_a_finished_archive_changes_nothing(tmp_path, tiny_checkpoint_folder, small_archive, monkeypatch):
    out = tmp_path / "out.jsonl"
    caption_archive(small_archive, out, tiny_checkpoint_folder, settings(), ArchiveOptions(max_len=4), progress=False)
    written = out.read_bytes()
    # nor loads the model (and warms it up: tens of seconds) for nothing to caption
    monkeypatch.setattr(archive, "load_runtime", lambda *args: pytest.fail("a finished archive loaded its model"))
    run = caption_archive(small_archive, out, tiny_checkpoint_folder, settings(), ArchiveOptions(max_len=4),
                          resume=True, progress=False)
    assert (run.total, run.already_done, run.summary.captioned, run.dropped_tail) == (len(small_archive),) * 2 + (0, 0)
    assert out.read_bytes() == written


def test_sources_holding_no_image_are_refused_before_an_output_is_made(tmp_path, tiny_checkpoint_folder, monkeypatch):
    """A wrong folder (or one of formats the service does not read) is an error that names it and the formats looked
    for: a run that went on ended "0 captioned" with exit 0 and an empty output file, as if the archive were done."""
    wrong = tmp_path / "holiday"
    wrong.mkdir()
    (wrong / "IMG_0001.heic").write_bytes(b"not read")
    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(archive, "load_runtime", lambda *args: pytest.fail("loaded a model for no image"))
    with pytest.raises(ArchiveError, match="no image files in") as refused:
        caption_archive([str(wrong)], out, tiny_checkpoint_folder, settings(), ArchiveOptions(max_len=4),
                        progress=False)
    assert str(wrong) in str(refused.value) and ".jpg" in str(refused.value)
    assert not out.exists() and not archive.errors_path(out).exists()


@pytest.mark.parametrize("argv, message", [
    (["caption", "DIR", "--resume"], "--resume needs --output"),
    # the archive's own options without --output: named, not ignored (no figures written, no attention rows)
    (["caption", "DIR", "--heatmaps", "figures"], "--heatmaps needs --output"),
    (["caption", "DIR", "--attention"], "--attention needs --output"),
    (["caption", "DIR", "--shard", "0/2", "--resume"], "--resume, --shard need --output"),
    (["caption", "DIR"], "is a folder: caption an archive with --output"),
    (["caption", "DIR", "--output", "o.jsonl", "--shard", "2/2"], "0 <= INDEX < COUNT"),
    (["caption", "DIR", "--output", "o.jsonl", "--shard", "one/2"], "0 <= INDEX < COUNT"),
    (["caption", "DIR", "--output", "o.jsonl", "--overlay", "f.png"], "--overlay, --token and --json"),
    (["caption", "DIR", "--output", "o.jsonl", "--checkpoint", "a", "--checkpoint", "b"],
     "an archive is captioned by one --checkpoint"),  # not the first of them in silence
    (["caption", "DIR/missing", "--output", "o.jsonl"], "no such folder, image or list file"),
])
def test_archive_mistakes_are_one_line_errors(tmp_path, argv, message):
    with pytest.raises(SystemExit) as exited:
        main([arg.replace("DIR", str(tmp_path)).replace("o.jsonl", str(tmp_path / "o.jsonl")) for arg in argv])
    assert message in str(exited.value) and "\n" not in str(exited.value)


def test_the_archive_loads_its_checkpoint_with_the_servers_settings(tiny_checkpoint_folder, tmp_path, monkeypatch):
    """README: the archive loads the checkpoint "as `captioner serve` loads it"; CAPTIONER_INTEROP_THREADS was
    read by the server only, and a prefixed folder of the server's must not add its models to the archive's one."""
    interop = []
    monkeypatch.setattr(torch, "set_num_interop_threads", interop.append)
    other = save_checkpoint(tmp_path / "scenes" / "other", tiny_model("sat", seed=1), VOCAB, TINY_SPEC)
    settings = Settings(interop_threads=2, threads=1, backend="torch", prefixed_weights_dirs={"x-": other.parent})
    runtime = load_runtime(tiny_checkpoint_folder, settings)
    assert interop == [2] and runtime.name == "tiny" and runtime.backend == "torch"


def test_captions_threads_and_device_flags_reach_the_archives_settings_over_the_variables(tmp_path, monkeypatch):
    """``--threads`` and ``--device`` are the settings the archive loads its checkpoint with, the flags winning over
    CAPTIONER_*; ``--device``'s default (auto) is no flag given, so CAPTIONER_DEVICE holds then."""
    seen = []

    class Stop(Exception):
        pass

    def stop(images, output, checkpoint, settings, *args):  # before any model loads
        seen.append(settings)
        raise Stop

    monkeypatch.setattr(archive, "caption_archive", stop)
    monkeypatch.setenv("CAPTIONER_THREADS", "3")
    monkeypatch.setenv("CAPTIONER_DEVICE", "cpu")
    command = ["caption", str(tmp_path), "--output", str(tmp_path / "o.jsonl")]
    for flags in ([], ["--threads", "2", "--device", "cuda:1"]):
        with pytest.raises(Stop):
            main(command + flags)
    assert [(s.threads, s.device) for s in seen] == [(3, "cpu"), (2, "cuda:1")]


def test_ctrl_c_while_captioning_an_archive_says_how_to_finish_it_and_exits_130(tmp_path, monkeypatch, capsys):
    """Ctrl-C stops an archive with the shell's status for an interrupt and one line saying where the captions are
    and that ``--resume`` finishes them, not a traceback (the lines written so far are kept: the archive's tests)."""

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(archive, "caption_archive", interrupted)
    out = tmp_path / "o.jsonl"
    with pytest.raises(SystemExit) as exited:
        main(["caption", str(tmp_path), "--output", str(out)])
    assert exited.value.code == 130
    said = f"interrupted: the captions written so far are in {out}; run the same command with --resume to finish\n"
    assert capsys.readouterr().err == said


def test_the_archive_warms_its_batcher_up_as_the_server_does(tiny_checkpoint_folder, small_archive, tmp_path,
                                                             monkeypatch):
    """CAPTIONER_WARMUP is read as the server reads it: the batcher is warmed up (its encoder batches measured)
    when it is on, and not at all when it is off."""
    warmed = []

    async def recorded(batcher, settings):
        warmed.append(settings.warmup)

    monkeypatch.setattr(archive, "warm_up", recorded)
    for warmup in (True, False):
        caption_archive(small_archive[:2], tmp_path / f"{warmup}.jsonl", tiny_checkpoint_folder,
                        settings(warmup=warmup), ArchiveOptions(max_len=4),
                        progress=False)
    assert warmed == [True]


def test_a_checkpoint_that_fails_to_load_is_a_one_line_archive_error(tiny_checkpoint_folder, tmp_path):
    """The loader logs why and skips the folder (as the server does); the archive then has no model, and says so
    naming it, where ``next()`` of nothing raised a bare StopIteration."""
    altered = save_checkpoint(tmp_path / "altered", tiny_model("sat"), VOCAB, TINY_SPEC)
    (altered / "vocab.json").write_text((altered / "vocab.json").read_text() + " ")
    with pytest.raises(ArchiveError, match=f"{altered} is not a loadable checkpoint"):
        load_runtime(altered, settings())


def test_a_heatmaps_folder_that_cannot_be_made_stops_the_batcher(tmp_path, tiny_checkpoint_folder, small_archive,
                                                                 monkeypatch):
    """The --heatmaps folder was made after the batcher had started and outside the block that stops it: a folder
    under a file raised, and the batcher's worker thread went on running in the caller's process."""
    batchers = []
    started_batcher = archive._started_batcher

    def recorded(*args):
        batchers.append(started_batcher(*args))
        return batchers[-1]

    monkeypatch.setattr(archive, "_started_batcher", recorded)
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("a file, so no folder can be made under it")
    with pytest.raises(OSError):
        caption_archive(small_archive, tmp_path / "out.jsonl", tiny_checkpoint_folder, settings(),
                        ArchiveOptions(heatmaps=not_a_folder / "figures"), progress=False)
    (batcher,) = batchers
    assert batcher._thread is not None and not batcher._thread.is_alive(), "the batcher's worker is still running"


def test_a_folder_walk_takes_every_format_the_readme_names_whatever_the_case_of_its_suffix(tmp_path):
    """README: folders are walked for ``.jpg .jpeg .png .webp .gif .bmp .tif .tiff`` files, and a camera's
    ``IMG_0001.JPG`` is a JPEG too; the other files of the folder are passed over."""
    suffixes = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".JPG", ".TIFF", ".Png")
    images = [tmp_path / "walked" / f"photo{i}{suffix}" for i, suffix in enumerate(suffixes)]
    for path in images:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"")  # only the names are listed: a file that is no image is reported when it is read
    (tmp_path / "walked" / "notes.txt").write_text("not an image")
    (tmp_path / "walked" / "raw.cr2").write_bytes(b"")
    assert list_images([str(tmp_path / "walked")]) == sorted(map(str, images))


def test_a_lists_lines_are_read_without_the_spaces_around_them(tmp_path, small_archive):
    """A list written by hand or by a script (``find … | sed 's/^/  /'``) may indent its paths and comments or leave
    spaces at their ends: the paths are the lines' stripped text, and an indented ``#`` line is a comment."""
    listing = tmp_path / "list.txt"
    listing.write_text(f"  # the first two\n  {small_archive[0]}  \n\t{small_archive[1]}\t\n   \n")
    assert list_images([str(listing)]) == small_archive[:2]


def test_the_errors_list_of_an_output_without_a_suffix_is_a_json_lines_file_beside_it(tmp_path):
    """``captions.jsonl`` → ``captions.errors.jsonl``, and an output named without a suffix still gets a
    ``.jsonl`` list (not ``captions.errors``, a name that says nothing of what it holds)."""
    assert archive.errors_path(tmp_path / "captions.jsonl") == tmp_path / "captions.errors.jsonl"
    assert archive.errors_path(tmp_path / "captions") == tmp_path / "captions.errors.jsonl"


def _write_one_line(out: Path, record: dict) -> None:
    """A new run's output (no ``--resume``) given one line, then closed."""
    lines = CaptionLines(out, resume=False)
    lines.write(record)
    lines.close()


def test_an_empty_output_file_is_written_without_resume(tmp_path):
    """README: "Without ``--resume`` an existing non-empty output is refused": an empty one (made by ``touch``, or
    by a run stopped before its first caption) holds nothing to lose, and is written."""
    out = tmp_path / "out.jsonl"
    out.touch()
    _write_one_line(out, {"path": "x.jpg", "caption": "a cat"})
    assert read_lines(out) == [{"path": "x.jpg", "caption": "a cat"}]


def test_a_file_with_one_error_line_among_a_users_lines_is_not_taken_for_an_errors_list(
        tmp_path, tiny_checkpoint_folder, small_archive):
    """Every line of the file must be an earlier run's ``{"path", "error"}`` record before a run rewrites it: one such
    line copied into a user's own notes does not make the file an errors list to empty."""
    kept = json.dumps({"path": "x.jpg", "error": "not a regular file"}) + "\n" + json.dumps({"note": "mine"}) + "\n"
    (tmp_path / "run.errors.jsonl").write_text(kept)
    with pytest.raises(ArchiveError, match="is not a list of errors an earlier run wrote"):
        caption_archive(small_archive, tmp_path / "run.jsonl", tiny_checkpoint_folder, settings(), ArchiveOptions(),
                        progress=False)
    assert (tmp_path / "run.errors.jsonl").read_text() == kept and not (tmp_path / "run.jsonl").exists()


def test_caption_lines_in_place_of_the_errors_list_are_not_emptied(tmp_path, tiny_checkpoint_folder, small_archive):
    """A line is an earlier run's error record only with exactly the keys ``path`` and ``error``: captions written
    with ``--output run.errors.jsonl`` also have a ``path`` on every line, and a later ``--output run.jsonl`` emptied
    them as its list of errors."""
    kept = "".join(json.dumps({"path": f"x{i}.jpg", "caption": "a cat", "score": -1.5}) + "\n" for i in range(2))
    (tmp_path / "run.errors.jsonl").write_text(kept)
    out = tmp_path / "run.jsonl"
    with pytest.raises(ArchiveError, match="is not a list of errors an earlier run wrote"):
        caption_archive(small_archive, out, tiny_checkpoint_folder, settings(), ArchiveOptions(), progress=False)
    assert (tmp_path / "run.errors.jsonl").read_text() == kept and not out.exists()


def test_an_archives_figure_is_the_picture_caption_overlay_draws(tmp_path, tiny_checkpoint_folder, capsys):
    """README: ``--heatmaps DIR`` writes each image's per-word figure, ``--overlay``'s. The archive keeps only a
    thumbnail of a decoded image in memory; drawn from it, at the panel size ``--overlay`` draws at, the figure is
    the same picture as the one drawn from the whole photo."""
    photo = tmp_path / "astronaut.png"
    Image.fromarray(data.astronaut()).save(photo)  # 512 × 512: larger than the panels' thumbnail, so it decides
    caption_archive([str(photo)], tmp_path / "out.jsonl", tiny_checkpoint_folder, settings(),
                    ArchiveOptions(max_len=4, heatmaps=tmp_path / "figures"), progress=False)
    (record,) = read_lines(tmp_path / "out.jsonl")
    overlay = tmp_path / "overlay.png"
    main(["caption", str(photo), "--checkpoint", str(tiny_checkpoint_folder), "--threads", "1", "--max-len", "4",
          "--overlay", str(overlay)])
    assert record["caption"] in capsys.readouterr().out
    assert Image.open(record["heatmap"]).tobytes() == Image.open(overlay).tobytes()


def test_a_runs_seconds_are_the_time_its_captioning_took(tmp_path, tiny_checkpoint_folder, small_archive):
    """The command's last line gives the rate, images captioned over the run's seconds: those are the time from the
    first image to the last, a part of the call's wall clock (not a clock reading added to its start)."""
    began = time.perf_counter()
    run = caption_archive(small_archive[:2], tmp_path / "out.jsonl", tiny_checkpoint_folder, settings(),
                          ArchiveOptions(max_len=4), progress=False)
    assert 0 < run.summary.seconds <= time.perf_counter() - began


def test_an_archive_has_no_deadline_however_long_its_captions_wait(tmp_path, tiny_checkpoint_folder, small_archive,
                                                                     monkeypatch):
    """An archive job has no request deadline: an image that waits hours behind the rest of a huge archive on a slow
    machine is still captioned (a deadline that expired failed the whole run). The batcher's clock here moves an
    hour each time it is read."""
    started_batcher = archive._started_batcher

    def hours_pass(*args):
        batcher = started_batcher(*args)
        clock = itertools.count(0.0, 3600.0)
        batcher.clock = lambda: next(clock)
        return batcher

    monkeypatch.setattr(archive, "_started_batcher", hours_pass)
    run = caption_archive(small_archive[:3], tmp_path / "out.jsonl", tiny_checkpoint_folder, settings(),
                          ArchiveOptions(max_len=4), progress=False)
    assert run.summary.captioned == 3 and len(read_lines(tmp_path / "out.jsonl")) == 3


def test_a_binary_file_among_the_inputs_is_a_one_line_archive_error(tmp_path):
    """A file that is neither an image (by its suffix) nor a text list, a model's weights given by mistake, say, is
    refused by name, not met as a UnicodeDecodeError's traceback."""
    weights = tmp_path / "model.pt"
    weights.write_bytes(b"\x80\x02\xff\xfe binary")
    with pytest.raises(ArchiveError, match="model.pt is neither an image nor a text list of image paths"):
        list_images([str(weights)])


def test_a_resumed_run_writes_its_figures_into_the_folder_the_first_run_made(tmp_path, tiny_checkpoint_folder,
                                                                             small_archive):
    """``--resume`` with the same ``--heatmaps DIR`` finds the folder there: it adds the missing figures to it."""
    out, figures = tmp_path / "out.jsonl", tmp_path / "figures"
    for images in (small_archive[:1], small_archive[:2]):
        caption_archive(images, out, tiny_checkpoint_folder, settings(), ArchiveOptions(max_len=4, heatmaps=figures),
                        resume=True, progress=False)
    assert sorted(Path(r["heatmap"]).parent for r in read_lines(out)) == [figures, figures]
    assert len(list(figures.iterdir())) == 2


@pytest.mark.parametrize("resume", [False, True])
def test_a_folder_given_as_the_output_is_refused_as_a_folder(tmp_path, resume):
    """``--output photos/`` (the folder rather than the file to write) is named for what it is, with or without
    ``--resume``: not "already holds captions", nor an OS error about opening a directory."""
    with pytest.raises(ArchiveError, match="is a folder: --output names the JSON Lines file to write"):
        CaptionLines(tmp_path, resume=resume)


def test_a_lines_text_is_utf_8_as_listed_not_json_escapes(tmp_path):
    """A path (or caption) outside ASCII is written as its UTF-8 text, as the service answers it: ``grep café`` finds
    its line, where ``\\u00e9`` escapes would hide it."""
    out = tmp_path / "out.jsonl"
    _write_one_line(out, {"path": "fotos/café/Ünïcode.jpg", "caption": "a cat"})
    assert out.read_bytes() == '{"path": "fotos/café/Ünïcode.jpg", "caption": "a cat"}\n'.encode()


def test_an_output_in_a_folder_not_yet_made_is_written_there(tmp_path):
    """``--output results/run1/captions.jsonl`` makes the folders it names (a shard's first run on a fresh volume),
    as the list of errors beside it does."""
    out = tmp_path / "results" / "run1" / "captions.jsonl"
    _write_one_line(out, {"path": "x.jpg", "caption": "a cat"})
    assert read_lines(out) == [{"path": "x.jpg", "caption": "a cat"}]


def test_a_torn_tail_of_one_byte_is_cut_too(tmp_path):
    """A crash may leave any piece of a line after the last newline, its first byte alone included: kept, it began
    the next line appended (``{"path": …``), and the following resume refused the whole file as not an archive's."""
    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"path": "x.jpg", "caption": "a cat"}\n{')
    lines = CaptionLines(torn, resume=True)
    lines.write({"path": "y.jpg", "caption": "a dog"})
    lines.close()
    assert lines.dropped_tail == 1
    assert [r["path"] for r in read_lines(torn)] == ["x.jpg", "y.jpg"]


def test_a_json_line_that_is_no_object_is_a_foreign_file_on_resume(tmp_path):
    """A JSON Lines file of arrays or strings (somebody else's data) is refused as not an archive's output, as one of
    objects without a path is, not met as a TypeError's traceback."""
    for text in ('[1, 2]\n', '"x.jpg"\n'):
        foreign = tmp_path / "data.jsonl"
        foreign.write_text(text)
        with pytest.raises(ArchiveError, match="line 1, is not a caption line"):
            CaptionLines(foreign, resume=True)
        assert foreign.read_text() == text


def test_more_unreadable_files_than_images_in_flight_do_not_stall_the_run(tmp_path, tiny_checkpoint_folder,
                                                                           small_archive):
    """A skipped file frees its place in flight as a captioned one does: an archive with more broken files than the
    window holds (two here: one row of beam 3 and one encoder batch) goes on to the images after them."""
    broken = [tmp_path / f"broken{i}.jpg" for i in range(5)]
    for path in broken:
        path.write_bytes(b"not an image")
    paths = [*map(str, broken), *small_archive[:2]]
    assert in_flight(settings(max_rows=3, max_beam_size=3, max_batch_images=1), beam_size=3) == 2
    run = caption_archive(paths, tmp_path / "out.jsonl", tiny_checkpoint_folder,
                          settings(max_rows=3, max_beam_size=3, max_batch_images=1), ArchiveOptions(max_len=4),
                          progress=False)
    assert (run.summary.captioned, run.summary.skipped) == (2, 5)
    assert sorted(r["path"] for r in read_lines(tmp_path / "out.jsonl")) == small_archive[:2]


def test_a_torn_tail_cut_on_resume_is_synced_before_a_line_is_appended(tmp_path, monkeypatch):
    """The cut is synced at once: a machine crash after the next lines reached the disk must not bring the torn
    piece back in front of them (a line of two halves, which the following resume would refuse)."""
    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"path": "x.jpg", "caption": "a cat"}\n{"pa')
    synced = []
    monkeypatch.setattr(archive.os, "fsync", lambda fd: synced.append(torn.read_text()))
    lines = CaptionLines(torn, resume=True)
    assert synced == ['{"path": "x.jpg", "caption": "a cat"}\n']
    lines.close()
