"""service/memory.py: the CUDA libraries' pages handed back on a machine without a GPU."""

from __future__ import annotations

import _ctypes
import gc
import json
import platform
import subprocess
import sys
import threading
import weakref
from types import SimpleNamespace

import pytest

from captioner.service import memory
from captioner.service.memory import IdleTrimmer, configure_allocator, freeze_startup_objects, gpu_library_ranges, \
    page_out_gpu_libraries, release_memory, resident_bytes

MAPS = """\
7f0000000000-7f0000200000 r--p 00000000 00:2a 1001 /venv/lib/python3.11/site-packages/nvidia/cu13/lib/libnvrtc.so.13
7f0000200000-7f0000400000 r-xp 00200000 00:2a 1001 /venv/lib/python3.11/site-packages/nvidia/cu13/lib/libnvrtc.so.13
7f0000400000-7f0000401000 rw-p 00000000 00:00 0
7f0000500000-7f0000600000 r-xp 00000000 00:2a 1002 /venv/lib/python3.11/site-packages/torch/lib/libtorch_cuda.so
7f0000600000-7f0000700000 r-xp 00000000 00:2a 1003 /venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so
7f0000700000-7f0000800000 rw-p 00000000 00:00 0                          [heap]
"""
#: a library in a folder whose name holds a space, replaced on disk since it was mapped (the kernel's " (deleted)")
SPACED = "7f0000900000-7f0000a00000 r-xp 00000000 00:2a 1004 /home/me/my env/site-packages/nvidia/cublas/lib/" \
         "libcublas.so.13 (deleted)\n"


def test_only_the_cuda_libraries_mappings_are_chosen():
    assert gpu_library_ranges(MAPS) == [(0x7F0000000000, 0x7F0000200000), (0x7F0000200000, 0x7F0000400000),
                                        (0x7F0000500000, 0x7F0000600000)]
    assert gpu_library_ranges("") == []
    # the file is the rest of the line after five fields, spaces and all
    assert gpu_library_ranges(SPACED) == [(0x7F0000900000, 0x7F0000A00000)]


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


def test_a_c_library_without_glibcs_allocator_calls_or_none_at_all_leaves_the_server_running(monkeypatch):
    """musl's and macOS's C libraries have no ``mallopt``: one loaded without it, or none that loads, is taken for
    no glibc, so that the server starts and serves without the tuning rather than stopping on an AttributeError."""
    monkeypatch.setattr(memory.ctypes, "CDLL", lambda name: SimpleNamespace(malloc_trim=lambda pad: 1))
    assert memory._libc() is None
    assert configure_allocator() is False and page_out_gpu_libraries() == 0 and release_memory() > 0

    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(memory.ctypes, "CDLL", no_library)
    assert memory._libc() is None and configure_allocator() is False


class RecordingLibc:
    """glibc's allocator calls recorded instead of made, each accepted but the madvise of ``refused`` starts."""

    def __init__(self, refused: tuple[int, ...] = ()):
        self.calls: list[tuple] = []
        self.refused = refused

        def madvise(start, length, advice):  # a function, so that the code may set its argtypes
            self.calls.append(("madvise", start.value, length.value, advice))
            return -1 if start.value in refused else 0

        self.madvise = madvise

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        return 1


def test_the_allocator_is_tuned_and_trimmed_by_glibcs_own_parameter_numbers(monkeypatch):
    """mallopt takes a parameter number (malloc.h: M_TRIM_THRESHOLD -1, M_MMAP_THRESHOLD -3, M_ARENA_MAX -8): a
    wrong one tunes something else and still answers success, so only the calls themselves tell. The heap top is
    trimmed at twice the mmap threshold, and a release trims every arena to nothing (pad 0)."""
    libc = RecordingLibc()
    monkeypatch.setattr(memory, "_libc", lambda: libc)
    assert configure_allocator(mmap_threshold=3 << 20, arena_max=2) is True
    assert sorted(libc.calls) == [("mallopt", -8, 2), ("mallopt", -3, 3 << 20), ("mallopt", -1, 6 << 20)]
    libc.calls.clear()
    assert release_memory() > 0 and libc.calls == [("malloc_trim", 0)]


def test_each_cuda_mapping_is_advised_whole_to_page_out_and_only_the_accepted_ones_are_counted(monkeypatch):
    """MADV_PAGEOUT is advice 21 (Linux's mman-common.h; 20, MADV_COLD, only ages the pages), over each mapping's
    own length; a mapping the kernel refuses is not counted as handed back."""
    libc = RecordingLibc(refused=(0x7F0000500000,))
    monkeypatch.setattr(memory, "_libc", lambda: libc)
    monkeypatch.setattr(memory, "Path", lambda path: SimpleNamespace(read_text=lambda: MAPS))
    assert page_out_gpu_libraries() == 0x400000
    assert libc.calls == [("madvise", 0x7F0000000000, 0x200000, 21), ("madvise", 0x7F0000200000, 0x200000, 21),
                          ("madvise", 0x7F0000500000, 0x100000, 21)]


def test_without_a_readable_proc_nothing_is_advised_and_start_up_goes_on(monkeypatch):
    """``/proc/self/maps`` unreadable (no /proc, or access denied): nothing is advised and 0 bytes are counted,
    rather than an error that would stop the server's start after its warm-up."""
    libc = RecordingLibc()
    monkeypatch.setattr(memory, "_libc", lambda: libc)

    def denied():
        raise PermissionError("/proc/self/maps")

    monkeypatch.setattr(memory, "Path", lambda path: SimpleNamespace(read_text=denied))
    assert page_out_gpu_libraries() == 0 and libc.calls == []


def test_the_mappings_advised_are_those_this_process_has_mapped(monkeypatch):
    """The mappings come from the process's own ``/proc/self/maps``: read from anywhere else the page-out finds
    nothing, advises nothing and the CUDA libraries' 250 MB stay resident, in silence (the test above on the real
    libraries skips where torch maps none, a CPU-only build).  A library surely mapped here, ctypes' own extension
    module, stands in for a CUDA library."""
    libc = RecordingLibc()
    monkeypatch.setattr(memory, "_libc", lambda: libc)
    choose = memory.gpu_library_ranges
    monkeypatch.setattr(memory, "gpu_library_ranges", lambda maps_text: choose(maps_text, (_ctypes.__file__,)))
    with open("/proc/self/maps") as maps:
        mapped = choose(maps.read(), (_ctypes.__file__,))
    assert mapped, "ctypes' extension module is not mapped from its file here"
    assert page_out_gpu_libraries() == sum(end - start for start, end in mapped)
    assert [(start, length) for _, start, length, _ in libc.calls] == [(start, end - start) for start, end in mapped]


def test_the_resident_set_is_read_in_bytes_from_the_kibibytes_proc_gives(monkeypatch):
    status = "Name:\tcaptioner\nVmHWM:\t  999 kB\nVmRSS:\t  1234 kB\nThreads:\t4\n"
    monkeypatch.setattr(memory, "Path", lambda path: SimpleNamespace(read_text=lambda: status))
    assert resident_bytes() == 1234 * 1024

    for missing in (FileNotFoundError, PermissionError):  # no /proc, or one this process may not read

        def no_proc(missing=missing):
            raise missing("/proc/self/status")

        monkeypatch.setattr(memory, "Path", lambda path, no_proc=no_proc: SimpleNamespace(read_text=no_proc))
        assert resident_bytes() == 0  # a number still (the app logs it in MiB), where there is no /proc


def test_the_idle_trimmers_release_gives_the_memory_back_and_defers_the_next_to_the_end_of_its_interval(monkeypatch):
    """The release a trimmer schedules calls release_memory; the next is deferred to the end of the interval the
    last release began (here 100 s + 60 s, asked at 130 s: 30 s), not a whole interval from the asking; and a request
    that comes while a release runs (the work it freed is not in that release) schedules the next, never dropped."""
    now, released, started = [100.0], [], []
    trimmer = IdleTrimmer(interval_s=60.0)

    def release():
        released.append(now[0])
        trimmer()  # a batcher falls idle again while the release runs

    monkeypatch.setattr(memory, "release_memory", release)
    monkeypatch.setattr(memory, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(threading.Timer, "start", lambda timer: started.append(timer))
    trimmer()
    assert released == [] and [timer.interval for timer in started] == [0.0]  # scheduled, not yet run
    assert started[0].daemon  # a release still pending never holds up the process's exit
    started[0].function()
    assert released == [100.0] and len(started) == 2 and started[1].interval == 60.0
    now[0] = 130.0
    trimmer()  # already scheduled: nothing more
    assert len(started) == 2
    monkeypatch.setattr(memory, "release_memory", lambda: released.append(now[0]))
    started[1].function()
    now[0] = 145.0
    trimmer()
    assert released == [100.0, 130.0] and started[2].interval == 45.0  # 130 + 60 - 145


def test_a_release_that_comes_due_while_work_runs_skips_and_the_works_end_asks_again(monkeypatch):
    """A deferred release that finds work running (a burst began within the interval) skips it: malloc_trim holds
    each arena's lock while it returns that arena's pages, under the work.  Skipped, it moves no interval on, so
    the work's end (the next call) schedules a release at once, and that one runs."""
    now, released, started, busy = [100.0], [], [], [True]
    monkeypatch.setattr(memory, "release_memory", lambda: released.append(now[0]))
    monkeypatch.setattr(memory, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(threading.Timer, "start", lambda timer: started.append(timer))
    trimmer = IdleTrimmer(interval_s=60.0, busy=lambda: busy[0])
    trimmer()
    started[0].function()
    assert released == []
    now[0], busy[0] = 103.0, False
    trimmer()
    assert [timer.interval for timer in started] == [0.0, 0.0]
    started[1].function()
    assert released == [103.0]


class _Node:
    pass


def _unreachable_cycle() -> weakref.ref:
    """A weak reference to an object that refers to itself and nothing else does: only a collection frees it."""
    node = _Node()
    node.itself = node
    return weakref.ref(node)


def test_start_up_garbage_is_collected_before_the_rest_is_frozen():
    """What start-up left unreachable (a reference cycle) is collected first: frozen, it could never be freed
    while the server runs. The count returned is the collector's own."""
    gone = _unreachable_cycle()
    enabled = gc.isenabled()
    gc.disable()  # no automatic collection between here and the freeze: only the function's own may free it
    gc.unfreeze()
    try:
        frozen = freeze_startup_objects()
        assert gone() is None, "an unreachable cycle was frozen with the living"
        # threads other tests left may free frozen objects meanwhile: the count can only fall, and only a little
        assert 0 <= frozen - gc.get_freeze_count() <= frozen // 100 and frozen > 0
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def test_the_apps_idle_trimmer_releases_at_most_every_five_seconds(monkeypatch):
    """The app makes its trimmer with the default interval, the 5 s docs/decisions.md gives ("Memory after a
    burst"): asked 1 s after a release, the next waits the 4 s left."""
    now, started = [100.0], []
    monkeypatch.setattr(memory, "release_memory", lambda: 0)
    monkeypatch.setattr(memory, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(threading.Timer, "start", lambda timer: started.append(timer))
    trimmer = IdleTrimmer()
    trimmer()
    started[0].function()
    now[0] = 101.0
    trimmer()
    assert [timer.interval for timer in started] == [0.0, 4.0]


@pytest.mark.parametrize("path", ["/opt/conda/lib/libcublasLt.so.12", "/opt/conda/lib/libcublas.so.12",
                                  "/usr/local/cuda/lib64/libnvJitLink.so.12", "/opt/conda/lib/libnvrtc.so.12",
                                  "/usr/lib/x86_64-linux-gnu/libcudnn.so.9", "/usr/lib/x86_64-linux-gnu/libnccl.so.2",
                                  "/opt/conda/lib/libcusparseLt.so.0",
                                  "/opt/conda/lib/python3.11/site-packages/torch/lib/libc10_cuda.so"])
def test_a_cuda_library_outside_nvidias_wheels_is_chosen_by_its_own_name(path):
    """A torch from conda or on a system CUDA maps the same libraries from outside ``site-packages/nvidia/``: each is
    known by its own name, not only by the wheel's folder."""
    assert gpu_library_ranges(f"7f0000000000-7f0000200000 r-xp 00000000 00:2a 1001 {path}\n") == \
        [(0x7F0000000000, 0x7F0000200000)]


def test_the_default_mmap_threshold_lies_between_a_decoding_steps_tensors_and_an_encoders_activations(monkeypatch):
    """The pinned threshold is above a decoding step's small tensors (a batch of 16 over a 10,000-word vocabulary:
    640 KB), below the encoder's per-layer activations (tens of MB), and at most glibc's 32 MiB limit; a few bytes
    would map every allocation."""
    libc = RecordingLibc()
    monkeypatch.setattr(memory, "_libc", lambda: libc)
    assert configure_allocator() is True
    threshold = dict((param, value) for _, param, value in libc.calls)[memory.M_MMAP_THRESHOLD]
    assert 1 << 20 <= threshold <= 16 << 20


@pytest.mark.parametrize("refused", [memory.M_MMAP_THRESHOLD, memory.M_ARENA_MAX, memory.M_TRIM_THRESHOLD])
def test_the_allocator_is_said_untuned_when_glibc_refuses_any_one_setting(monkeypatch, refused):
    """mallopt answers 0 for a value it refuses: the tuning is reported done only when all three took."""
    libc = RecordingLibc()
    monkeypatch.setattr(libc, "mallopt", lambda param, value: int(param != refused))
    monkeypatch.setattr(memory, "_libc", lambda: libc)
    assert configure_allocator() is False


def test_a_release_collects_unreachable_cycles_before_trimming(monkeypatch):
    """Memory held only by reference cycles (a finished request's objects, say) goes back too: the collection runs
    first, so malloc_trim finds their blocks free."""
    gone = _unreachable_cycle()
    libc = RecordingLibc()
    monkeypatch.setattr(memory, "_libc", lambda: libc)
    enabled = gc.isenabled()
    gc.disable()  # no automatic collection before the release: only its own may free the cycle
    try:
        release_memory()
        assert gone() is None and libc.calls == [("malloc_trim", 0)]
    finally:
        if enabled:
            gc.enable()


def test_a_trimmer_that_cannot_start_its_thread_neither_raises_nor_stops_trying(monkeypatch):
    """``Timer.start`` raises RuntimeError when no thread can be had: the caller (a request finishing, a batcher's
    worker) is not failed, and the next call tries again rather than finding a release still 'scheduled'."""
    started = []

    def no_thread(timer):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Timer, "start", no_thread)
    trimmer = IdleTrimmer(interval_s=60.0)
    trimmer()
    monkeypatch.setattr(threading.Timer, "start", lambda timer: started.append(timer))
    trimmer()
    assert len(started) == 1
