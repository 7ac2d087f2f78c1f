"""Framework overhead of serving: the whole HTTP path of ``POST /caption`` (multipart upload, image decoding and
preprocessing, admission, the continuous batcher, the result, the JSON answer with its attention rows) with a
model whose compute is negligible, against an echo server, in one run on one machine.

There is no model: the servers run :func:`recorded_rows_runtime`, which answers every decoding step with recorded
rows (log-probabilities by previous token, an attention row over the default model's 16×16 grid, so the answers
carry as many attention values per word as the default model's) and runs no CNN.  A tiny random checkpoint was
tried first: even a 24-unit LSTM computes SAT's attention context over 256 cells of 320-d features for every row
and copies those features as requests join and leave the tables, and that was most of the server's CPU.  What
is measured is the service's own work: the upload, decoding and resizing the image (the same 640×480 JPEG scenes
as ``bench_serving.py``'s, resized to 32 pixels here), the batcher's beam steps, tables and results, and the
answer.

Configurations, each a real ``captioner serve`` on localhost, started side by side and measured in turns with the
closed-loop load generator of ``bench_serving.py``:

* ``before``: every speed-up of issue 30 switched off (:data:`BEFORE`: the request path as it was);
* ``after``: the shipped defaults;
* ``after, attention_format=float16-base64``: the same server, its clients asking for packed attention maps;
* one row per speed-up switched off alone (``after, without X``), where ``--ablations`` asks for them;
* ``echo server (no model)``: the load generator's own ceiling, a server that reads each upload and returns the
  recorded answer of ``before`` (one window per point, after the others).

The number this benchmark moves is the overhead ratio: requests/s of a configuration ÷ the echo server's, at the
largest client count.  With ``--profile`` each configuration is then sampled by ``py-spy`` (``--gil``: only the
thread holding the interpreter lock is sampled, so the shares say who holds the lock) under the same load, and the
report gains a table of where the lock's time goes, before and after.

Usage: ``python benchmarks/bench_serving_overhead.py [--device cpu|cuda] [--profile] [--quick]``; writes
``docs/benchmarks/serving-overhead.md`` on a CPU and ``docs/benchmarks/serving-overhead-gpu.md`` on a GPU.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_serving import BEAM, MAX_LEN, latency_table_ms, load, measure_servers, scene_jpegs, \
    throughput_table_ms  # noqa: E402
from common import checkpoint, command_line, default_model  # noqa: E402
from servers import Server, stop_on_sigterm  # noqa: E402

OUT = {"cpu": ROOT / "docs" / "benchmarks" / "serving-overhead.md",
       "cuda": ROOT / "docs" / "benchmarks" / "serving-overhead-gpu.md"}
ECHO = "echo server (no model)"
PACKED_ROW = "after, attention_format=float16-base64"
#: the settings that switch issue 30's speed-ups off, each with what it switches off (docs/decisions.md,
#: "Serving overhead (issue 30)")
BEFORE: dict[str, tuple[str, str]] = {
    "CAPTIONER_JSON_ENCODER": ("pydantic", "the JSON answer written by orjson"),
}
#: where the lock's time goes: a stage and the frames (substrings of py-spy's "function (file:line)") that mark it,
#: first match from the innermost frame outwards
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("JSON answer (schema, serialising)", ("schemas.py", "serialize_response", "jsonable_encoder", "orjson",
                                           "fastapi/encoders", "json/encoder", "render (starlette")),
    ("image decoding and preprocessing", ("load_image", "preprocess (", "decode_and_prepare")),
    ("multipart parsing and upload", ("formparsers", "python_multipart", "multipart/")),
    ("batcher: decoding steps and results", ("batcher.py",)),
    ("HTTP protocol and middleware (uvicorn, h11, starlette)", ("uvicorn", "h11", "httptools", "starlette",
                                                                "middleware.py", "security.py", "lifecycle.py")),
    ("event loop and threads", ("asyncio", "threading", "concurrent/futures", "anyio")),
]


def tiny_checkpoint(folder: Path, like: str) -> Path:
    """A random SAT whose compute is negligible but whose answers are the size of ``like``'s: its vocabulary, and
    a 16×16 grid (256 attention values per word) pooled from a 32-pixel CNN input."""
    import torch

    from captioner.models.checkpoint import load_checkpoint, save_checkpoint
    from captioner.models.encoder import EncoderSpec
    from captioner.models.zoo import create

    reference = load_checkpoint(checkpoint(like), "cpu")
    grid = reference.encoder.grid_hw[0]
    torch.manual_seed(0)
    model = create("sat", vocab_size=len(reference.vocab), feat_dim=320, embed_dim=16, hidden_dim=24, attn_dim=12,
                   dropout=0.0).eval()
    return save_checkpoint(folder / "tiny-sat", model, reference.vocab,
                           EncoderSpec(image_size=32, layer="blocks", pooled_grid=grid))


def recorded_rows_runtime(runtime):
    """``runtime`` (a :class:`~captioner.models.inference.TorchRuntime` of :func:`tiny_checkpoint`) with the
    model's arithmetic replaced by recorded rows: no CNN, and every decoding step answers, for each row, the
    log-probabilities recorded for its previous token and an attention row of the grid's 256 cells, so that what
    remains is the service's own work per request and per step (upload, decoding and resizing the image, the
    batcher's beam steps, tables and results, the answer).  Captions are deterministic: a token's successors are
    fixed, and the end of a caption comes where the recorded table puts it."""
    import torch

    from captioner.models.inference import TorchRuntime
    from captioner.models.protocol import AttnRecord

    generator = torch.Generator().manual_seed(0)
    vocab, cells = len(runtime.ckpt.vocab), runtime.spec.grid_hw[0] * runtime.spec.grid_hw[1]
    logprobs = torch.log_softmax(6 * torch.randn(vocab, vocab, generator=generator), dim=1).to(runtime.device)
    attention = torch.softmax(torch.randn(vocab, cells, generator=generator), dim=1).to(runtime.device)

    class RecordedRows(TorchRuntime):
        def begin(self, batch, widths):
            rows = sum(widths)
            return {"rows": torch.zeros(rows, 1, device=self.device)}, {"last": torch.zeros(rows, 1,
                                                                                           device=self.device)}

        def step(self, prev, state, enc):
            return logprobs.index_select(0, prev), state, AttnRecord(attention.index_select(0, prev))

        def reorder(self, state, index):
            return {key: value.index_select(0, index) for key, value in state.items()}

    return RecordedRows(runtime.name, runtime.ckpt, None, runtime.device)


def serve_recorded_rows(argv: list[str]) -> None:
    """``captioner serve ARGV`` with every loaded model's runtime replaced by :func:`recorded_rows_runtime`."""
    from captioner.service import app
    from captioner.service.cli import main as captioner

    iter_runtimes = app.iter_runtimes

    def recorded(*args, **kwargs):
        for name, runtime in iter_runtimes(*args, **kwargs):
            yield name, recorded_rows_runtime(runtime)

    app.iter_runtimes = recorded
    captioner(["serve", *argv])


def machine(device: str, threads: int) -> str:
    import torch

    if device.startswith("cuda"):
        gpu = torch.cuda.get_device_properties(0)
        where = (f"{gpu.name} ({gpu.total_memory / 2**30:.0f} GiB), torch {torch.__version__} "
                 f"(CUDA {torch.version.cuda})")
    else:
        where = f"CPU only, torch {torch.__version__}"
    return (f"{where}, {os.cpu_count()} CPU cores, {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}; {threads} intra-op thread(s) per server")


# -- profile --------------------------------------------------------------------------------------------------------
def profile(server: Server, bodies: list[bytes], clients: int, seconds: float, out: Path,
            clients_per_process: int | None) -> Path | None:
    """py-spy samples of ``server`` (only the thread holding the interpreter lock) while ``clients`` load it for
    ``seconds``; the collapsed stacks go to ``out``.  None when py-spy is not installed or cannot attach."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return None
    loader = threading.Thread(target=load, args=(server.url, bodies, clients, seconds + 4, 60, clients_per_process,
                                                 server.params))
    loader.start()
    time.sleep(2)
    done = subprocess.run([spy, "record", "--pid", str(server.proc.pid), "--duration", str(int(seconds)), "--gil",
                           "--rate", "200", "--format", "raw", "--output", str(out), "--nonblocking"],
                          capture_output=True, text=True)
    loader.join()
    if done.returncode != 0 or not out.exists():
        print(f"py-spy failed on {server.name}: {done.stderr[-500:]}", file=sys.stderr)
        return None
    return out


def cpu_per_request(server: Server, bodies: list[bytes], clients: int, seconds: float,
                    clients_per_process: int | None) -> float:
    """CPU seconds the server process spends per answered request under ``clients`` (every thread: the event
    loop, the thread pool, the batcher, native code): unlike the throughput, it hardly depends on what else the
    machine runs."""
    before = server.cpu_seconds()
    measured = load(server.url, bodies, clients, seconds, 60, clients_per_process, server.params)
    spent = server.cpu_seconds() - before
    # the load generator's unmeasured first request per client and the last ones answered after the window count too
    return spent / (len(measured["latencies"]) + sum(measured["failures"].values()) + clients)


def stage_shares(collapsed: Path) -> tuple[dict[str, float], int]:
    """Share of the samples (lock held) by :data:`STAGES`, from py-spy's collapsed stacks, and how many samples
    there were (none where py-spy never saw a thread of the server holding the lock)."""
    counts: collections.Counter = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames, n = stack.split(";")[::-1], int(count)
        total += n
        counts[next((stage for frame in frames for stage, marks in STAGES if any(m in frame for m in marks)),
                    "other")] += n
    return {stage: counts[stage] / total if total else 0.0 for stage, _ in [*STAGES, ("other", ())]}, total


# -- report ---------------------------------------------------------------------------------------------------------
def report(args, host: str, started: datetime.datetime, names: list[str], latency: dict, results: dict,
           costs: dict[str, float], profiles: dict[str, tuple[dict[str, float], int]], checks: dict[str, bool],
           seconds: float) -> list[str]:
    top = max(args.clients)

    def tput(name: str, clients: int = top) -> float:
        return results[name][clients]["throughput"]

    lines = [
        f"# Serving overhead ({'GPU' if args.device.startswith('cuda') else 'CPU'}): the request path without a model",
        "",
        f"Generated by `{args.command}` on {started:%Y-%m-%d %H:%M} UTC (one run; every number below comes from it).",
        "",
        f"Machine: {host}.",
        "",
        f"Model: none: recorded rows (the `{args.model}` vocabulary, a 16×16 grid: 256 attention values per word; "
        "each step answers the log-probabilities recorded for a row's previous token, no CNN), beam "
        f"{BEAM}, max_len {MAX_LEN}, on `{args.device}`; what is measured is the service's own work: the upload, "
        "decoding and resizing the image, the batcher's beam steps, tables and results, and the answer. Requests: "
        "multipart JPEG uploads of generated 640×480 scenes, cycling through 16 (benchmarks/"
        "bench_serving_overhead.py's docstring).",
        "",
        "Configurations: `before` has every speed-up of issue 30 switched off "
        f"({', '.join(f'`{k}={v[0]}`' for k, v in BEFORE.items())}); `after` is the shipped defaults; "
        f"`{PACKED_ROW}` is `after` with its clients asking for packed attention maps"
        + ("; `after, without X` switches one speed-up off." if args.ablations else "."),
        "",
        f"## Overhead ratio ({top} clients): requests/s ÷ the echo server's",
        "",
        "| configuration | throughput (req/s) | ÷ echo server | ÷ before | server CPU per request (ms) | ÷ before |",
        "|---|---|---|---|---|---|",
        *[f"| {name} | {tput(name):.1f} | {tput(name) / tput(ECHO):.3f} | {tput(name) / tput('before'):.2f}× | "
          f"{1000 * costs[name]:.1f} | {costs[name] / costs['before']:.2f}× |" for name in names],
        f"| {ECHO} | {tput(ECHO):.1f} | 1.000 | | | |",
        "",
        "Server CPU per request: the CPU time of the server process (all its threads) in a separate closed loop of "
        f"{args.window / 2:g} s at {top} clients, divided by the requests it answered; it depends far less than the "
        "throughput on what else the machine runs.",
        "",
        *(["GPU rows: docs/benchmarks/serving-overhead-gpu.md, written by the same benchmark on a GPU "
           "(`bash benchmarks/gpu_session.sh`, the prepared device call); absent: not measured on a GPU yet.", ""]
          if not args.device.startswith("cuda") else []),
        f"Aim (issue 30): the `after` ÷ echo ratio at least twice `before`'s: "
        f"{tput('after') / tput('before'):.2f}× — {'met' if tput('after') >= 2 * tput('before') else '**not met**'}.",
        "",
        *latency_table_ms(latency, args.rounds),
        "",
        f"## Throughput (closed loop, {args.window:g} s per point in two halves, configurations in turns)",
        "",
        *throughput_table_ms(results),
    ]
    if profiles:
        shown = [name for name in names if name in profiles]
        lines += ["", f"## Where the interpreter lock goes ({top} clients, py-spy `--gil`, {args.profile_s:g} s each)",
                  "", "Share of the samples taken while a thread of the server held the lock, by the innermost frame "
                  "that marks a stage (benchmarks/bench_serving_overhead.py's `STAGES`).", ""]
        if any(profiles[n][1] for n in shown):
            lines += ["| stage | " + " | ".join(shown) + " |", "|---|" + "---|" * len(shown),
                      "| samples | " + " | ".join(str(profiles[n][1]) for n in shown) + " |"]
            for stage in profiles[shown[0]][0]:
                lines.append(f"| {stage} | " + " | ".join(f"{profiles[n][0][stage]:.0%}" for n in shown) + " |")
        else:  # an empty table read as "nothing held the lock"; it means py-spy saw nothing
            lines.append("No samples: py-spy attached to each server but never saw one of its threads holding the "
                         "lock, so there are no shares to report.")
    lines += ["", "## Checks", "",
              *[f"- {label}: {'same answers' if ok else '**answers differ**'} on 4 test scenes (every field; "
                f"attention maps as {'float16' if label.startswith(PACKED_ROW) else 'float32'})"
                for label, ok in checks.items()],
              "", f"Command: `{args.command}`. Total benchmark time: {seconds:.0f} s.", ""]
    return lines


PACKED = {"attention_format": "float16-base64"}


def _answers(server: Server, bodies: list[bytes]) -> list[dict]:
    """``server``'s answers to the first 4 ``bodies`` (with its query parameters), without their ids."""
    import httpx

    answers = []
    for body in bodies[:4]:
        response = httpx.post(f"{server.url}/caption", params={"beam_size": BEAM, "max_len": MAX_LEN, **server.params},
                              files={"file": ("s.jpg", body, "image/jpeg")}, timeout=120)
        response.raise_for_status()
        answers.append({k: v for k, v in response.json().items() if k != "id"})
    return answers


def _maps_as(answer: dict, dtype: str) -> dict:
    """``answer`` with its attention maps as lists of ``dtype`` numbers (packed maps unpacked): float32 for
    answers whose writers differ only in how many digits they give, float16 to compare packed maps."""
    import base64

    import numpy as np

    def values(value):
        if isinstance(value, dict):  # PackedRows
            value = np.frombuffer(base64.b64decode(value["data"]), "<f2").reshape(value["shape"])
        return np.asarray(value, dtype=np.float64).astype(dtype).tolist()

    return {**answer, "attention": values(answer["attention"]),
            "extras": {k: values(v) for k, v in answer["extras"].items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=default_model(), help="whose vocabulary and grid the tiny model takes")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per server")
    parser.add_argument("--window", type=float, default=8.0, help="measured seconds per point")
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=20, help="requests per server in the 1-client latency turns")
    parser.add_argument("--clients-per-process", type=int, default=0,
                        help="the load generator's clients per process (0: all in one; 8 on a GPU machine)")
    parser.add_argument("--ablations", action="store_true", help="also each speed-up switched off alone")
    parser.add_argument("--try", dest="tries", nargs="+", default=[], metavar="NAME:VAR=VALUE[,VAR=VALUE]",
                        help="extra rows: the shipped defaults with these settings, e.g. 'serial CNN:"
                             "CAPTIONER_OVERLAP_ENCODING=false'")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="py-spy each configuration under load (where py-spy is installed and may attach)")
    parser.add_argument("--profile-s", type=float, default=6.0, help="seconds of py-spy sampling per configuration")
    parser.add_argument("--quick", action="store_true", help="short windows (smoke test; not for the table)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.command = command_line("bench_serving_overhead.py", parser, args)
    stop_on_sigterm()
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    args.out = args.out or OUT[kind]
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench_serving_overhead: no CUDA GPU on this machine; nothing measured")
            return
    if args.quick:
        args.window, args.rounds, args.profile_s = 2.0, 4, 2.0
    began, started = time.perf_counter(), datetime.datetime.now(datetime.timezone.utc)
    host = machine(args.device, args.threads)
    bodies = scene_jpegs(16)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-serving-overhead-"))
    print(f"server logs in {log_dir}", file=sys.stderr)
    only = log_dir / "weights"
    only.mkdir()
    folder = tiny_checkpoint(log_dir, args.model)
    serve = [sys.executable, str(Path(__file__).resolve()), "--recorded-rows-server", "--weights-dir", str(only)]
    base = {"CAPTIONER_CHECKPOINTS": json.dumps([str(folder)]), "CAPTIONER_THREADS": str(args.threads),
            "CAPTIONER_DEVICE": args.device, "CAPTIONER_DEFAULT_MODEL": folder.name, "CAPTIONER_QUEUE_SIZE": "256",
            "CAPTIONER_LOG_LEVEL": "warning", "CAPTIONER_BACKEND": "torch", "CAPTIONER_ONNX_DIR": str(log_dir / "onnx")}
    configs = {"before": ({k: v for k, (v, _) in BEFORE.items()}, {}), "after": ({}, {}),
               PACKED_ROW: ({}, PACKED)}
    for spec in args.tries:
        name, _, assignments = spec.partition(":")
        configs[name] = (dict(item.split("=", 1) for item in assignments.split(",") if item), {})
    if args.ablations and len(BEFORE) > 1:
        configs.update({f"after, without {what}": ({k: v}, {}) for k, (v, what) in BEFORE.items()})
    servers = [Server(name, serve, {**base, **env}, log_dir / f"{name.replace(', ', '-').replace(' ', '_')}.log",
                      params) for name, (env, params) in configs.items()]
    per_process = args.clients_per_process or None
    profiles: dict[str, dict[str, float]] = {}
    try:
        if args.profile:  # sampled before the measurement, on servers of their own (the measurement stops its servers)
            for server in servers:
                server.wait_ready()
            for server in servers:
                sampled = profile(server, bodies, max(args.clients), args.profile_s,
                                  log_dir / f"{server.name.replace(', ', '-')}.pyspy.txt", per_process)
                if sampled is not None:
                    profiles[server.name] = stage_shares(sampled)
                print(f"{server.name}: profiled ({'py-spy' if sampled else 'no py-spy'})", file=sys.stderr)
        for server in servers:
            server.wait_ready()
        answers = {server.name: _answers(server, bodies) for server in servers}
        costs = {}
        for server in servers:
            costs[server.name] = cpu_per_request(server, bodies, max(args.clients), args.window / 2, per_process)
            print(f"{server.name}: {1000 * costs[server.name]:.2f} ms of server CPU per request", file=sys.stderr)
        _, latency, results = measure_servers(servers, bodies, args.clients, args.window, args.rounds, check_count=1,
                                              timeout_s=60, clients_per_process=per_process, echo=ECHO)
    finally:  # measure_servers stops them too; this is for a failure (or a SIGTERM) before it does
        for server in servers:
            server.stop()
    checks = {}
    for name, got in answers.items():
        dtype = "float16" if name == PACKED_ROW else "float32"
        if name != "before":
            checks[f"{name} vs before"] = ([_maps_as(a, dtype) for a in got]
                                           == [_maps_as(a, dtype) for a in answers["before"]])
    lines = report(args, host, started, list(configs), latency, results, costs, profiles, checks,
                   time.perf_counter() - began)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--recorded-rows-server"]:  # a server of this benchmark (see main's configurations)
        serve_recorded_rows(sys.argv[2:])
    else:
        main()
