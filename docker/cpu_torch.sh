#!/bin/sh
# Install torch and torchvision as the CPU-only wheels of a PyTorch CPU wheel index, before the rest of a set-up:
# every `make` set-up on a machine without an NVIDIA driver (`make cpu-torch`) and the CPU image (Dockerfile) run
# this one script. The pins are docker/requirements.py's torch-cpu.txt, pyproject.toml's pins spelt +cpu (which
# meet them), so the install that follows keeps these wheels; no dependencies here, that install brings them.
# Where no index is named or it cannot be reached, nothing is installed and the output says so: the set-up goes on
# to the default index's torch, which brings its CUDA wheels (docs/decisions.md, "make setup: CPU-only torch
# without an NVIDIA driver").
#
#   docker/cpu_torch.sh PIP TORCH_CPU_TXT INDEX_URL [LOG]    # LOG: a file for pip's output (default: this output)
set -u
usage="usage: docker/cpu_torch.sh PIP TORCH_CPU_TXT INDEX_URL [LOG]"
pip=${1:?$usage} pins_file=${2:?$usage} index=${3?$usage} log=${4:-}
if [ -z "$index" ]; then
  echo "TORCH_CPU_INDEX is empty: torch from the default index"
  exit 0
fi
pins=$(tr '\n' ' ' < "$pins_file")
install() {  # one quick retry: an index that does not answer is a note, then the default index, not a stall
  "$pip" install --no-cache-dir --no-deps --only-binary :all: --retries 1 --timeout 15 --index-url "$index" \
    -r "$pins_file"
}
if [ -n "$log" ]; then install > "$log" 2>&1; else install; fi
if [ $? -eq 0 ]; then
  echo "CPU-only ${pins}from $index"
else
  where=${log:+$log says}
  echo "note: no CPU-only ${pins}from $index (unreachable, or no such wheel? ${where:-pip says above}):" \
       "the default index's torch, which brings its CUDA wheels"
fi
