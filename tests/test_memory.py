"""service/memory.py: the CUDA libraries' pages handed back on a machine without a GPU."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from captioner.service import memory
from captioner.service.memory import configure_allocator, gpu_library_ranges, page_out_gpu_libraries, release_memory

MAPS = """\
7f0000000000-7f0000200000 r--p 00000000 00:2a 1001 /venv/lib/python3.11/site-packages/nvidia/cu13/lib/libnvrtc.so.13
7f0000200000-7f0000400000 r-xp 00200000 00:2a 1001 /venv/lib/python3.11/site-packages/nvidia/cu13/lib/libnvrtc.so.13
7f0000400000-7f0000401000 rw-p 00000000 00:00 0
7f0000500000-7f0000600000 r-xp 00000000 00:2a 1002 /venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so
7f0000600000-7f0000700000 r-xp 00000000 00:2a 1003 /venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so
7f0000700000-7f0000800000 rw-p 00000000 00:00 0                          [heap]
"""


def test_only_the_cuda_libraries_mappings_are_chosen():
    assert gpu_library_ranges(MAPS) == [(0x7F0000000000, 0x7F0000200000), (0x7F0000200000, 0x7F0000400000),
                                        (0x7F0000500000, 0x7F0000600000)]
    assert gpu_library_ranges("") == []


PROBE = r"""
import json, torch
from captioner.service.memory import GPU_LIBRARY_PATTERNS, gpu_library_ranges, page_out_gpu_libraries

def gpu_private_clean_kib():
    # the pages only this process maps: the kernel pages out no page another process maps too (this test's own
    # pytest process has imported torch, so most of the libraries' pages are shared with it here; a server is
    # the only process mapping them)
    total, counting = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            counting = len(head) == 6 and any(p in head[5] for p in GPU_LIBRARY_PATTERNS)
        elif counting and line.startswith("Private_Clean:"):
            total += int(head[1])
    return total

before = gpu_private_clean_kib()
mapped = sum(end - start for start, end in gpu_library_ranges(open("/proc/self/maps").read()))
advised = page_out_gpu_libraries()
after = gpu_private_clean_kib()
# torch still works afterwards: a page it needs again is read back from its file
ok = float(torch.ones(3).sum()) == 3.0 and torch.cuda.is_available() is False
print(json.dumps({"cuda": torch.cuda.is_available(), "before": before, "after": after, "advised": advised,
                  "mapped": mapped, "ok": ok}))
"""


def test_the_cuda_libraries_pages_are_handed_back_and_torch_still_runs():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["cuda"]:
        pytest.skip("a CUDA device is present: the app does not page its libraries out there")
    assert result["ok"], "torch no longer runs after its CUDA libraries were paged out"
    if result["mapped"] == 0:
        pytest.skip("this torch maps no CUDA libraries (a CPU-only build)")
    if result["advised"] == 0:
        pytest.skip("this kernel has no MADV_PAGEOUT (Linux 5.4+)")
    assert result["advised"] == result["mapped"], "madvise refused some of the CUDA libraries' mappings"
    # every page only this process held is handed back (those shared with another process stay resident)
    assert result["after"] <= result["before"] / 2 or result["before"] < 1024, result


def test_the_allocator_is_tuned_and_trimmed_under_glibc_and_left_alone_elsewhere(monkeypatch):
    """Where glibc is the C library its limits are set and its free pages returned; elsewhere (musl, macOS: no
    ``mallopt``) each step is a no-op that says so, and the resident set is still reported."""
    assert configure_allocator() is (platform.libc_ver()[0] == "glibc")
    assert release_memory() > 0
    monkeypatch.setattr(memory, "_libc", lambda: None)
    assert configure_allocator() is False and page_out_gpu_libraries() == 0 and release_memory() > 0
