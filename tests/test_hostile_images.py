"""Every kind of the generated hostile-image corpus (``tests/hostile_images.py``) over real HTTP, to a real
``captioner serve`` process with a tiny model: each upload gets 200 or a 4xx RFC 9457 problem document — never
a 5xx, a stack trace or a server path — and the worker is still alive and captioning afterwards.  The server's
peak resident set while digesting the corpus is measured (``VmHWM``) and bounded."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from captioner.models.checkpoint import save_checkpoint
from captioner.models.encoder import EncoderSpec
from captioner.models.vocab import Vocabulary
from captioner.models.zoo import create

from .hostile_images import Upload, hostile_corpus
from .serving_helpers import ROOT, ServerProcess

MAX_PIXELS = 1_000_000  # the "just under the limit" images track this; 1 MP keeps the test fast
ENDPOINTS = ("/caption", "/caption/heatmaps")
PROBLEM_FIELDS = ("type", "title", "status", "detail")
# what a response must never reveal: tracebacks and where the server's files are
LEAKS = ("Traceback", 'File "', str(ROOT), "site-packages", ".py\"", "/tmp/")


def tiny_weights(root: Path) -> Path:
    torch.manual_seed(0)
    vocab = Vocabulary(["a", "red", "circle", "on", "the", "left"])
    model = create("sat", vocab_size=len(vocab), feat_dim=320, embed_dim=16, hidden_dim=16, attn_dim=8, dropout=0.0)
    save_checkpoint(root / "tiny", model, vocab, EncoderSpec(image_size=96))
    return root


def vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@pytest.fixture(scope="module")
def corpus() -> list[Upload]:
    return hostile_corpus(MAX_PIXELS)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    weights = tiny_weights(tmp_path_factory.mktemp("hostile-weights"))
    log = tmp_path_factory.mktemp("hostile-log") / "server.log"
    proc = ServerProcess(weights, {"CAPTIONER_DEFAULT_MODEL": "tiny", "CAPTIONER_MAX_PIXELS": str(MAX_PIXELS),
                                   "CAPTIONER_DEVICE": "cpu", "CAPTIONER_MAX_BATCH_IMAGES": "2",
                                   "CAPTIONER_MAX_ROWS": "16", "CAPTIONER_MAX_BEAM_SIZE": "3",
                                   "CAPTIONER_DEFAULT_BEAM_SIZE": "2", "CAPTIONER_DEFAULT_MAX_LEN": "6"}, log)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def check_answer(upload: Upload, endpoint: str, response: httpx.Response) -> str | None:
    """The first thing wrong with ``response`` to ``upload``, or None."""
    where = f"{upload.kind} → {endpoint}: {response.status_code}"
    body = response.text
    if any(leak in body for leak in LEAKS):
        return f"{where} leaks internals: {body[:300]}"
    if response.status_code == 200:
        if upload.expect == "reject":
            return f"{where}: accepted an upload that is not a readable image"
        return None
    if upload.expect == "ok":
        return f"{where}: refused a readable image: {body[:300]}"
    if not 400 <= response.status_code < 500:
        return f"{where}: not a client error: {body[:300]}"
    if not response.headers.get("content-type", "").startswith("application/problem+json"):
        return f"{where}: not a problem document ({response.headers.get('content-type')})"
    problem = response.json()
    missing = [name for name in PROBLEM_FIELDS if not problem.get(name)]
    if missing or problem["status"] != response.status_code:
        return f"{where}: incomplete problem document {problem}"
    return None


def test_the_corpus_has_every_kind_the_issue_names(corpus):
    kinds = {u.kind for u in corpus}
    assert len(kinds) == len(corpus) >= 40
    for needed in ("zero-bytes", "truncated-jpeg-half", "truncated-png-half", "truncated-webp-half",
                   "truncated-gif-half", "svg-as-image", "pdf-as-jpeg", "html-as-jpeg", "jpeg-plus-html",
                   "png-declares-100000x100000", "gif-declares-65535x65535", "webp-declares-16383x16383",
                   "tiff-declares-100000x100000", "1x100000", "100000x1", "1x1", "cmyk-jpeg", "ycck-jpeg",
                   "rgb-16bit-png", "palette-png-transparency", "la-png", "animated-gif", "animated-webp",
                   "multipage-tiff", "exif-orientation-65535", "corrupt-icc-profile", "progressive-jpeg",
                   "exif-huge", "just-under-limit-png"):
        assert needed in kinds


def test_every_hostile_upload_gets_200_or_a_problem_and_the_worker_survives(server, corpus):
    baseline_kib = vm_kib(server.proc.pid, "VmRSS")
    failures, statuses = [], {}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for upload in corpus:
            for endpoint in ENDPOINTS:
                # heatmaps render at the image's resolution up to max_side: per-word heatmaps of a 4 MP image take
                # tens of seconds of CPU, so the test asks for 1024-pixel renders
                params = {"max_side": 1024} if endpoint != "/caption" else None
                response = client.post(endpoint, params=params,
                                       files={"file": (upload.filename, upload.data, upload.content_type)})
                statuses[upload.kind, endpoint] = response.status_code
                if problem := check_answer(upload, endpoint, response):
                    failures.append(problem)
            # the raw-body route too: the same bytes with the upload's own content type
            raw = client.post("/caption", content=upload.data, headers={"content-type": upload.content_type})
            if raw.status_code >= 500 or any(leak in raw.text for leak in LEAKS):
                failures.append(f"{upload.kind} → raw /caption: {raw.status_code} {raw.text[:200]}")
        assert server.proc.poll() is None, "the server died"
        assert client.get("/readyz").status_code == 200
        good = next(u for u in corpus if u.kind == "progressive-jpeg")
        after = client.post("/caption", files={"file": (good.filename, good.data, good.content_type)})
        assert after.status_code == 200 and after.json()["caption"] is not None, after.text
    assert not failures, "\n".join(failures)
    assert sum(s >= 500 for s in statuses.values()) == 0
    assert any(s == 413 for s in statuses.values()), "the decompression bombs are refused as too large"
    log = server.log()
    assert "unhandled error" not in log and "Traceback" not in log, log[-2000:]
    # peak memory: decoding is bounded by the pixel limit (4 MP × 3 bytes, a few copies), not by what a header says
    peak_growth_mib = (vm_kib(server.proc.pid, "VmHWM") - baseline_kib) / 1024
    print(f"\nhostile corpus: {len(corpus)} kinds, {len(statuses)} multipart requests, "
          f"peak RSS growth {peak_growth_mib:.0f} MiB")
    assert peak_growth_mib < 400, f"peak RSS grew by {peak_growth_mib:.0f} MiB"
