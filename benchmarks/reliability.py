"""Reliability runs against real ``captioner serve`` processes on localhost, written to docs/reliability.md.

``make reliability`` (or ``python benchmarks/reliability.py``) runs, each against its own server with every
shipped checkpoint (weights/*):

1. **memory**: the resident set after warm-up with ``CAPTIONER_RELEASE_MEMORY=false`` (before the memory work)
   and ``true`` (after), side by side in one run, then after a short mixed load;
2. **hostile corpus**: every kind of ``tests/hostile_images.py`` (loaded by file path: benchmarks never import
   the ``tests`` package) to ``/caption`` and ``/caption/overlay``; statuses, 5xx count, peak RSS;
3. **overload**: capacity measured with one client, then a fixed-duration open-loop burst at ``--overload``×
   capacity; only 200 / 429 / 503 (with Retry-After) are acceptable, admitted requests must finish within the
   request deadline; then the time until single-request latency is back within 1.5× its pre-burst median;
4. **soak**: ``--soak`` requests over every model and mixed image sizes, some cancelled mid-request by a
   client-side timeout, RSS sampled over time; growth is measured from the end of the first tenth.

Everything is bounded (fixed request counts and durations) and stops by itself.  Numbers depend on the machine
and on what else runs on it; the document records the conditions.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import io
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image
from servers import Server

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ROOT / "weights"
OUT = ROOT / "docs" / "reliability.md"
ACCEPTABLE_UNDER_LOAD = {200, 429, 503}


def load_corpus_module():
    """``tests/hostile_images.py`` by file path (the corpus is test data; benchmarks do not import ``tests``)."""
    spec = importlib.util.spec_from_file_location("hostile_images", ROOT / "tests" / "hostile_images.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["hostile_images"] = module
    spec.loader.exec_module(module)
    return module


def start_server(env: dict[str, str], log: Path) -> Server:
    """A server with every shipped checkpoint, ready, with ``.models`` naming them."""
    server = Server("server", [sys.executable, "-m", "captioner.service.cli", "serve", "--weights-dir", str(WEIGHTS)],
                    {"CAPTIONER_LOG_LEVEL": "warning", **env}, log)
    server.wait_ready()
    server.models = [m["name"] for m in httpx.get(f"{server.url}/models", timeout=10).json()]
    return server


def jpeg(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="JPEG", quality=85)
    return buffer.getvalue()


SIZES = [(64, 64), (320, 240), (640, 480), (1024, 768), (1600, 1200), (200, 1000)]


def post(client: httpx.Client, data: bytes, model: str | None = None, timeout: float | None = None):
    return client.post("/caption", params={"model": model} if model else None,
                       files={"file": ("x.jpg", data, "image/jpeg")}, timeout=timeout or 120)


# -- 1. memory -----------------------------------------------------------------------------------------------------
def memory_run(threads: str, logs: Path) -> dict:
    out = {}
    for release in ("false", "true"):
        server = start_server({"CAPTIONER_RELEASE_MEMORY": release, "CAPTIONER_THREADS": threads}, logs / f"mem-{release}.log")
        try:
            ready = server.rss()
            images = [jpeg(*SIZES[i % len(SIZES)], i) for i in range(12)]
            latencies = []
            with httpx.Client(base_url=server.url) as client:
                for i in range(3 * len(server.models)):
                    started = time.perf_counter()
                    assert post(client, images[i % 12], server.models[i % len(server.models)]).status_code == 200
                    latencies.append(time.perf_counter() - started)
            out[release] = {"ready": ready, "after_load": server.rss(), "peak": server.rss("VmHWM"),
                            "median_ms": 1000 * statistics.median(latencies), "models": len(server.models)}
        finally:
            server.stop()
    return out


# -- 2. hostile corpus ---------------------------------------------------------------------------------------------
def corpus_run(server: Server) -> dict:
    corpus = load_corpus_module().hostile_corpus(40_000_000)
    statuses: dict[int, int] = {}
    before = server.rss()
    with httpx.Client(base_url=server.url, timeout=300) as client:
        for upload in corpus:
            for endpoint, params in (("/caption", None), ("/caption/overlay", {"format": "json", "max_side": 1024})):
                response = client.post(endpoint, params=params,
                                       files={"file": (upload.filename, upload.data, upload.content_type)})
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        alive = client.get("/readyz").status_code == 200
    return {"kinds": len(corpus), "requests": sum(statuses.values()), "statuses": statuses,
            "5xx": sum(n for s, n in statuses.items() if s >= 500), "alive": alive, "rss_before": before,
            "peak": server.rss("VmHWM"), "after": server.rss()}


# -- 3. overload -----------------------------------------------------------------------------------------------------
async def _timed(client: httpx.AsyncClient, data: bytes, model: str, results: list, timeout: float) -> None:
    started = time.perf_counter()
    try:
        response = await client.post("/caption", params={"model": model}, files={"file": ("x.jpg", data, "image/jpeg")},
                                     timeout=timeout)
        results.append((response.status_code, time.perf_counter() - started,
                        "retry-after" in response.headers))
    except httpx.HTTPError as exc:
        results.append((type(exc).__name__, time.perf_counter() - started, False))


def overload_run(server: Server, factor: float, duration_s: float, deadline_s: float) -> dict:
    model = server.models[0]
    image = jpeg(640, 480, 1)
    with httpx.Client(base_url=server.url) as client:
        baseline = []
        for _ in range(8):
            started = time.perf_counter()
            assert post(client, image, model).status_code == 200
            baseline.append(time.perf_counter() - started)
    base_median = statistics.median(baseline)
    capacity = 1 / base_median  # one client, back to back: a lower bound of what batching achieves
    rate = factor * capacity

    async def burst() -> list:
        results: list = []
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=server.url, limits=limits) as client:
            tasks, started = [], time.perf_counter()
            sent = 0
            while (now := time.perf_counter() - started) < duration_s:
                while sent < now * rate:
                    tasks.append(asyncio.create_task(_timed(client, image, model, results, deadline_s + 30)))
                    sent += 1
                await asyncio.sleep(0.005)
            await asyncio.gather(*tasks)
        return results

    peak_before = server.rss()
    results = asyncio.run(burst())
    burst_end = time.perf_counter()
    recovery = None
    with httpx.Client(base_url=server.url) as client:
        while time.perf_counter() - burst_end < 120:
            started = time.perf_counter()
            response = post(client, image, model)
            latency = time.perf_counter() - started
            if response.status_code == 200 and latency <= 1.5 * base_median:
                recovery = time.perf_counter() - burst_end
                break
            time.sleep(0.2)
    statuses: dict = {}
    for status, _, _ in results:
        statuses[status] = statuses.get(status, 0) + 1
    admitted = [latency for status, latency, _ in results if status == 200]
    rejected_without_retry = sum(1 for status, _, retry in results if status in (429, 503) and not retry)
    return {"capacity_rps": capacity, "rate_rps": rate, "duration_s": duration_s, "sent": len(results),
            "statuses": statuses, "unexpected": sum(n for s, n in statuses.items() if s not in ACCEPTABLE_UNDER_LOAD),
            "rejected_without_retry_after": rejected_without_retry,
            "admitted_p50_s": statistics.median(admitted) if admitted else None,
            "admitted_max_s": max(admitted) if admitted else None, "deadline_s": deadline_s,
            "over_deadline": sum(1 for latency in admitted if latency > deadline_s),
            "base_median_s": base_median, "recovery_s": recovery, "rss_before": peak_before,
            "rss_after": server.rss(), "peak": server.rss("VmHWM")}


# -- 4. soak ---------------------------------------------------------------------------------------------------------
def soak_run(server: Server, requests: int, concurrency: int = 4, cancel_every: int = 20) -> dict:
    images = [jpeg(*SIZES[i % len(SIZES)], i) for i in range(24)]
    samples: list[tuple[int, float]] = [(0, server.rss())]
    statuses: dict = {}
    rng = random.Random(0)

    async def run() -> None:
        done = 0
        queue = list(range(requests))
        async with httpx.AsyncClient(base_url=server.url) as client:
            async def worker() -> None:
                nonlocal done
                while queue:
                    i = queue.pop()
                    model = server.models[i % len(server.models)]
                    # some clients give up mid-request: the server must free their rows and forget them
                    timeout = 0.05 if i % cancel_every == 0 else 120
                    try:
                        response = await client.post("/caption", params={"model": model},
                                                     files={"file": ("x.jpg", images[rng.randrange(24)], "image/jpeg")},
                                                     timeout=timeout)
                        key = response.status_code
                    except httpx.TimeoutException:
                        key = "cancelled"
                    statuses[key] = statuses.get(key, 0) + 1
                    done += 1
                    if done % max(1, requests // 20) == 0:
                        samples.append((done, server.rss()))

            await asyncio.gather(*(worker() for _ in range(concurrency)))

    started = time.perf_counter()
    asyncio.run(run())
    elapsed = time.perf_counter() - started
    samples.append((requests, server.rss()))
    warm = next(rss for n, rss in samples if n >= requests // 10)
    return {"requests": requests, "statuses": statuses, "5xx": sum(n for s, n in statuses.items()
                                                                   if isinstance(s, int) and s >= 500),
            "samples": samples, "after_warmup": warm, "final": samples[-1][1], "peak": server.rss("VmHWM"),
            "growth_pct": 100 * (samples[-1][1] - warm) / warm, "elapsed_s": elapsed}


# -- report ----------------------------------------------------------------------------------------------------------
def write_report(args, memory: dict, corpus: dict, overload: dict, soak: dict) -> str:
    before, after = memory["false"], memory["true"]
    lines = [
        "# Reliability results",
        "",
        "Regenerated by `make reliability` (benchmarks/reliability.py; outside the default test suite). Every run is a",
        "real `captioner serve` process on localhost with every shipped checkpoint (weights/*). Conditions: "
        f"{platform.machine()}, {os.cpu_count()} CPU cores shared with other work, CAPTIONER_THREADS={args.threads}, "
        f"no GPU; {time.strftime('%Y-%m-%d')}.",
        "",
        "## Summary",
        "",
        "| run | kinds tried | requests sent | 5xx seen | peak RSS (MiB) | final RSS (MiB) | other |",
        "|---|---|---|---|---|---|---|",
        f"| hostile corpus | {corpus['kinds']} | {corpus['requests']} | {corpus['5xx']} | {corpus['peak']:.0f} | "
        f"{corpus['after']:.0f} | statuses {dict(sorted(corpus['statuses'].items()))}; ready afterwards: "
        f"{corpus['alive']} |",
        f"| overload ({args.overload:g}× capacity, {overload['duration_s']:g} s) | – | {overload['sent']} | "
        f"{sum(n for s, n in overload['statuses'].items() if isinstance(s, int) and s >= 500 and s != 503)} "
        f"(503s are load shedding) | {overload['peak']:.0f} | {overload['rss_after']:.0f} | recovery "
        f"{_num(overload['recovery_s'], 1)} s |",
        f"| soak | – | {soak['requests']} | {soak['5xx']} | {soak['peak']:.0f} | {soak['final']:.0f} | growth after "
        f"warm-up {soak['growth_pct']:+.1f} % |",
        "",
        f"## Memory: a server with all {after['models']} shipped models",
        "",
        "| | RSS after warm-up (MiB) | RSS after a short mixed load (MiB) | peak (MiB) | median latency (ms) |",
        "|---|---|---|---|---|",
        f"| before (CAPTIONER_RELEASE_MEMORY=false) | {before['ready']:.0f} | {before['after_load']:.0f} | "
        f"{before['peak']:.0f} | {before['median_ms']:.0f} |",
        f"| after (default: pinned mmap threshold, capped arenas, malloc_trim after warm-up) | {after['ready']:.0f} | "
        f"{after['after_load']:.0f} | {after['peak']:.0f} | {after['median_ms']:.0f} |",
        "",
        "## Overload",
        "",
        f"Capacity (one client, back to back, one 640×480 JPEG, model {overload.get('model', 'default')}): "
        f"{overload['capacity_rps']:.2f} requests/s (median {overload['base_median_s'] * 1000:.0f} ms). Burst: "
        f"{overload['rate_rps']:.1f} requests/s open-loop for {overload['duration_s']:g} s.",
        "",
        "| statuses | not 200/429/503 | 429/503 without Retry-After | admitted p50 / max (s) | deadline (s) | "
        "admitted over deadline | recovery (s) |",
        "|---|---|---|---|---|---|---|",
        f"| {overload['statuses']} | {overload['unexpected']} | {overload['rejected_without_retry_after']} | "
        f"{_num(overload['admitted_p50_s'], 2)} / {_num(overload['admitted_max_s'], 2)} | {overload['deadline_s']:g} | "
        f"{overload['over_deadline']} | {_num(overload['recovery_s'], 1)} |",
        "",
        "Recovery: time from the end of the burst until a single request's latency is back within 1.5× its pre-burst "
        "median.",
        "",
        f"## Soak: {soak['requests']} requests, {len(SIZES)} image sizes, every model, every 20th cancelled",
        "",
        f"Statuses: {soak['statuses']}; {soak['elapsed_s']:.0f} s.",
        "",
        "| requests done | RSS (MiB) |",
        "|---|---|",
        *(f"| {n} | {rss:.0f} |" for n, rss in soak["samples"]),
        "",
    ]
    text = "\n".join(lines)
    OUT.write_text(text)
    return text


def _num(value, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--soak", type=int, default=1000, help="soak requests")
    parser.add_argument("--overload", type=float, default=10.0, help="burst rate as a multiple of capacity")
    parser.add_argument("--duration", type=float, default=15.0, help="burst seconds")
    parser.add_argument("--deadline", type=float, default=10.0, help="CAPTIONER_REQUEST_TIMEOUT_S of the servers")
    parser.add_argument("--threads", default="2")
    parser.add_argument("--logs", type=Path, default=ROOT / ".cache" / "reliability")
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    print("memory before/after ...", flush=True)
    memory = memory_run(args.threads, args.logs)
    print(memory, flush=True)
    env = {"CAPTIONER_THREADS": args.threads, "CAPTIONER_REQUEST_TIMEOUT_S": str(args.deadline),
           "CAPTIONER_QUEUE_SIZE": "16"}
    server = start_server(env, args.logs / "main.log")
    try:
        print("hostile corpus ...", flush=True)
        corpus = corpus_run(server)
        print(corpus, flush=True)
        print("overload ...", flush=True)
        overload = overload_run(server, args.overload, args.duration, args.deadline)
        overload["model"] = server.models[0]
        print(overload, flush=True)
        print("soak ...", flush=True)
        soak = soak_run(server, args.soak)
        print({k: v for k, v in soak.items() if k != "samples"}, flush=True)
    finally:
        server.stop()
    print(write_report(args, memory, corpus, overload, soak))


if __name__ == "__main__":
    main()
