"""Resident set of a server by number of models: the fixed cost (libraries, shared encoders) and the cost of each
further model, so that a growing model zoo can be planned for.

Every configuration is a real ``captioner serve`` process on localhost (``benchmarks/servers.py``), measured after
warm-up (when ``/readyz`` first answers: the models are loaded and warm, and the allocator's free pages are
returned) and again after a short mixed load (``--requests`` captions spread over its models, one at a time):

* ``first start``: the full set below with an empty ONNX folder (exports and the PyTorch reference
  captions of ``auto`` are made during start-up) — what a container with its exports on a tmpfs does at every
  start; left out with ``--onnx-dir``, which names a folder of current exports to use instead;
* the full set, ``five models``, ``one model``: later starts, with current exports.

The full set is what ``make serve`` serves: every checkpoint of the service's default weights folder
(``weights/flickr8k``), made up to nine with some of them again under other names (``<name>-2``, symlinks) where
the folder holds fewer; another name costs what another model of that architecture costs.  The five-model set is
the first five of them.  Per-model cost: (full − five) / (its size − 5); fixed cost: one model's resident set minus
one per-model cost.

Usage: ``python benchmarks/bench_memory.py --json OUT.json [--compare BEFORE.json] [--out docs/benchmarks/memory.md]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import served_default
from reliability import SIZES, jpeg, post
from servers import Server

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ROOT / Path(served_default()).parent  # the folder make serve serves (weights/flickr8k)
OUT = ROOT / "docs" / "benchmarks" / "memory.md"
DUPLICATED = ("aoanet", "xlan", "sat", "sparsecap-softmax")


def weights_dir(root: Path, names: list[str]) -> Path:
    """A folder of checkpoint symlinks: ``NAME`` → WEIGHTS/NAME, ``NAME-2`` → WEIGHTS/NAME."""
    folder = root / f"weights-{len(names)}"
    folder.mkdir()
    for name in names:
        (folder / name).symlink_to(WEIGHTS / name.removesuffix("-2"), target_is_directory=True)
    return folder


def measure(label: str, weights: Path, onnx_dir: Path, threads: str, requests: int, logs: Path,
            server_env: dict[str, str] | None = None) -> dict:
    started = time.perf_counter()
    server = Server(label, [sys.executable, "-m", "captioner.service.cli", "serve", "--weights-dir", str(weights)],
                    {"CAPTIONER_LOG_LEVEL": "warning", "CAPTIONER_THREADS": threads,
                     "CAPTIONER_ONNX_DIR": str(onnx_dir), **(server_env or {})},
                    logs / f"memory-{label.split(' (')[0].replace(' ', '-')}.log")
    try:
        server.wait_ready(timeout_s=3600)  # a start-up on a machine shared with training can take many minutes
        start_s = time.perf_counter() - started
        ready = server.rss()
        status = dict(line.split(":", 1) for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines())
        anon = int(status["RssAnon"].split()[0]) / 1024
        models = [m["name"] for m in httpx.get(f"{server.url}/models", timeout=10).json()]
        backends = {m["name"]: m["backend"] for m in httpx.get(f"{server.url}/models", timeout=10).json()}
        images = [jpeg(*SIZES[i % len(SIZES)], i) for i in range(len(SIZES))]
        latencies = []
        with httpx.Client(base_url=server.url) as client:
            for i in range(requests):
                began = time.perf_counter()
                assert post(client, images[i % len(images)], models[i % len(models)]).status_code == 200
                latencies.append(time.perf_counter() - began)
        # start-up time and latency are kept in the JSON only: on a shared machine they say more about the other
        # work than about the server (compare latency with servers measured in turns, as bench_serving.py does)
        return {"label": label, "models": len(models), "backends": backends, "ready_mib": ready, "anon_mib": anon,
                "after_load_mib": server.rss(), "peak_mib": server.rss("VmHWM"), "start_s": start_s,
                "median_ms": 1000 * statistics.median(latencies)}
    finally:
        server.stop()


def run(threads: str, requests: int, logs: Path, shared_with: str, save, onnx_dir: Path | None = None,
        server_env: dict[str, str] | None = None) -> dict:
    """Measure every configuration; ``save(results)`` after each, so that a long run interrupted keeps its rows."""
    shipped = sorted(p.name for p in WEIGHTS.iterdir() if (p / "model.safetensors").is_file())
    # the duplicated names that weights/ holds today (a retrained zoo may rename some), and the default model
    twice = [f"{name}-2" for name in DUPLICATED if name in shipped][:max(0, 9 - len(shipped))]
    nine, five, one = shipped + twice, shipped[:5], Path(served_default()).name
    results = {"rows": [], "conditions": f"{platform.machine()}, {os.cpu_count()} CPU cores shared with {shared_with}, "
                                         f"CAPTIONER_THREADS={threads}"
                                         + "".join(f", {k}={v}" for k, v in (server_env or {}).items())
                                         + f", no GPU; {time.strftime('%Y-%m-%d')}"}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        root = Path(tmp)
        configurations = [(f"{len(nine)} models", len(nine)), (f"{len(five)} models", len(five)),
                          (f"one model ({one})", 1)]
        if onnx_dir is None:
            onnx_dir = root / "onnx"
            configurations.insert(0, (f"first start ({len(nine)} models, exports made)", len(nine)))
        folders = {len(names): weights_dir(root, names) for names in (nine, five, [one])}
        for label, models in configurations:
            results["rows"].append(measure(label, folders[models], onnx_dir, threads, requests, logs, server_env))
            save(results)
    by = {row["models"]: row for row in results["rows"] if not row["label"].startswith("first start")}
    results["per_model_mib"] = (by[len(nine)]["ready_mib"] - by[len(five)]["ready_mib"]) / (len(nine) - len(five))
    results["fixed_mib"] = by[1]["ready_mib"] - results["per_model_mib"]
    save(results)
    return results


def table(results: dict, title: str) -> list[str]:
    lines = [f"### {title}", "", f"Conditions: {results['conditions']}. Fixed cost ≈ {results['fixed_mib']:.0f} MiB; "
             f"each further model ≈ {results['per_model_mib']:.1f} MiB.", "",
             "| server | models | RSS after warm-up (MiB) | of it anonymous (MiB) | after a short load (MiB) | "
             "peak during start-up and load (MiB) |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['label']} | {r['models']} | {r['ready_mib']:.0f} | {r['anon_mib']:.0f} | "
              f"{r['after_load_mib']:.0f} | "
              f"{r['peak_mib']:.0f} |" for r in results["rows"]]
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=ROOT / ".cache" / "bench-memory.json",
                        help="write this run's numbers here (kept out of docs/: --compare reads an earlier one)")
    parser.add_argument("--compare", type=Path, help="an earlier run's --json, shown first")
    parser.add_argument("--compare-title", default="Before", help="heading of the --compare table")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--threads", default="2")
    parser.add_argument("--requests", type=int, default=18, help="captions after warm-up, one at a time")
    parser.add_argument("--shared-with", default="other work", help="what else ran on the machine (for the report)")
    parser.add_argument("--onnx-dir", type=Path, help="current exports to use (no first-start row)")
    parser.add_argument("--server-env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="settings every server gets, e.g. CAPTIONER_PAGE_OUT_GPU_LIBRARIES=false for a before row")
    parser.add_argument("--render", action="store_true", help="no run: write the document from --json (and --compare)")
    parser.add_argument("--logs", type=Path, default=ROOT / ".cache" / "reliability")
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    if args.render:
        results = json.loads(args.json.read_text())
    else:
        results = run(args.threads, args.requests, args.logs, args.shared_with,
                      lambda partial: args.json.write_text(json.dumps(partial, indent=2)), args.onnx_dir,
                      dict(item.split("=", 1) for item in args.server_env))
    full = max(row["models"] for row in results["rows"])
    lines = ["# Server memory by number of models", "",
             "Regenerated by `python benchmarks/bench_memory.py` (real `captioner serve` processes on localhost; see "
             f"the script's docstring for the configurations). {full} models: what `make serve` serves, every "
             f"checkpoint of {WEIGHTS.relative_to(ROOT)} (made up to nine under other names where it holds fewer).",
             ""]
    if args.compare:
        lines += table(json.loads(args.compare.read_text()), args.compare_title)
    lines += table(results, "After" if args.compare else "This run")
    text = "\n".join(lines)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
