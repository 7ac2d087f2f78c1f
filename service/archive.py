"""The archive use case: many image files → one JSON Lines file of captions, by the service's own engine.

``captioner caption DIR|LIST... --output captions.jsonl`` loads the checkpoint as the service does
(:func:`~.runtime.load_runtimes`: the same backends, precision and thread settings, ``CAPTIONER_*`` variables
included), starts one :class:`~.batcher.Batcher` (continuous batching, encoder batches chosen by warm-up) and
feeds it from a pool of reader threads that decode and preprocess the files, keeping just enough images in flight
to fill the batcher's rows.  No HTTP, no second engine: the batcher sees what the app's use case would send it.

Crash safety (docs/decisions.md, "Captioning an archive"): every caption is one line, written with one ``write``
and flushed as soon as it is known, so a killed process (``kill -9``, Ctrl-C) loses only the images still in
flight; ``fsync`` runs with the first line written ``FSYNC_EVERY_S`` after the last one and at exit, so a machine
crash loses at most the lines of that long.  One process at a time writes a file (an exclusive ``flock``).  With
``resume`` the lines already there are skipped, and a torn last line (a crash in the middle of a write) is cut
off before anything is appended, so no image is written twice or lost.  Lines come in the order captions finish,
not the input order.  Unreadable files are reported (stderr and ``OUT.errors.jsonl``) and skipped; ``resume``
tries them again.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import stat
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from captioner.models.decoding import RULE_NAMES, DecodingRules
from captioner.models.files import naming_errors
from captioner.models.images import ImageDecodeError, ImageTooLarge, load_image
from captioner.models.inference import CaptionResult, Runtime
from captioner.models.rendering.heatmaps import save_picture

from .batcher import Batcher
from .schemas import CaptionOut
from .settings import Settings
from .warmup import warm_up

#: what a folder walk picks up (the formats the service accepts: README, "Service")
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"})
#: a machine crash loses at most this many seconds of captions (a killed process loses none that were written)
FSYNC_EVERY_S = 2.0
#: an archive job has no request deadline: the batcher's deadline machinery is given one it never reaches
NO_DEADLINE_S = 365 * 24 * 3600.0
#: how long an interrupted run waits for the captions in flight before it stops the batcher
STOP_WAIT_S = 1.0
#: panel size of the per-word figures (caption_figure's default)
FIGURE_PANEL = 224
#: a line's fields without --attention (CaptionOut's names; ``path`` comes first): the caption, and how it was
#: decoded (the model, beam and decoding rules)
SUMMARY_FIELDS = ("model", "checkpoint", "beam_size", *RULE_NAMES, "caption", "tokens", "token_logprobs", "score")


class ArchiveError(RuntimeError):
    """A problem with the command's inputs or output file (the CLI prints it as one line)."""


# -- inputs ---------------------------------------------------------------------------------------------------------
def file_bytes(path: str, limit: int) -> bytes:
    """The bytes of image file ``path``, refused (:class:`ImageDecodeError`) when it is not a regular file (a FIFO
    named in a list would block its reader for ever, ``/dev/zero`` would be read until memory ran out) or is larger
    than the service's upload limit (:class:`ImageTooLarge`)."""
    with open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NONBLOCK)) as file:
        status = os.fstat(file.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise ImageDecodeError("not a regular file")
        data = file.read(limit + 1)
    if len(data) > limit:
        raise ImageTooLarge(f"the file is larger than the upload limit of {limit} bytes (CAPTIONER_MAX_UPLOAD_BYTES)")
    return data


def list_images(sources: Iterable[str | Path]) -> list[str]:
    """The image paths of ``sources``, sorted and without repeats: a folder contributes every file below it whose
    suffix is an image format's (walked recursively), an image file itself, and any other file is a list of paths,
    one per line (blank lines and ``#`` comments skipped; relative paths are relative to the working directory)."""
    found: set[str] = set()
    for source in map(Path, sources):
        if source.is_dir():
            found.update(str(p) for p in source.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        elif source.suffix.lower() in IMAGE_SUFFIXES:
            found.add(str(source))
        elif source.is_file():
            try:
                lines = source.read_text().splitlines()
            except UnicodeDecodeError:
                raise ArchiveError(f"{source} is neither an image nor a text list of image paths") from None
            found.update(s for s in (line.strip() for line in lines) if s and not s.startswith("#"))
        else:
            raise ArchiveError(f"{source}: no such folder, image or list file")
    return sorted(found)


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` → ``(i, n)`` with ``0 <= i < n`` (a Kubernetes Indexed Job's completion index and count)."""
    index, sep, count = text.partition("/")
    try:
        shard = (int(index), int(count))
    except ValueError:
        shard = (-1, 0)
    if not sep or not 0 <= shard[0] < shard[1]:
        raise ArchiveError(f"--shard wants INDEX/COUNT with 0 <= INDEX < COUNT, got {text!r}")
    return shard


def shard_of(path: str, count: int) -> int:
    """The shard a path belongs to: SHA-256 of the path as written, modulo ``count``.  A hash of the path (not
    its position in the list) keeps every machine's share fixed when files are added to the archive, and needs
    no coordination: each machine lists the inputs and keeps its own."""
    return int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big") % count


def select_shard(paths: list[str], index: int, count: int) -> list[str]:
    return [p for p in paths if shard_of(p, count) == index]


# -- output ---------------------------------------------------------------------------------------------------------
def errors_path(output: Path) -> Path:
    """Where the unreadable files of a run are listed: ``captions.jsonl`` → ``captions.errors.jsonl``."""
    return output.with_name(f"{output.stem}.errors{output.suffix or '.jsonl'}")


class CaptionLines:
    """An append-only JSON Lines file that survives being killed: see the module docstring."""

    def __init__(self, path: Path, resume: bool, fsync_every_s: float = FSYNC_EVERY_S):
        self.path, self.fsync_every_s = path, fsync_every_s
        self.done: set[str] = set()
        self.dropped_tail = 0  # bytes of a torn last line cut off on resume
        if path.is_dir():
            raise ArchiveError(f"{path} is a folder: --output names the JSON Lines file to write")
        if path.exists() and path.stat().st_size and not resume:
            raise ArchiveError(f"{path} already holds captions: add --resume to continue it, or remove it")
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "ab")
        try:  # one writer per file: a second one (a restarted shard whose first run still ends) would tear lines
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise ArchiveError(f"another process is writing {path} (it holds the file's lock): wait for it to "
                               "end, or write elsewhere") from None
        if resume:
            try:
                self._recover()
            except BaseException:
                self._file.close()
                raise
        self._synced = time.monotonic()

    def _recover(self) -> None:
        """Read what an earlier run wrote and cut off a torn last line (one without its newline, or whose JSON is
        cut short), so that the next line appended starts on a line of its own."""
        data = self.path.read_bytes()
        # a line is written whole, its newline last: a crash leaves at most a piece after the last newline
        end = data.rfind(b"\n") + 1
        for number, line in enumerate(data[:end].splitlines(), 1):
            try:
                record = json.loads(line)
                self.done.add(record["path"])
            except (ValueError, KeyError, TypeError):  # somebody else's file: refuse to touch it
                raise ArchiveError(f"{self.path}, line {number}, is not a caption line: not an archive's output "
                                   "(nothing was changed)") from None
        # a piece with no caption line before it is a torn line only if it starts as one: a one-line file of
        # somebody else's (a settings file, a note) was cut off as a crash's tail and replaced by captions
        if end < len(data) and not self.done and not data[end:].startswith(b'{"path": '):
            raise ArchiveError(f"{self.path} holds no caption line: not an archive's output (nothing was changed)")
        if end < len(data):
            self.dropped_tail = len(data) - end
            with open(self.path, "r+b") as file:
                file.truncate(end)
                os.fsync(file.fileno())

    def write(self, record: dict) -> None:
        # one write call per complete line, flushed at once: a process killed after it loses nothing of it
        with naming_errors(self.path):
            self._file.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
            self._file.flush()
        self.done.add(record["path"])
        if time.monotonic() - self._synced >= self.fsync_every_s:
            self.sync()

    def sync(self) -> None:
        os.fsync(self._file.fileno())
        self._synced = time.monotonic()

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            with naming_errors(self.path):  # the rest of a line a full disk cut short
                self._file.flush()
                self.sync()
        finally:
            with suppress(OSError):  # the same flush again, failing the same way; the descriptor is closed anyway
                self._file.close()


def caption_record(path: str, result: CaptionResult, attention: bool) -> dict:
    """One output line: the path and the service's caption fields (:class:`~.schemas.CaptionOut`, same names and
    rounding), with the attention rows, geometry and extras only when asked for (they are most of its size)."""
    fields = CaptionOut.of(result).model_dump(exclude={"id"}, exclude_none=True)
    if not attention:
        fields = {name: fields[name] for name in SUMMARY_FIELDS}
    return {"path": path, **fields}


def heatmap_file(folder: Path, path: str) -> Path:
    """A file name per input, unique even for equal names in different folders: ``<stem>-<hash of the path>.png``."""
    return folder / f"{Path(path).stem}-{hashlib.sha256(path.encode()).hexdigest()[:12]}.png"


def write_figure(image, result: CaptionResult, out: Path) -> None:
    """The per-word figure (``captioner caption --overlay``'s), written whole or not at all (temporary + rename),
    before its caption line: a line never points at a missing or torn figure."""
    save_picture(result.figure(image, panel_size=FIGURE_PANEL), out)


# -- the run --------------------------------------------------------------------------------------------------------
@dataclass
class ArchiveOptions:
    beam_size: int = 3
    max_len: int = 20
    attention: bool = False  # attention rows, geometry and extras in every line
    heatmaps: Path | None = None  # a folder for per-word figures, one PNG per image
    readers: int = 2  # threads that read, decode and preprocess files
    length_penalty: float | None = None  # the decoding rules (None: the checkpoint's defaults)
    block_trigrams: bool | None = None
    block_doubled_words: bool | None = None


@dataclass
class ArchiveSummary:
    captioned: int = 0
    skipped: int = 0
    seconds: float = 0.0

    @property
    def images_per_s(self) -> float:
        return self.captioned / self.seconds if self.seconds else 0.0


def in_flight(settings: Settings, beam_size: int) -> int:
    """Images read ahead of the batcher: enough to fill its rows (``max_rows`` / beam) plus one encoder batch
    waiting, so decoding never starves; more would only hold decoded images in memory."""
    return max(1, settings.max_rows // beam_size) + settings.max_batch_images


def _started_batcher(runtime: Runtime, settings: Settings, window: int) -> Batcher:
    """The app's batcher for ``runtime``, started; its queue holds all ``window`` images in flight, so it never
    refuses one (QueueFull is HTTP back-pressure)."""
    batcher = Batcher(runtime, settings.max_batch_images, window, settings.max_rows,
                      overlap_encoding=settings.overlap_encoding)
    batcher.start()
    return batcher


class _ArchiveFeed:
    """One run's files through a started batcher: reader threads decode them, at most ``window`` images are in
    flight, each caption becomes a line of ``output`` (and a figure, with ``options.heatmaps``) as it finishes, and
    ``summary`` counts what was captioned and skipped."""

    def __init__(self, runtime: Runtime, settings: Settings, batcher: Batcher, rules: DecodingRules, window: int,
                 output: CaptionLines, report_error: Callable[[str, str], None], options: ArchiveOptions,
                 on_done: Callable[[], None]):
        self.runtime, self.settings, self.batcher, self.rules = runtime, settings, batcher, rules
        self.output, self.report_error, self.options, self.on_done = output, report_error, options, on_done
        self.summary = ArchiveSummary()
        self.slots = asyncio.Semaphore(window)
        if options.heatmaps is not None:  # before the pools: a folder that cannot be made leaves nothing to shut down
            options.heatmaps.mkdir(parents=True, exist_ok=True)
        self.readers = ThreadPoolExecutor(options.readers, thread_name_prefix="archive-reader")
        # one thread draws the figures: they are drawn with pyplot, whose figure registry is not thread-safe
        self.figures = ThreadPoolExecutor(1, thread_name_prefix="archive-figures")

    def read(self, path: str):
        """Runs in a reader thread: the file decoded and preprocessed, with the service's decoding and limits, on
        its bytes (read once); and its thumbnail when figures are drawn."""
        image = load_image(file_bytes(path, self.settings.max_upload_bytes), self.settings.max_pixels,
                           name="the file")
        prepared = self.runtime.prepare(image)
        if self.options.heatmaps is None:
            return None, prepared  # the decoded image is not kept while its caption is decoded
        # the figure is drawn on a thumbnail of at most twice its panel size: only that is kept in memory
        image.thumbnail((2 * FIGURE_PANEL, 2 * FIGURE_PANEL))
        return image, prepared

    async def caption_one(self, path: str) -> None:
        """Read, caption and write one file (an unreadable one is reported and skipped), then free its slot."""
        loop, options = asyncio.get_running_loop(), self.options
        try:
            try:
                image, prepared = await loop.run_in_executor(self.readers, self.read, path)
            except (ImageDecodeError, OSError) as exc:
                self.summary.skipped += 1
                # the record and the line name the file: the OS's reason alone (Python's text quotes the path again)
                self.report_error(path, str(exc) if isinstance(exc, ImageDecodeError)
                                  else f"cannot read it ({exc.strerror or exc})")
                self.on_done()
                return
            result = await self.batcher.submit(prepared, options.beam_size, options.max_len, NO_DEADLINE_S,
                                               self.rules).future
            record = caption_record(path, result, options.attention)
            if options.heatmaps is not None:
                figure = heatmap_file(options.heatmaps, path)
                await loop.run_in_executor(self.figures, write_figure, image, result, figure)
                record["heatmap"] = str(figure)
            self.output.write(record)
            self.summary.captioned += 1
            self.on_done()
        finally:
            self.slots.release()

    async def caption_all(self, paths: list[str]) -> None:
        """Every path through :meth:`caption_one`, at most the window in flight; a failure (not an unreadable
        file) stops the run once the captions in flight are written, and is raised."""
        tasks: set[asyncio.Task] = set()
        failures: list[BaseException] = []

        def finished(task: asyncio.Task) -> None:
            tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                failures.append(task.exception())

        for path in paths:
            await self.slots.acquire()
            if failures:
                break
            task = asyncio.create_task(self.caption_one(path))
            tasks.add(task)
            task.add_done_callback(finished)
        await asyncio.gather(*tasks, return_exceptions=True)
        if failures:
            raise failures[0]

    def close(self) -> None:
        self.readers.shutdown(wait=False, cancel_futures=True)
        self.figures.shutdown(wait=False, cancel_futures=True)


async def caption_paths(runtime: Runtime, settings: Settings, paths: list[str], output: CaptionLines,
                        report_error: Callable[[str, str], None], options: ArchiveOptions,
                        on_done: Callable[[], object] = lambda: None) -> ArchiveSummary:
    """Caption ``paths`` with ``runtime`` through a batcher made from ``settings`` (the app's construction and
    warm-up), appending a line to ``output`` as each caption finishes; unreadable files go to ``report_error``.
    ``on_done`` is called once per image, captioned or skipped (the progress bar)."""
    window = in_flight(settings, options.beam_size)
    rules = runtime.default_rules.overridden_by(options)
    batcher = _started_batcher(runtime, settings, window)
    feed = None
    # everything after the start is inside the try, the feed's own set-up (its --heatmaps folder) included: a
    # failure anywhere must stop the batcher's worker thread, not leave it running in the caller's process
    try:
        feed = _ArchiveFeed(runtime, settings, batcher, rules, window, output, report_error, options, on_done)
        if settings.warmup:
            await warm_up(batcher, settings)
        started = time.perf_counter()
        await feed.caption_all(paths)
        feed.summary.seconds = time.perf_counter() - started
        return feed.summary
    finally:
        if feed is not None:
            feed.close()
        # finished: the worker is idle and stops at once; interrupted: the captions in flight are dropped (they
        # are not in the output, so --resume captions them) after a short wait
        await batcher.stop(timeout_s=STOP_WAIT_S)


def _check_is_an_error_list(path: Path) -> None:
    """Refuse (before any work) to rewrite ``path`` unless it is absent or an earlier run's list of errors: a user's
    ``report.errors.csv`` beside ``--output report.csv`` was emptied."""
    if path.is_symlink():
        raise ArchiveError(f"{path} is a link: the list of errors is not written through one (nothing was changed)")
    if not path.exists():
        return
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        if all(json.loads(line).keys() == {"path", "error"} for line in lines):
            return
    except (OSError, ValueError, AttributeError):
        pass
    raise ArchiveError(f"{path} is not a list of errors an earlier run wrote: move it, or choose another --output "
                       "(nothing was changed)")


class ErrorLog:
    """Where :func:`caption_paths` reports unreadable files: a line on stderr (``say``) and a JSON line in
    ``path``, which lists the latest run's errors (each run rewrites it: ``--resume`` tries those files again)."""

    def __init__(self, path: Path, say: Callable[[str], None] = lambda line: print(line, file=sys.stderr)):
        _check_is_an_error_list(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.say = path, say
        try:  # never through a link: it emptied the file the link named
            self._file = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666), "w")
        except OSError as exc:
            raise ArchiveError(f"cannot write the list of errors {path} ({exc.strerror})") from None

    def __call__(self, image: str, reason: str) -> None:
        self.say(f"skipped {image}: {reason}")
        self._file.write(json.dumps({"path": image, "error": reason}, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def load_runtime(checkpoint: Path, settings: Settings) -> Runtime:
    """``checkpoint`` as the service would run it (:func:`~.runtime.load_runtimes` with the settings' backend,
    device, threads and precisions)."""
    from captioner.models.device import set_threads

    from .runtime import load_runtimes

    set_threads(settings.threads, settings.interop_threads)
    # this one checkpoint, not the served folders' models
    runtimes = load_runtimes(None, [checkpoint], **{**settings.model_loading(), "prefixed": None})
    if not runtimes:
        raise ArchiveError(f"{checkpoint} is not a loadable checkpoint (why is in the log line above)")
    return next(iter(runtimes.values()))


@dataclass
class ArchiveRun:
    """What ``captioner caption ... --output`` did: the images of its shard, those already in the output before
    it started, and what this run captioned and skipped."""

    total: int
    already_done: int
    summary: ArchiveSummary
    errors_file: Path
    dropped_tail: int = 0


def caption_archive(sources: list[str], output: Path, checkpoint: Path, settings: Settings, options: ArchiveOptions,
                    resume: bool = False, shard: tuple[int, int] = (0, 1), progress: bool | None = None) -> ArchiveRun:
    """The whole command: list the images of ``sources``, keep ``shard``'s, skip those ``output`` already holds
    (``resume``), caption the rest into it.  ``progress``: a progress bar with images/s on stderr (None: when
    stderr is a terminal)."""
    from captioner.models.checkpoint import read_config
    from captioner.models.progress import progress_bar, write_above

    read_config(checkpoint)  # a folder that is no checkpoint is named before the output file is made
    listed = list_images(sources)
    if not listed:  # a wrong folder, say: worth a word before a model is loaded for nothing
        raise ArchiveError(f"no image files in {', '.join(map(str, sources))} (looked for "
                           f"{' '.join(sorted(IMAGE_SUFFIXES))} files, and paths listed in text files)")
    paths = select_shard(listed, *shard)
    # an image or list given as the output was answered "already holds captions: … or remove it"
    read = {os.path.abspath(path) for path in [*sources, *listed]}
    for written in (output, errors_path(output)):
        if os.path.abspath(written) in read:
            raise ArchiveError(f"--output {output} would write {written}, one of the command's inputs: write the "
                               "captions somewhere else")
    _check_is_an_error_list(errors_path(output))  # before the output is made or cut
    lines = CaptionLines(output, resume)
    errors = None
    try:
        todo = [p for p in paths if p not in lines.done]
        run = ArchiveRun(len(paths), len(paths) - len(todo), ArchiveSummary(), errors_path(output), lines.dropped_tail)
        if not todo:
            return run
        runtime = load_runtime(checkpoint, settings)
        with progress_bar(total=len(paths), initial=run.already_done, unit="img", desc="captioning",
                          dynamic_ncols=True, disable=None if progress is None else not progress) as bar:
            errors = ErrorLog(run.errors_file, say=lambda line: write_above(bar, line))
            run.summary = asyncio.run(caption_paths(runtime, settings, todo, lines, errors, options,
                                                    on_done=lambda: bar.update()))
        return run
    finally:
        lines.close()
        if errors is not None:
            errors.close()
