"""Device selection (models/device.py): ``auto`` and explicit devices, the autocast of each precision name, the
thread counts and the hardware line of a model card, with CUDA's answers stood in for where a test needs a GPU."""

import logging
import os
import platform

import pytest
import torch

from captioner.models.device import PRECISIONS, autocast, describe_hardware, resolve_device, set_threads


def test_auto_takes_the_gpu_when_there_is_one_and_an_absent_one_is_refused_by_any_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda") and resolve_device("cuda:1") == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device() == resolve_device("cpu") == torch.device("cpu")
    for name in ("cuda", "cuda:0"):  # the GPU's index is no way around the check
        with pytest.raises(ValueError, match=f"^device '{name}' was requested but no CUDA GPU is available"):
            resolve_device(name)
    with pytest.raises(ValueError, match="^unknown device 'gpu': use auto, cpu or cuda"):
        resolve_device("gpu")


def test_a_gpu_index_past_the_last_gpu_is_refused_by_name_rather_than_at_the_first_tensor_moved(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0) and resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(ValueError, match=r"^device 'cuda:1' was requested but this machine has 1 CUDA GPU \(cuda:0\)$"):
        resolve_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"^device 'cuda:2' was requested but this machine has 2 CUDA GPUs \(cuda:0 "
                                         r"to cuda:1\)"):
        resolve_device("cuda:2")


def test_a_device_that_is_not_cuda_is_handed_on_with_the_index_it_was_given():
    """``--device`` takes any type torch knows: ``xpu:1`` asks for the second such accelerator, and a run moved onto
    the first one instead would share it with whatever already runs there, without a word. Only CUDA's indices are
    checked against the GPUs present here; the others are handed on as given (made, not used: no such device is
    needed)."""
    for name in ("xpu:1", "mps:0", "xpu", "cpu"):
        assert resolve_device(name) == torch.device(name), name


def test_each_precision_name_autocasts_to_its_dtype_and_float32_to_nothing():
    assert PRECISIONS == {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
    cpu, x = torch.device("cpu"), torch.ones(2, 2)
    with autocast(cpu, None):
        assert (x @ x).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
    for dtype in (torch.bfloat16, torch.float16):  # on the device's own type, not CUDA's
        with autocast(cpu, dtype):
            assert (x @ x).dtype == dtype


def test_threads_and_inter_op_threads_are_set_apart_and_a_late_inter_op_count_is_a_warning(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(("intra", n)))
    monkeypatch.setattr(torch, "set_num_interop_threads", lambda n: calls.append(("inter", n)))
    set_threads(3, 2)
    set_threads(None)
    assert calls == [("intra", 3), ("inter", 2)]

    def too_late(n):
        raise RuntimeError("cannot set number of interop threads after parallel work has started")

    monkeypatch.setattr(torch, "set_num_interop_threads", too_late)
    with caplog.at_level(logging.WARNING, "captioner.device"):
        set_threads(None, 4)
    assert "cannot set inter-op threads to 4" in caplog.text


def test_the_hardware_line_names_the_gpu_or_this_processs_share_of_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"Tesla {device}")
    assert describe_hardware(torch.device("cuda", 1)) == "Tesla cuda:1 GPU"
    # this process's cores (pid 0), not another's
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 7} if pid == 0 else set(range(64)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # a container's 3 of the host's 64
    assert describe_hardware(torch.device("cpu")) == f"3-core {platform.machine()} CPU, no GPU"
    monkeypatch.delattr(os, "sched_getaffinity")  # macOS and Windows have no affinity: every core counts
    assert describe_hardware(torch.device("cpu")) == f"64-core {platform.machine()} CPU, no GPU"


def test_the_hardware_line_names_the_gpu_of_a_device_given_without_an_index(monkeypatch):
    """``resolve_device("auto")`` hands back ``cuda`` with no index: a run on it ran on a GPU, and its model card says
    so, rather than naming the CPU because the device has no number."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert describe_hardware(resolve_device("auto")) == "Tesla T4 GPU"


def test_autocast_is_made_for_the_devices_own_type_whatever_it_is():
    """``--device`` takes any type torch knows (xpu, mps), not only cpu and cuda: autocasting such a device's work on
    the CPU's type instead would leave its arithmetic in float32 without a word. Made, not entered: no such device
    is needed."""
    for kind in ("xpu", "mps"):
        assert autocast(torch.device(kind), torch.bfloat16).device == kind
