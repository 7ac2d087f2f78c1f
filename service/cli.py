"""The ``captioner`` console script: the models' subcommands plus ``serve``."""

from __future__ import annotations

import argparse
import os

from models.cli import add_commands


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from .app import create_app
    from .settings import Settings

    overrides = {k: v for k, v in {"weights_dir": args.weights_dir, "default_model": args.model,
                                    "device": args.device}.items() if v is not None}
    app = create_app(Settings(**overrides))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="captioner", description="Attention image captioning: data, training, "
                                     "evaluation and an HTTP service with per-word attention heatmaps.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_commands(sub)
    serve = sub.add_parser("serve", help="run the HTTP service (settings also from CAPTIONER_* variables)")
    serve.add_argument("--host", default=os.environ.get("CAPTIONER_HOST", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(os.environ.get("CAPTIONER_PORT", "8000")))
    serve.add_argument("--weights-dir")
    serve.add_argument("--model", help="default model name")
    serve.add_argument("--device")
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
