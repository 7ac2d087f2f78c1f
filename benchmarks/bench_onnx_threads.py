"""ONNX Runtime's idle threads: sleeping (shipped) against spinning (ONNX Runtime's default), side by side in one run.

Two real ``captioner serve`` processes of one model (``--model``, default: the service's default model) on ONNX
Runtime, each with ONNX Runtime's own intra-op thread pools (``--threads``, default: one per core, what ``make
serve`` runs with): ``threads sleep`` as shipped (``session.intra_op.allow_spinning = 0`` in
``models/export/sessions.py``), and ``threads spin``, the same server with ONNX Runtime's default put back (this
script's ``--spinning-server`` mode, which changes nothing else).  They start together and are measured in turns
with ``bench_serving.py``'s load generator: one-client latency alternating request by request, then closed-loop
throughput, plus the server CPU spent per answered request, which depends least on what else the machine runs.
The answers of both must be the same (spinning changes how a thread waits, not what it computes).

Why: docs/decisions.md, "ONNX Runtime threads that do not spin".  The serving benchmark (``bench_serving.py``)
runs its servers at one thread, where there is no pool to spin.

Usage: ``python benchmarks/bench_onnx_threads.py [--model NAME] [--threads N] [--quick]``; writes
``docs/benchmarks/onnx-threads.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_serving import ONNX_DIR, latency_table_ms, machine, measure_servers, throughput_table_ms, \
    upload_jpegs  # noqa: E402
from bench_serving_overhead import cpu_per_request  # noqa: E402
from common import checkpoint, command_line, publish, served_default  # noqa: E402
from servers import Server, stop_on_sigterm  # noqa: E402

OUT = ROOT / "docs" / "benchmarks" / "onnx-threads.md"
SHIPPED, SPINNING = "threads sleep (shipped)", "threads spin (ONNX Runtime's default)"


def serve_spinning(argv: list[str]) -> None:
    """``captioner serve ARGV`` with every ONNX Runtime session's idle threads spinning, as ONNX Runtime has them
    by default: the project's session options, that one entry put back."""
    from captioner.models.export import sessions
    from captioner.service.cli import main as captioner

    shipped = sessions.session_options

    def spinning(threads: int | None = None, quiet: bool = False):
        options = shipped(threads, quiet)
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        return options

    sessions.session_options = spinning
    captioner(["serve", *argv])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=served_default(), help="checkpoint: a folder under weights/ or a path "
                        "(default: the checkpoint the service answers with when a request names no model)")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads per session (0: one per core)")
    parser.add_argument("--window", type=float, default=10.0, help="measured seconds per throughput point")
    parser.add_argument("--clients", type=int, nargs="+", default=[8])
    parser.add_argument("--rounds", type=int, default=40, help="requests per server in the 1-client latency turns")
    parser.add_argument("--quick", action="store_true", help="short windows (smoke test; not for the table)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.command = command_line("bench_onnx_threads.py", parser, args)
    stop_on_sigterm()
    if args.quick:
        args.window, args.rounds = 3.0, 6
    clock, started = time.perf_counter(), datetime.datetime.now(datetime.timezone.utc)
    host = machine()
    bodies, uploads = upload_jpegs(args.model, 16)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-onnx-threads-"))
    print(f"server logs in {log_dir}", file=sys.stderr)
    folder = checkpoint(args.model)
    # exported once, before any timing (each server would otherwise export at its start)
    subprocess.run([sys.executable, "-m", "captioner.service.cli", "export", "--out", str(ONNX_DIR), str(folder)],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    only = log_dir / "weights"
    only.mkdir()
    options = ["--weights-dir", str(only)]
    env = {"CAPTIONER_CHECKPOINTS": json.dumps([str(folder)]), "CAPTIONER_DEVICE": "cpu",
           "CAPTIONER_DEFAULT_MODEL": folder.name, "CAPTIONER_QUEUE_SIZE": "256", "CAPTIONER_LOG_LEVEL": "warning",
           "CAPTIONER_ONNX_DIR": str(ONNX_DIR), "CAPTIONER_BACKEND": "onnx",
           **({"CAPTIONER_THREADS": str(args.threads)} if args.threads else {})}
    servers = [Server(SHIPPED, [sys.executable, "-m", "captioner.service.cli", "serve", *options], env,
                      log_dir / "sleep.log"),
               Server(SPINNING, [sys.executable, str(Path(__file__).resolve()), "--spinning-server", *options], env,
                      log_dir / "spin.log")]
    try:
        for server in servers:
            server.wait_ready()
        costs = {}
        for half in range(2):  # in turns, as the other measurements
            for server in servers if half == 0 else servers[::-1]:
                costs.setdefault(server.name, []).append(
                    1000 * cpu_per_request(server, bodies, max(args.clients), args.window / 2, None))
        captions, latency, results = measure_servers(servers, bodies, args.clients, args.window, args.rounds)
    finally:  # measure_servers stops them too; this is for a failure (or a SIGTERM) before it does
        for server in servers:
            server.stop()
    cpu = {name: sum(halves) / len(halves) for name, halves in costs.items()}
    top = max(args.clients)
    lines = [
        "# ONNX Runtime's idle threads: sleeping against spinning",
        "",
        f"Generated by `{args.command}` on {started:%Y-%m-%d %H:%M} UTC (one run; every number below comes from "
        "it).",
        "",
        f"Model `{args.model}` on ONNX Runtime (CPU), {args.threads or os.cpu_count()} intra-op thread(s) per "
        f"session, uploads: {uploads}, beam 3, max_len 20. Machine: {host}.",
        "",
        "Two servers side by side, identical but for the idle threads of every ONNX Runtime session: "
        f"`{SHIPPED}` (`session.intra_op.allow_spinning = 0`) and `{SPINNING}`. Why: docs/decisions.md, "
        "\"ONNX Runtime threads that do not spin\". Captions of both the same: "
        f"{'yes' if captions[SHIPPED] == captions[SPINNING] else '**no**'}.",
        "",
        "| configuration | server CPU per request (ms), " f"{top} clients | ratio to spinning |",
        "|---|---|---|",
        *[f"| {name} | {cpu[name]:.1f} | {cpu[name] / cpu[SPINNING]:.2f} |" for name in (SHIPPED, SPINNING)],
        "",
        *latency_table_ms(latency, args.rounds),
        "",
        "## Throughput (closed loop, each point in two halves with the servers in turns)",
        "",
        *throughput_table_ms(results),
        "",
        f"Throughput at {top} clients, sleeping ÷ spinning: "
        f"{results[SHIPPED][top]['throughput'] / results[SPINNING][top]['throughput']:.2f}×; one-client p50 latency, "
        f"sleeping ÷ spinning: {latency[SHIPPED]['p50'] / latency[SPINNING]['p50']:.2f}.",
        "",
    ]
    publish(args.out, lines, clock)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--spinning-server"]:  # the second configuration's server (see main)
        serve_spinning(sys.argv[2:])
    else:
        main()
