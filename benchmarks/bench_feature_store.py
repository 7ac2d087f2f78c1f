"""Feature store benchmark: bytes per image on disk and random-batch read throughput of the sharded float16
store (models/data/features.py) at COCO's grid shape (16×16 cells × 472 hypercolumn channels, EncoderSpec
``image_size=512, layer="hypercolumn"``), with a stand-in encoder that returns random features so that only the
store is timed.  Writes ``docs/feature_store.md``'s measurement table to ``docs/benchmarks/feature_store.md``.

Reads: batches of ``--batch`` random keys, as a shuffled training epoch asks for them.  *Warm*: the shards are in
the page cache (a store smaller than RAM after its first epoch).  *Cold*: every shard is evicted from the page
cache (``posix_fadvise(DONTNEED)``) before each batch, so each batch reads from disk (a store larger than RAM).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

from captioner.models.data.features import INDEX, extract_features
from captioner.models.data.karpathy import CaptionedImage
from captioner.models.encoder import EncoderSpec

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "feature_store.md"
SPEC = EncoderSpec(image_size=512, layer="hypercolumn")  # 16×16 grid of 472-d cells, the COCO setting


class RandomGrid(torch.nn.Module):
    feat_dim = 472

    def forward(self, pixels):
        return torch.randn(pixels.shape[0], 256, self.feat_dim)


def evict(folder: Path) -> None:
    for path in folder.glob("shard-*.npy"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--shard-size", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--dir", type=Path, default=None, help="the folder (made if missing) under which the store is "
                        "built in a temporary folder (default: the system's temporary folder)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        picture = tmp / "image.png"
        Image.new("RGB", (8, 8)).save(picture)  # every item reads the same tiny file: only the store is timed
        images = [CaptionedImage(i, picture, "train", [["x"]]) for i in range(args.images)]
        for i, im in enumerate(images):  # distinct keys (a key is the image path)
            im.path = Path(f"{picture}#{i}")
        import captioner.models.data.features as features

        features.load_image = lambda path: Image.open(str(path).split("#")[0]).convert("RGB")
        start = time.perf_counter()
        store = extract_features(images, SPEC, tmp / "store", batch_size=64, encoder=RandomGrid(), progress=False,
                                 shard_size=args.shard_size)
        write_s = time.perf_counter() - start
        files = list(store.folder.iterdir())
        total = sum(p.stat().st_size for p in files)
        index_bytes = (store.folder / INDEX).stat().st_size
        keys = [im.key for im in images]
        rng = random.Random(0)
        batches = [rng.sample(keys, args.batch) for _ in range(args.batches)]
        for name in ("warm", "cold"):
            store.get_numpy(batches[0])  # maps the shards (and, warm, fills the cache once)
            if name == "warm":
                for batch in batches:
                    store.get_numpy(batch)
            elapsed = 0.0
            for batch in batches:
                if name == "cold":
                    evict(store.folder)
                start = time.perf_counter()
                store.get(batch)  # float32 tensor, as training receives it
                elapsed += time.perf_counter() - start
            if name == "warm":
                warm = (args.batches / elapsed, args.batches * args.batch / elapsed)
            else:
                cold = (args.batches / elapsed, args.batches * args.batch / elapsed)

    per_image = total / args.images
    rate = args.images / write_s  # extraction, images per second
    table = f"""# Feature store: size and read throughput

`python benchmarks/bench_feature_store.py` — {args.images:,} images at the COCO grid shape (16×16 × 472, float16),
shards of {args.shard_size:,} images, random batches of {args.batch} keys, {args.batches} batches per mode;
{platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} CPU cores, the store in
{args.dir or tempfile.gettempdir()}.

| quantity | value |
|---|---:|
| bytes per image on disk (shards + index) | {per_image:,.0f} B ({per_image / 2**10:.1f} KiB) |
| of which the index | {index_bytes / args.images:.0f} B |
| projected store for COCO (123,287 images) | {per_image * 123287 / 2**30:.1f} GiB |
| extraction rate here (image decode + resize to 512 px + random stand-in encoder + write) | {rate:,.0f} images/s |
| random-batch reads, warm page cache | {warm[0]:,.0f} batches/s = {warm[1]:,.0f} images/s |
| random-batch reads, cold (evicted before every batch) | {cold[0]:,.0f} batches/s = {cold[1]:,.0f} images/s |
"""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
