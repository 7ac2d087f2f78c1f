"""The ``captioner`` console script: the models' subcommands (``export`` included) plus ``serve``."""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys

from captioner.models.cli.commands import add_commands


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from .app import create_app
    from .lifecycle import DrainingServer
    from .middleware import configure_logging
    from .settings import Settings

    overrides = {k: v for k, v in {"weights_dir": args.weights_dir, "default_model": args.model,
                                    "device": args.device, "host": args.host, "port": args.port,
                                    "log_level": args.log_level}.items() if v is not None}
    settings = Settings(**overrides)
    # `kill -USR1 PID` writes every thread's stack to stderr: a server that stalls can be looked into while it
    # stalls, without stopping it or installing a profiler
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    configure_logging(settings.log_format, settings.log_level)
    app = create_app(settings)
    # the app writes its own structured access log (with request ids); uvicorn's would duplicate it
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            access_log=False, timeout_graceful_shutdown=settings.drain_timeout_s + 5,
                            timeout_keep_alive=settings.keep_alive_s)
    # SIGTERM: readiness and new requests 503 at once, admitted requests finish, exit 0 (lifecycle.py)
    server = DrainingServer(config, app.state.shutdown_gate, settings.drain_timeout_s)
    server.run()
    if not server.started:
        sys.exit(3)  # what uvicorn.run does when start-up fails (e.g. the port is taken)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="captioner", description="Attention image captioning: data, training, "
                                     "evaluation and an HTTP service with per-word attention heatmaps.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_commands(sub)
    serve = sub.add_parser("serve", help="run the HTTP service (settings from CAPTIONER_* variables; flags win)")
    serve.add_argument("--host", help="bind address (CAPTIONER_HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (CAPTIONER_PORT, default 8000)")
    serve.add_argument("--weights-dir", help="checkpoint folder (CAPTIONER_WEIGHTS_DIR, default weights)")
    serve.add_argument("--model", help="default model name (CAPTIONER_DEFAULT_MODEL)")
    serve.add_argument("--device", help="auto, cpu or cuda (CAPTIONER_DEVICE)")
    serve.add_argument("--log-level", help="CAPTIONER_LOG_LEVEL, default info")
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (OSError, ValueError) as exc:
        # a missing file, a bad option value or a foreign dataset: the message says what to change, a traceback
        # would only bury it (CAPTIONER_DEBUG=1 keeps it for a bug report)
        if os.environ.get("CAPTIONER_DEBUG"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
