"""Reliability runs against real ``captioner serve`` processes on localhost, written to docs/reliability.md.

``make reliability`` (or ``python benchmarks/reliability.py``) runs, each against its own server with what
``make serve`` serves (every checkpoint of weights/flickr8k):

1. **memory**: the resident set after warm-up with ``CAPTIONER_RELEASE_MEMORY=false`` (before the memory work)
   and ``true`` (after), side by side in one run, then after a short mixed load;
2. **hostile corpus**: every kind of ``tests/hostile_images.py`` (loaded by file path: benchmarks never import
   the ``tests`` package) to ``/caption`` and ``/caption/heatmaps``; statuses, 5xx count, peak RSS;
3. **fuzz**: schemathesis, the fuzzer of ``tests/test_fuzz_api.py``, against the live server's OpenAPI document
   (``--fuzz-examples`` cases per operation, seed 0): no 5xx, and every answer as the document says; its
   requests are counted from the server's access log;
4. **overload**: capacity measured with one client, then a fixed-duration open-loop burst at ``--overload``×
   capacity; only 200 / 429 / 503 (with Retry-After) are acceptable, admitted requests must finish within the
   request deadline, and the resident set is sampled during the burst; then the time until single-request
   latency is back within 1.5× its pre-burst median;
5. **soak**: ``--soak`` requests (10,000 by default) over every model and mixed image sizes, one in
   ``--cancel-every`` abandoned by its client at a random point (while uploading, queued or decoding), RSS
   sampled over time; growth is measured from the end of the first tenth.  ``--soak-max-s`` bounds its time:
   a soak that reaches it stops early and the report says how many requests it sent.

Everything is bounded (fixed request counts and durations) and stops by itself.  Numbers depend on the machine and on
what else runs on it; the document records the conditions (``--shared-with`` names the other work).
``--only overload soak`` (any of ``memory``, ``corpus``, ``fuzz``, ``overload``, ``soak``) runs those parts and prints
them without writing the report.  ``--small`` checks the whole run end to end in minutes (300 soak requests, a 5 s
burst, 5 fuzz cases per operation) and writes its report to ``--logs`` instead of docs/reliability.md: its numbers are
not the published ones.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import io
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
from PIL import Image
from servers import Server

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ROOT / "weights" / "flickr8k"  # what `make serve` serves
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
    """A server with what ``make serve`` serves, ready, with ``.models`` naming them."""
    server = Server("server", [sys.executable, "-m", "captioner.service.cli", "serve", "--weights-dir", str(WEIGHTS)],
                    {"CAPTIONER_LOG_LEVEL": "warning", **env}, log)
    server.wait_ready()
    server.models = [m["name"] for m in httpx.get(f"{server.url}/models", timeout=10).json()]
    return server


def is_ready(server: Server) -> bool:
    """Whether the server still answers its readiness probe (after a run that tried to break it)."""
    try:
        return httpx.get(f"{server.url}/readyz", timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def jpeg(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="JPEG", quality=85)
    return buffer.getvalue()


SIZES = [(64, 64), (320, 240), (640, 480), (1024, 768), (1600, 1200), (200, 1000)]


def server_errors(statuses: Counter) -> int:
    """Answers with a 5xx status (the service sheds load with 429, which is none)."""
    return sum(n for s, n in statuses.items() if isinstance(s, int) and s >= 500)


def post(client: httpx.Client, data: bytes, model: str | None = None, timeout: float | None = None):
    return client.post("/caption", params={"model": model} if model else None,
                       files={"file": ("x.jpg", data, "image/jpeg")}, timeout=timeout or 120)


# -- 1. memory -----------------------------------------------------------------------------------------------------
def memory_run(threads: str, logs: Path) -> dict:
    out = {}
    for release in ("false", "true"):
        server = start_server({"CAPTIONER_RELEASE_MEMORY": release, "CAPTIONER_THREADS": threads},
                              logs / f"mem-{release}.log")
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
    statuses: Counter = Counter()
    before = server.rss()
    with httpx.Client(base_url=server.url, timeout=300) as client:
        for upload in corpus:
            for endpoint, params in (("/caption", None), ("/caption/heatmaps", {"max_side": 1024})):
                response = client.post(endpoint, params=params,
                                       files={"file": (upload.filename, upload.data, upload.content_type)})
                statuses[response.status_code] += 1
    return {"kinds": len(corpus), "requests": sum(statuses.values()), "statuses": statuses,
            "5xx": server_errors(statuses), "alive": is_ready(server), "rss_before": before,
            "peak": server.rss("VmHWM"), "after": server.rss()}


# -- 3. fuzz ---------------------------------------------------------------------------------------------------------
#: the checks of tests/test_fuzz_api.py, by their schemathesis CLI names
FUZZ_CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def access_log(log: Path) -> list[dict]:
    """The server's access-log entries (JSON lines of the ``captioner.access`` logger)."""
    return [entry for line in log.read_text().splitlines() if line.startswith("{")
            and (entry := json.loads(line)).get("logger") == "captioner.access"]


def fuzz_run(server: Server, examples: int, logs: Path) -> dict:
    """schemathesis against the live server: the in-process fuzz test of the suite, here over HTTP, through
    uvicorn, with every shipped model loaded.  Statuses come from the server's own access log (the entries the
    run added: nothing else calls the server meanwhile), failed checks from the fuzzer's JUnit report."""
    operations = sum(len(methods) for methods in httpx.get(f"{server.url}/openapi.json", timeout=30).json()["paths"]
                     .values())
    junit = logs / "fuzz-junit.xml"
    junit.unlink(missing_ok=True)
    command = [str(Path(sys.executable).with_name("schemathesis")), "run", f"{server.url}/openapi.json",
               "--checks", FUZZ_CHECKS, "--max-examples", str(examples), "--seed", "0", "--workers", "1",
               "--request-timeout", "300", "--suppress-health-check", "all",
               "--report", "junit", "--report-junit-path", str(junit)]
    log = Path(server.log.name)
    seen = len(access_log(log))
    started = time.perf_counter()
    finished = subprocess.run(command, cwd=logs, capture_output=True, text=True, timeout=3600)
    (logs / "fuzz.out").write_text(finished.stdout + finished.stderr)
    time.sleep(1)  # the access log's last lines
    statuses = Counter(entry["status"] for entry in access_log(log)[seen:])
    suites = ElementTree.parse(junit).getroot().iter("testsuite") if junit.exists() else []
    failed = sum(int(suite.get("failures", 0)) + int(suite.get("errors", 0)) for suite in suites)
    return {"operations": operations, "examples": examples, "requests": sum(statuses.values()),
            "statuses": statuses, "5xx": server_errors(statuses),
            "failed_checks": failed, "exit_code": finished.returncode, "elapsed_s": time.perf_counter() - started,
            "peak": server.rss("VmHWM"), "after": server.rss(), "alive": is_ready(server)}


# -- 4. overload -----------------------------------------------------------------------------------------------------
def multipart(data: bytes) -> tuple[bytes, dict[str, str]]:
    """A caption upload's multipart body and content type, encoded once: a load generator that encodes every
    request itself falls behind its own schedule on a small machine."""
    request = httpx.Request("POST", "http://127.0.0.1/caption", files={"file": ("x.jpg", data, "image/jpeg")})
    return request.read(), {"content-type": request.headers["content-type"]}


async def _timed(client: httpx.AsyncClient, body: tuple[bytes, dict], model: str, results: list, timeout: float,
                 request_id: str) -> None:
    started = time.perf_counter()
    try:
        response = await client.post("/caption", params={"model": model}, content=body[0], timeout=timeout,
                                     headers={**body[1], "x-request-id": request_id})
        results.append((response.status_code, time.perf_counter() - started,
                        "retry-after" in response.headers))
    except httpx.HTTPError as exc:
        results.append((type(exc).__name__, time.perf_counter() - started, False))


def server_durations(log: Path, prefix: str) -> dict[str, tuple[int, float]]:
    """Status and duration (s) the server's access log records for requests whose id starts with ``prefix``: the
    server's own time, from the moment it saw the request, which the client's latency also counts time before."""
    return {entry["request_id"]: (entry["status"], entry["duration_ms"] / 1000) for entry in access_log(log)
            if entry.get("path") == "/caption" and str(entry.get("request_id", "")).startswith(prefix)}


def overload_run(server: Server, factor: float, duration_s: float, deadline_s: float) -> dict:
    """Open-loop burst; every request's status, latency and Retry-After, the resident set sampled every half
    second during the burst, then the time to recover."""
    model = server.models[0]
    image = jpeg(640, 480, 1)
    body = multipart(image)
    with httpx.Client(base_url=server.url) as client:
        baseline = []
        for _ in range(8):
            started = time.perf_counter()
            assert post(client, image, model).status_code == 200
            baseline.append(time.perf_counter() - started)
    base_median = statistics.median(baseline)
    capacity = 1 / base_median  # one client, back to back: a lower bound of what batching achieves
    rate = factor * capacity

    burst_rss: list[float] = []

    async def burst() -> list:
        results: list = []
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=server.url, limits=limits) as client:
            tasks, started = [], time.perf_counter()
            sent, sampled = 0, -1.0
            while (now := time.perf_counter() - started) < duration_s:
                while sent < now * rate:
                    tasks.append(asyncio.create_task(_timed(client, body, model, results, deadline_s + 30,
                                                            f"overload-{sent}")))
                    sent += 1
                if now - sampled >= 0.5:
                    burst_rss.append(server.rss())
                    sampled = now
                await asyncio.sleep(0.005)
            pending = asyncio.gather(*tasks)
            while not pending.done():  # keep sampling until the last answer of the burst
                burst_rss.append(server.rss())
                await asyncio.wait([pending], timeout=0.5)
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
    statuses = Counter(status for status, _, _ in results)
    admitted = [latency for status, latency, _ in results if status == 200]
    time.sleep(1)  # the access log's last lines
    on_server = [seconds for status, seconds in server_durations(Path(server.log.name), "overload-").values()
                 if status == 200]
    rejected_without_retry = sum(1 for status, _, retry in results if status in (429, 503) and not retry)
    return {"capacity_rps": capacity, "rate_rps": rate, "duration_s": duration_s, "sent": len(results),
            "statuses": statuses, "unexpected": sum(n for s, n in statuses.items() if s not in ACCEPTABLE_UNDER_LOAD),
            "rejected_without_retry_after": rejected_without_retry,
            "admitted_p50_s": statistics.median(admitted) if admitted else None,
            "admitted_max_s": max(admitted) if admitted else None, "deadline_s": deadline_s,
            "over_deadline": sum(1 for latency in admitted if latency > deadline_s),
            "server_max_s": max(on_server, default=None), "logged": len(on_server),
            "server_over_deadline": sum(1 for seconds in on_server if seconds > deadline_s),
            "base_median_s": base_median, "recovery_s": recovery, "rss_before": peak_before,
            "rss_after": server.rss(), "burst_peak": max(burst_rss), "peak": server.rss("VmHWM"),
            "5xx": server_errors(statuses),
            "other_errors": sum(n for s, n in statuses.items() if not isinstance(s, int))}


# -- 5. soak ---------------------------------------------------------------------------------------------------------
def soak_run(server: Server, requests: int, max_s: float, concurrency: int = 4, cancel_every: int = 20) -> dict:
    """``requests`` captions (at most ``max_s`` seconds) from ``concurrency`` clients, back to back, over every model
    and every size of ``SIZES``; one in ``cancel_every`` is abandoned by its client after a random 0.02–1.5 s, so
    some leave while uploading, some while queued and some while decoding.  RSS is sampled 40 times."""
    images = [jpeg(*SIZES[i % len(SIZES)], i) for i in range(24)]
    started = time.perf_counter()
    samples: list[tuple[int, float, float]] = [(0, 0.0, server.rss())]  # (requests done, seconds, RSS MiB)
    statuses: Counter = Counter()
    rng = random.Random(0)
    every = max(1, requests // 40)

    async def run() -> int:
        done = 0
        queue = list(range(requests))
        async with httpx.AsyncClient(base_url=server.url) as client:
            async def worker() -> None:
                nonlocal done
                while queue and time.perf_counter() - started < max_s:
                    i = queue.pop()
                    model = server.models[i % len(server.models)]
                    # some clients give up mid-request: the server must free their rows and forget them
                    timeout = rng.uniform(0.02, 1.5) if i % cancel_every == 0 else 120
                    try:
                        response = await client.post("/caption", params={"model": model},
                                                     files={"file": ("x.jpg", images[i % 24], "image/jpeg")},
                                                     timeout=timeout)
                        key = response.status_code
                    except httpx.TimeoutException:
                        key = "cancelled"
                    except httpx.HTTPError as exc:
                        key = type(exc).__name__
                    statuses[key] += 1
                    done += 1
                    if done % every == 0:
                        samples.append((done, time.perf_counter() - started, server.rss()))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done

    done = asyncio.run(run())
    elapsed = time.perf_counter() - started
    if samples[-1][0] != done:
        samples.append((done, elapsed, server.rss()))
    warm = next(rss for n, _, rss in samples if n >= done // 10)
    return {"requests": done, "planned": requests, "max_s": max_s, "cancel_every": cancel_every,
            "concurrency": concurrency, "statuses": statuses,
            "5xx": server_errors(statuses),
            "other_errors": sum(n for s, n in statuses.items() if not isinstance(s, int) and s != "cancelled"),
            "samples": samples, "after_warmup": warm, "final": samples[-1][2], "peak": server.rss("VmHWM"),
            "sampled_peak": max(rss for _, _, rss in samples), "growth_pct": 100 * (samples[-1][2] - warm) / warm,
            "elapsed_s": elapsed, "models": len(server.models)}


# -- report ----------------------------------------------------------------------------------------------------------
#: aims of issue 13: resident set of a server with every shipped model after warm-up, and soak growth after warm-up
RSS_AIM_MIB = 1024
GROWTH_AIM_PCT = 5.0


def _aim(met: bool) -> str:
    return "met" if met else "**not met**"


def write_report(args, out: Path, memory: dict, corpus: dict, fuzz: dict, overload: dict, soak: dict) -> str:
    before, after = memory["false"], memory["true"]
    soak_sent = f"{soak['requests']:,}" + ("" if soak["requests"] == soak["planned"] else
                                           f" (of {soak['planned']:,}: stopped at {soak['max_s']:g} s)")
    lines = [
        "# Reliability results",
        "",
        *(["**A `--small` run: a check of the benchmark itself, with too few requests to stand for the service.**",
           ""] if args.small else []),
        "Regenerated by `make reliability` (benchmarks/reliability.py; outside the default test suite). Every run is a",
        f"real `captioner serve` process on localhost with what `make serve` serves ({WEIGHTS.relative_to(ROOT)}). "
        "Conditions: "
        f"{platform.machine()}, {os.cpu_count()} CPU cores shared with {args.shared_with} while measuring, "
        f"CAPTIONER_THREADS={args.threads}, no GPU; {time.strftime('%Y-%m-%d')}.",
        "",
        "## Summary",
        "",
        "| run | kinds tried | requests sent | 5xx seen | peak RSS (MiB) | final RSS (MiB) | other |",
        "|---|---|---|---|---|---|---|",
        f"| hostile corpus | {corpus['kinds']} | {corpus['requests']} | {corpus['5xx']} | {corpus['peak']:.0f} | "
        f"{corpus['after']:.0f} | statuses {_statuses(corpus['statuses'])}; ready afterwards: "
        f"{corpus['alive']} |",
        f"| fuzz (schemathesis, {fuzz['examples']} cases per operation) | {fuzz['operations']} operations | "
        f"{fuzz['requests']} | {fuzz['5xx']} | {fuzz['peak']:.0f} | {fuzz['after']:.0f} | statuses "
        f"{_statuses(fuzz['statuses'])}; failed checks {fuzz['failed_checks']}; ready afterwards: {fuzz['alive']} |",
        f"| overload ({args.overload:g}× capacity, {overload['duration_s']:g} s) | – | {overload['sent']} | "
        f"{overload['5xx']} | {overload['burst_peak']:.0f} (during the burst) | {overload['rss_after']:.0f} | "
        f"statuses {_statuses(overload['statuses'])}; admitted over deadline at the client / on the server: "
        f"{overload['over_deadline']} / {overload['server_over_deadline']}; "
        f"recovery {_num(overload['recovery_s'], 1)} s |",
        f"| soak | {soak['models']} models × {len(SIZES)} sizes | {soak_sent} | {soak['5xx']} | "
        f"{soak['sampled_peak']:.0f} | {soak['final']:.0f} | growth after "
        f"warm-up {soak['growth_pct']:+.1f} % ({soak['after_warmup']:.0f} → {soak['final']:.0f} MiB; aim < "
        f"{GROWTH_AIM_PCT:g} %: {_aim(soak['growth_pct'] < GROWTH_AIM_PCT)}) |",
        "",
        "The service sheds load with 429 and Retry-After (the overload row), which is no 5xx; every 5xx counts, "
        "in every row. Peak RSS: the process's high-water mark (VmHWM), warm-up included, except where the burst's "
        "or the soak's own samples are named.",
        "",
        f"## Memory: a server with the {after['models']} models `make serve` serves",
        "",
        "| | RSS after warm-up (MiB) | RSS after a short mixed load (MiB) | peak (MiB) | median latency (ms) |",
        "|---|---|---|---|---|",
        f"| CAPTIONER_RELEASE_MEMORY=false | {before['ready']:.0f} | {before['after_load']:.0f} | "
        f"{before['peak']:.0f} | {before['median_ms']:.0f} |",
        f"| default (pinned mmap threshold, capped arenas, malloc_trim after warm-up and when idle) | "
        f"{after['ready']:.0f} | {after['after_load']:.0f} | {after['peak']:.0f} | {after['median_ms']:.0f} |",
        "",
        f"Aim: at most {RSS_AIM_MIB} MiB after warm-up with every shipped model: "
        f"{_aim(after['ready'] <= RSS_AIM_MIB)} ({after['ready']:.0f} MiB).",
        "",
        "Where the memory goes and what each further model costs: [benchmarks/memory.md](benchmarks/memory.md) and "
        "docs/decisions.md, \"One CNN per encoder spec, and no PyTorch weights behind ONNX models\".",
        "",
        "## Overload",
        "",
        f"Capacity (one client, back to back, one 640×480 JPEG, model {overload.get('model', 'default')}): "
        f"{overload['capacity_rps']:.2f} requests/s (median {overload['base_median_s'] * 1000:.0f} ms). Burst: "
        f"{overload['rate_rps']:.1f} requests/s open-loop for {overload['duration_s']:g} s.",
        "",
        "| statuses | not 200/429/503 | 429/503 without Retry-After | admitted p50 / max at the client (s) | "
        "max on the server (s) | deadline (s) | admitted over deadline: at the client / on the server | "
        "RSS before / peak in burst / after (MiB) | recovery (s) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {_statuses(overload['statuses'])} | {overload['unexpected']} | "
        f"{overload['rejected_without_retry_after']} | "
        f"{_num(overload['admitted_p50_s'], 2)} / {_num(overload['admitted_max_s'], 2)} | "
        f"{_num(overload['server_max_s'], 2)} | {overload['deadline_s']:g} | {overload['over_deadline']} / "
        f"{overload['server_over_deadline']} | {overload['rss_before']:.0f} / {overload['burst_peak']:.0f} / "
        f"{overload['rss_after']:.0f} | {_num(overload['recovery_s'], 1)} |",
        "",
        "At the client: from the moment the load generator (a Python process on the same machine) set out to send "
        "the request; on the server: from the moment the server read it (its access log). The deadline is the "
        "server's promise; the difference is time the request spent in the generator and in the kernel's queues "
        "before the server could read it.",
        "",
        "Recovery: time from the end of the burst until a single request's latency is back within 1.5× its pre-burst "
        "median.",
        "",
        f"## Soak: {soak_sent} requests, {len(SIZES)} image sizes, every model, one in {soak['cancel_every']} "
        f"abandoned mid-request",
        "",
        f"{soak['concurrency']} clients back to back; statuses {_statuses(soak['statuses'])}; "
        f"{soak['elapsed_s']:.0f} s. Growth after warm-up is the change from the sample at a tenth of the requests "
        "to the last one.",
        "",
        "| requests done | elapsed (s) | RSS (MiB) |",
        "|---|---|---|",
        *(f"| {n:,} | {t:.0f} | {rss:.0f} |" for n, t, rss in soak["samples"]),
        "",
    ]
    text = "\n".join(lines)
    out.write_text(text)
    return text


def _statuses(statuses: dict) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0]))) + "}"


def _num(value, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


PARTS = ("memory", "corpus", "fuzz", "overload", "soak")
#: ``--small``: every part, end to end, in minutes (a check of this script, not a measurement to publish)
SMALL = {"soak": 300, "soak_max_s": 600.0, "duration": 5.0, "fuzz_examples": 5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--soak", type=int, default=10_000, help="soak requests")
    parser.add_argument("--soak-max-s", type=float, default=7200.0, help="the soak stops after this many seconds")
    parser.add_argument("--cancel-every", type=int, default=20, help="one soak request in this many is abandoned")
    parser.add_argument("--soak-clients", type=int, default=4,
                        help="soak clients sending back to back (the soak is meant to stay below capacity)")
    parser.add_argument("--fuzz-examples", type=int, default=40, help="fuzz cases per API operation")
    parser.add_argument("--overload", type=float, default=10.0, help="burst rate as a multiple of capacity")
    parser.add_argument("--duration", type=float, default=15.0, help="burst seconds")
    parser.add_argument("--deadline", type=float, default=10.0, help="CAPTIONER_REQUEST_TIMEOUT_S of the servers")
    parser.add_argument("--threads", default="2")
    parser.add_argument("--shared-with", default="other work", help="what else ran on the machine (for the report)")
    parser.add_argument("--only", choices=PARTS, nargs="+", help="run these parts alone and print them (no report)")
    parser.add_argument("--small", action="store_true",
                        help=f"a quick end-to-end check ({', '.join(f'{k}={v:g}' for k, v in SMALL.items())}); "
                             "the report goes to LOGS/reliability-small.md unless --out says otherwise")
    parser.add_argument("--out", type=Path, help=f"report file (default {OUT.relative_to(ROOT)})")
    parser.add_argument("--logs", type=Path, default=ROOT / ".cache" / "reliability")
    args = parser.parse_args()
    if args.small:
        for key, value in SMALL.items():
            setattr(args, key, type(getattr(args, key))(value))
    out = args.out or (args.logs / "reliability-small.md" if args.small else OUT)
    args.logs.mkdir(parents=True, exist_ok=True)
    parts = [part for part in PARTS if part in (args.only or PARTS)]
    results: dict = {}
    if "memory" in parts:
        print("memory before/after ...", flush=True)
        results["memory"] = memory_run(args.threads, args.logs)
        print(results["memory"], flush=True)
    if parts != ["memory"]:
        # info: the access log gives the statuses of the fuzz and the server's own time of every overload request
        env = {"CAPTIONER_THREADS": args.threads, "CAPTIONER_REQUEST_TIMEOUT_S": str(args.deadline),
               "CAPTIONER_QUEUE_SIZE": "16", "CAPTIONER_LOG_LEVEL": "info"}
        server = start_server(env, args.logs / "main.log")
        runs = {"corpus": lambda: corpus_run(server),
                "fuzz": lambda: fuzz_run(server, args.fuzz_examples, args.logs),
                "overload": lambda: {**overload_run(server, args.overload, args.duration, args.deadline),
                                     "model": server.models[0]},
                "soak": lambda: soak_run(server, args.soak, args.soak_max_s, args.soak_clients, args.cancel_every)}
        try:
            for part in parts:
                if part in runs:
                    print(f"{part} ...", flush=True)
                    results[part] = runs[part]()
                    print({k: v for k, v in results[part].items() if k != "samples"}, flush=True)
        finally:
            server.stop()
    if not args.only:
        print(write_report(args, out, **results))
        print(f"written: {out}", flush=True)


if __name__ == "__main__":
    main()
