"""Captioning an archive: images/s of ``captioner caption DIR --output`` (the archive use case, service/archive.py)
against the per-image loop (one image at a time through the same runtime) and against the HTTP service (``captioner
serve``, C concurrent clients uploading the same files), measured side by side in one run.

All three load the checkpoint the same way (``load_runtimes`` with the same backend and threads) and caption the
same generated 640×480 scene JPEGs from disk with the same beam and length limit; every image is captioned once
per round, and the rounds take the three in turns so that drifting background load hits each alike.  Loading and
warm-up are outside the timed part (the archive's whole-command time is reported beside it).

    python benchmarks/bench_archive.py                      # writes docs/benchmarks/archive.md
    python benchmarks/bench_archive.py --images 32 --quick  # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_serving import machine, scene_jpegs  # noqa: E402
from common import checkpoint, command_line, default_model, publish  # noqa: E402
from servers import Server  # noqa: E402


def per_image_loop(runtime, paths: list[Path], beam: int, max_len: int) -> float:
    """Seconds to caption ``paths`` one at a time: read, decode, preprocess, encode and beam-search each image alone
    (``Runtime.caption`` of a batch of one: what a script looping over files with the library does)."""
    from captioner.models.images import load_image

    started = time.perf_counter()
    for path in paths:
        runtime.caption([runtime.prepare(load_image(path.read_bytes()))], beam, max_len)
    return time.perf_counter() - started


def archive(folder: Path, out: Path, ckpt: Path, settings, beam: int, max_len: int) -> tuple[float, float]:
    """(seconds captioning, seconds of the whole command: loading and warm-up included) of the archive use case."""
    from captioner.service.archive import ArchiveOptions, caption_archive

    out.unlink(missing_ok=True)
    started = time.perf_counter()
    run = caption_archive([str(folder)], out, ckpt, settings, ArchiveOptions(beam_size=beam, max_len=max_len),
                          progress=False)
    total = time.perf_counter() - started
    assert run.summary.captioned == run.total, "every image of the archive is captioned"
    return run.summary.seconds, total


async def http_clients(url: str, paths: list[Path], clients: int, beam: int, max_len: int) -> float:
    """Seconds for ``clients`` concurrent clients to upload every file once (each takes the next file as soon as its
    last answer arrives) to ``POST /caption``."""
    import httpx

    queue: asyncio.Queue[Path] = asyncio.Queue()
    for path in paths:
        queue.put_nowait(path)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                path = queue.get_nowait()
                response = await client.post("/caption", params={"beam_size": beam, "max_len": max_len},
                                             files={"file": (path.name, path.read_bytes(), "image/jpeg")})
                response.raise_for_status()

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=default_model(), help="checkpoint name under weights/ or a folder")
    parser.add_argument("--images", type=int, default=96, help="scene JPEGs in the archive")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each timing the three in turns")
    parser.add_argument("--clients", type=int, default=8, help="concurrent HTTP clients")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of every configuration")
    parser.add_argument("--backend", default="torch", help="CAPTIONER_BACKEND of the archive and the service")
    parser.add_argument("--beam-size", type=int, default=3)
    parser.add_argument("--max-len", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="one round (a smoke run)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "archive.md")
    args = parser.parse_args()
    generated_by = command_line("bench_archive.py", parser, args)
    rounds = 1 if args.quick else args.rounds
    started, when, host = time.perf_counter(), datetime.datetime.now(datetime.UTC), machine()

    from captioner.models.device import set_threads
    from captioner.service.archive import load_runtime
    from captioner.service.settings import Settings

    ckpt = checkpoint(args.model).resolve()
    set_threads(args.threads)
    settings = Settings(backend=args.backend, threads=args.threads)
    runtime = load_runtime(ckpt, settings)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "archive"
        folder.mkdir()
        paths = []
        for i, jpeg in enumerate(scene_jpegs(args.images)):
            paths.append(folder / f"scene{i:05d}.jpg")
            paths[-1].write_bytes(jpeg)
        server = Server("service", [sys.executable, "-m", "captioner.service.cli", "serve"],
                        {"CAPTIONER_WEIGHTS_DIR": str(Path(tmp) / "none"),
                         "CAPTIONER_CHECKPOINTS": json.dumps([str(ckpt)]),
                         "CAPTIONER_DEFAULT_MODEL": ckpt.name, "CAPTIONER_BACKEND": args.backend,
                         "CAPTIONER_THREADS": str(args.threads), "CAPTIONER_LOG_LEVEL": "warning"},
                        Path(tmp) / "server.log")
        try:
            server.wait_ready()
            asyncio.run(http_clients(server.url, paths[:args.clients], args.clients, args.beam_size, args.max_len))
            per_image_loop(runtime, paths[:2], args.beam_size, args.max_len)  # first-use costs, not timed
            seconds: dict[str, list[float]] = {"archive": [], "per-image loop": [], "service": []}
            whole: list[float] = []
            for _ in range(rounds):
                captioning, total = archive(folder, Path(tmp) / "captions.jsonl", ckpt, settings, args.beam_size,
                                            args.max_len)
                seconds["archive"].append(captioning)
                whole.append(total)
                seconds["per-image loop"].append(per_image_loop(runtime, paths, args.beam_size, args.max_len))
                seconds["service"].append(asyncio.run(http_clients(server.url, paths, args.clients, args.beam_size,
                                                                   args.max_len)))
        finally:
            server.stop()

    rate = {name: [args.images / s for s in values] for name, values in seconds.items()}
    mean = {name: statistics.mean(values) for name, values in rate.items()}
    spec = runtime.spec
    lines = [
        "# Captioning an archive",
        "",
        f"Generated by `{generated_by}` on {when:%Y-%m-%d %H:%M} UTC (one run; every number below comes from it).",
        "",
        f"Machine: {host}. **The CPU is shared** with other jobs (training runs): absolute rates move with their "
        "load; the ratios, measured in turns within each round, are the result.",
        "",
        f"Model: `{ckpt.name}` ({spec.backbone} {spec.layer}, at {spec.image_size} px), backend `{args.backend}`, "
        f"beam {args.beam_size}, max_len {args.max_len}, {args.threads} intra-op thread(s) everywhere. Archive: "
        f"{args.images} generated 640×480 scene JPEGs in a folder, each captioned once per configuration per round "
        f"({rounds} round(s), configurations in turns).",
        "",
        "Configurations: **archive** = `captioner caption DIR --output FILE.jsonl` (service/archive.py, in process: "
        "the service's batcher with continuous batching, warm-up-chosen encoder batches and an encoder thread, fed by "
        "2 reader threads, one flushed JSON line per caption); **per-image loop** = the same runtime captioning one "
        "file at a time (`Runtime.caption` of a batch of one, as a script looping over files would); **service** = "
        f"`captioner serve` in its own process, {args.clients} concurrent clients each uploading its next file as "
        "soon as its last answer came (multipart, localhost; the load generator shares the cores).",
        "",
        "| configuration | images/s, each round | images/s, mean | vs per-image loop |",
        "|---|---|---|---|",
        *[f"| {name} | {', '.join(f'{r:.2f}' for r in rate[name])} | {mean[name]:.2f} | "
          f"{mean[name] / mean['per-image loop']:.2f}× |" for name in seconds],
        "",
        f"Archive vs service: **{mean['archive'] / mean['service']:.2f}×** the service's images/s. The archive's whole "
        f"command (loading the checkpoint and warm-up included) took {', '.join(f'{s:.1f}' for s in whole)} s for "
        f"the {args.images} images, against {', '.join(f'{s:.1f}' for s in seconds['archive'])} s of captioning.",
        "",
    ]
    publish(args.out, lines, started)


if __name__ == "__main__":
    main()
