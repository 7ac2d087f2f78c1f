"""The ``captioner`` console script: the models' subcommands (``export`` included) plus ``serve``, and the archive
mode of ``caption`` (``--output``: service/archive.py), which drives the service's batcher."""

from __future__ import annotations

import argparse
import difflib
import errno
import faulthandler
import json
import os
import re
import signal
import socket
import sys
import traceback
from collections.abc import Collection
from pathlib import Path

from captioner.models.cli.commands import add_commands
from captioner.models.cli.common import DEFAULT_CHECKPOINT, at_least, positive_int
from captioner.models.cli.inference import caption_files
from captioner.models.device import resolve_device
from captioner.models.files import describe_os_error, unwritable


#: CAPTIONER_* variables the project reads that are not service settings (each read where it is used, by name:
#: tests/test_container_config.py finds the variables the code reads from those reads)
OTHER_VARIABLES = frozenset({"CAPTIONER_DEBUG"})


def read_settings(**overrides):
    """The service's settings (CAPTIONER_* variables, ``overrides`` winning), or a one-line error naming each bad
    setting and what is wrong with it, never its value: pydantic's own message quotes the input, an API key with
    it."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from .settings import Settings

    _refuse_unknown_variables(Settings.model_fields)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(f"{_setting_named(error['loc'])}: {error['msg']}" for error in exc.errors())
        raise SystemExit(f"error: settings: {problems}") from None
    except SettingsError as exc:  # a JSON-typed setting (a list or an object) whose value is not JSON
        field = re.search(r'field "(\w+)"', str(exc))
        if field is None or field.group(1) not in Settings.model_fields:
            raise SystemExit(f"error: settings: {exc}") from None
        name = field.group(1)
        kind = "object" if "dict" in str(Settings.model_fields[name].annotation) else "list"
        raise SystemExit(f"error: settings: {_setting_named((name,))} must be a JSON {kind} (the README's settings "
                         "table gives an example)") from None


def _refuse_unknown_variables(fields: Collection[str]) -> None:
    """Stop on a CAPTIONER_* variable that is no setting: pydantic-settings ignores it, so a misspelt
    CAPTIONER_API_KEY (for ..._KEYS) served without keys, and CAPTIONER_DRAIN_TIMEOUT left the drain at 30 s."""
    known = {f"CAPTIONER_{name.upper()}" for name in fields} | OTHER_VARIABLES
    unknown = sorted(name for name in os.environ if name.upper().startswith("CAPTIONER_") and name.upper() not in known)
    if unknown:
        said = "; ".join(f"{name}" + "".join(f" (did you mean {match}?)" for match in
                                              difflib.get_close_matches(name.upper(), known, n=1, cutoff=0.75))
                         for name in unknown)
        raise SystemExit(f"error: settings: unknown variable {said}: unset it, or see the README's settings table")


def _setting_named(location: tuple) -> str:
    """The variable a settings error is about: its field's (the first location; a dict's keys follow), or the
    settings as a whole for a rule between fields (no location)."""
    return f"CAPTIONER_{str(location[0]).upper()}" if location else "the settings together"


def check_port_free(host: str, port: int) -> None:
    """Stop, in one line, a server whose address is taken, before its models load (uvicorn binds after the app's
    start-up: minutes of loading and warm-up, then its own "address already in use" and exit status 3).  Bound as
    uvicorn binds it (``SO_REUSEADDR``), then released.  A host that does not resolve, or names no address of this
    machine, is said the same way (uvicorn said "[Errno -2] Name or service not known" after the whole start-up)."""
    fix_host = "give --host (CAPTIONER_HOST) an address of this machine: 0.0.0.0 for all, 127.0.0.1 for itself"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        raise SystemExit(f"error: cannot listen on {host}:{port} ({exc.strerror}): {fix_host}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            fix = ("stop what uses it, or choose another --port (CAPTIONER_PORT)" if exc.errno == errno.EADDRINUSE
                   else fix_host)
            raise SystemExit(f"error: cannot listen on {host}:{port} ({exc.strerror}): {fix}") from None


def check_onnx_dir_writable(settings) -> None:
    """Stop, in one line, a server that must make ONNX exports (a first start, with models on an ONNX Runtime
    backend) in a CAPTIONER_ONNX_DIR it cannot write: a read-only container without a writable /tmp. Each export
    then failed twice (in the preparing child, then in the server) with a traceback apiece, and the models were
    served by PyTorch: minutes slower to start and a larger resident set than the memory limit was sized for.
    A folder that already holds every export needs no writing, and is not checked."""
    from .onnx_exports import unprepared

    missing = unprepared(settings.weights_dir, settings.checkpoints, **settings.model_placement())
    if not missing:
        return
    folder = Path(settings.onnx_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        why = unwritable(folder)
    except OSError as exc:
        why = exc.strerror or str(exc)
    if why is not None:
        raise SystemExit(f"error: CAPTIONER_ONNX_DIR {folder} cannot be written ({why}), and the "
                         f"ONNX exports of {', '.join(missing)} are made there on this start: give it a writable "
                         "folder (in a read-only container, a tmpfs or emptyDir on /tmp), or CAPTIONER_BACKEND=torch")


def check_something_to_serve(settings) -> None:
    """Stop, in one line, a server that would find no checkpoint to serve (a mistyped CAPTIONER_WEIGHTS_DIR): it
    started, stayed live and never ready, and a container's health check, on liveness, called it healthy."""
    from captioner.models.checkpoint import find_checkpoints, is_checkpoint

    if find_checkpoints(settings.weights_dir, settings.checkpoints, settings.prefixed_weights_dirs):
        return
    folder = Path(settings.weights_dir)
    if is_checkpoint(folder):  # the folders it holds are served, not itself
        why = (f"{folder} is itself a checkpoint: serve it with CAPTIONER_CHECKPOINTS='[\"{folder}\"]', or give "
               "the folder that holds it to --weights-dir")
    elif not folder.is_absolute() and not folder.exists():
        why = (f"{folder} is read from the working folder ({Path.cwd()}), which has none: run from the checkout, or "
               "set CAPTIONER_WEIGHTS_DIR or --weights-dir to a folder of checkpoints")
    else:
        why = "set CAPTIONER_WEIGHTS_DIR or --weights-dir to a folder of checkpoints, or CAPTIONER_CHECKPOINTS"
    raise SystemExit(f"error: no checkpoint found in {', '.join(settings.checkpoint_folders())}: nothing to serve "
                     f"({why})")


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from .app import create_app
    from .lifecycle import DrainingServer
    from .middleware import configure_logging

    overrides = {k: v for k, v in {"weights_dir": args.weights_dir, "default_model": args.model,
                                    "device": args.device, "host": args.host, "port": args.port,
                                    "log_level": args.log_level, "root_path": args.root_path}.items()
                 if v is not None}
    settings = read_settings(**overrides)
    # a device this machine lacks is the user's mistake, said in one line before the server starts (in the
    # lifespan it was a traceback and uvicorn's "Application startup failed")
    resolve_device(settings.device)
    check_port_free(settings.host, settings.port)
    check_something_to_serve(settings)
    check_onnx_dir_writable(settings)
    # `kill -USR1 PID` writes every thread's stack to stderr: a server that stalls can be looked into while it
    # stalls, without stopping it or installing a profiler
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    configure_logging(settings.log_format, settings.log_level)
    app = create_app(settings)
    # the app writes its own structured access log (with request ids); uvicorn's would duplicate it
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            log_config=None, access_log=False, timeout_graceful_shutdown=settings.drain_timeout_s + 5,
                            timeout_keep_alive=settings.keep_alive_s, root_path=settings.root_path)
    # SIGTERM: readiness and new requests 503 at once, admitted requests finish, exit 0 (lifecycle.py)
    server = DrainingServer(config, app.state.shutdown_gate, settings.drain_timeout_s)
    server.run()
    if not server.started:
        sys.exit(3)  # what uvicorn.run does when start-up fails (e.g. the port is taken)


ARCHIVE_ONLY = ("resume", "shard", "attention", "heatmaps")


def print_json_line(path: str, label: str, result) -> None:
    """``captioner caption --json``'s line for one image: the record an archive's ``--output --attention`` writes
    (the path and the service's caption fields), so the two parse alike, and the checkpoint's ``label`` when several
    are compared (their folder names may coincide: ``weights/sat`` and ``weights/flickr8k/sat``)."""
    from .archive import caption_record

    record = caption_record(path, result, attention=True)
    print(json.dumps({**record, "label": label} if label else record, ensure_ascii=False))


def cmd_caption(args: argparse.Namespace) -> None:
    """``captioner caption``: the models' command for a few images (printed), or, with ``--output``, the archive
    use case (service/archive.py) for folders and lists of any size."""
    given = [f"--{name}" for name in ARCHIVE_ONLY if getattr(args, name) not in (None, False)]
    if args.output is None:
        if given:
            raise SystemExit(f"error: {', '.join(given)} {'needs' if len(given) == 1 else 'need'} --output FILE.jsonl "
                             "(captioning an archive)")
        folders = [path for path in args.images if Path(path).is_dir()]
        if folders:
            raise SystemExit(f"error: {folders[0]} is a folder: caption an archive with --output FILE.jsonl")
        return caption_files(args, show=print_json_line) if args.json else caption_files(args)
    if args.overlay or args.token is not None or args.json:
        raise SystemExit("error: --overlay, --token and --json show a few images; an archive writes --output "
                         "(with --attention or --heatmaps DIR for the attention)")
    if args.checkpoint and len(args.checkpoint) > 1:
        raise SystemExit("error: an archive is captioned by one --checkpoint")
    from captioner.models.decoding import RULE_NAMES

    from .archive import ArchiveError, ArchiveOptions, caption_archive, parse_shard

    try:
        settings = read_settings(**{k: v for k, v in {"device": None if args.device == "auto" else args.device,
                                                      "threads": args.threads}.items() if v is not None})
        options = ArchiveOptions(args.beam_size, args.max_len, args.attention,
                                 Path(args.heatmaps) if args.heatmaps else None, args.readers,
                                 **{rule: getattr(args, rule) for rule in RULE_NAMES})
        run = caption_archive(args.images, Path(args.output), Path((args.checkpoint or [DEFAULT_CHECKPOINT])[0]),
                              settings, options, args.resume, parse_shard(args.shard or "0/1"), args.progress)
    except ArchiveError as exc:
        raise SystemExit(f"error: {exc}") from None
    except KeyboardInterrupt:
        print(f"interrupted: the captions written so far are in {args.output}; run the same command with --resume "
              "to finish", file=sys.stderr)
        raise SystemExit(130) from None
    done = run.summary
    if run.dropped_tail:
        print(f"dropped a torn last line ({run.dropped_tail} bytes) of {args.output}: its image is captioned again",
              file=sys.stderr)
    print(f"{args.output}: {run.already_done + done.captioned} of {run.total} images captioned "
          f"({done.captioned} now at {done.images_per_s:.2f} images/s, {run.already_done} before)"
          + (f"; {done.skipped} unreadable, listed in {run.errors_file}" if done.skipped else ""), file=sys.stderr)


def add_console_caption_arguments(cap: argparse.ArgumentParser) -> None:
    """`caption`'s options that the service's code serves: the archive use case and the JSON record."""
    cap.add_argument("--output", metavar="FILE.jsonl",
                     help="caption an archive: IMAGES are folders (walked recursively), image files or text files "
                          "listing image paths one per line; one JSON line per image is appended here, in the order "
                          "captions finish (unreadable files: FILE.errors.jsonl and stderr)")
    cap.add_argument("--resume", action="store_true",
                     help="continue --output after a crash or Ctrl-C: images it holds are skipped, a torn last line "
                          "is dropped")
    cap.add_argument("--shard", metavar="I/N",
                     help="caption only shard I of N (0-based; by a hash of each path), e.g. a Kubernetes Indexed "
                          "Job's $JOB_COMPLETION_INDEX/N")
    cap.add_argument("--attention", action="store_true",
                     help="with --output: every line also holds the attention rows, geometry and extras (as the "
                          "service answers)")
    cap.add_argument("--heatmaps", metavar="DIR",
                     help="with --output: write each image's per-word figure here; its line names the file")
    cap.add_argument("--readers", type=positive_int, default=2,
                     help="with --output: threads reading and decoding files (default 2)")
    cap.add_argument("--json", action="store_true",
                     help="print each result as a JSON line, with its attention: the fields of --output --attention's "
                          "lines (the service's caption fields)")
    cap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="progress bar with images/s on stderr (default: when stderr is a terminal)")
    cap.set_defaults(func=cmd_caption)


class _DescribedCommands(argparse._SubParsersAction):
    """Subcommands whose own ``--help`` opens with the line their parent's ``--help`` lists them with (argparse
    shows a subcommand's ``help`` in that list only: ``captioner storage --help`` said nothing of what it does)."""

    def add_parser(self, name, **kwargs):
        listed = kwargs.get("help")
        if listed is not None and listed is not argparse.SUPPRESS:  # a help line is %-formatted, a description not
            kwargs.setdefault("description", listed.replace("%%", "%"))
        return super().add_parser(name, **kwargs)


class _Parser(argparse.ArgumentParser):
    """argparse without prefix matching, for every subcommand (they inherit the class): ``captioner eval --encoder
    …`` was read as ``--encoder-precision`` and refused with that option's choices; a misspelt option is named as
    unknown instead, and a later option that shares a prefix cannot change what an old command line means."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _DescribedCommands)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="captioner", description="Attention image captioning: data, training, "
                                     "evaluation and an HTTP service with per-word attention heatmaps.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_commands(sub)
    add_console_caption_arguments(sub.choices["caption"])
    serve = sub.add_parser("serve", help="run the HTTP service (settings from CAPTIONER_* variables; flags win)")
    serve.add_argument("--host", help="bind address (CAPTIONER_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=at_least(1, 65535), help="port (CAPTIONER_PORT, default 8000)")
    serve.add_argument("--weights-dir", help="folder of checkpoint folders, served under their names "
                       "(CAPTIONER_WEIGHTS_DIR, default weights/flickr8k)")
    serve.add_argument("--model", help="default model name (CAPTIONER_DEFAULT_MODEL)")
    serve.add_argument("--device", help="auto, cpu, cuda or cuda:N (CAPTIONER_DEVICE)")
    serve.add_argument("--log-level", help="CAPTIONER_LOG_LEVEL, default info")
    serve.add_argument("--root-path", help="the prefix a reverse proxy serves the app under, e.g. /captioner "
                       "(CAPTIONER_ROOT_PATH, default none)")
    serve.set_defaults(func=cmd_serve)
    return parser


class CommandError(SystemExit):
    """A mistake in the command, said in one line: exit status 2, as for argparse's usage errors, and the line as the
    exception's text (what a caller of :func:`main` sees is what a user sees)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except SystemExit as exc:
        if not isinstance(exc.code, str):  # argparse's usage errors (2), an interrupted run (130), success
            raise
        if os.environ.get("CAPTIONER_DEBUG"):  # where the command stopped, for a bug report
            traceback.print_exc()
        print(exc.code, file=sys.stderr)  # a command's "error: …": the same status as every other mistake
        raise CommandError(exc.code) from None
    except (OSError, ValueError) as exc:
        # a missing file, a bad option value or a foreign dataset: the message says what to change, a traceback
        # would only bury it (CAPTIONER_DEBUG=1 keeps it for a bug report)
        if os.environ.get("CAPTIONER_DEBUG"):
            raise
        print(f"error: {describe_os_error(exc) if isinstance(exc, OSError) else exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C in eval, export, caption, …: the shell's status for it, not a traceback
        if os.environ.get("CAPTIONER_DEBUG"):
            raise
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
