"""Every ONNX Runtime session the project opens (the service's, ``captioner eval``'s ONNX CNN and the export's own
check) is made here, so that a graph runs alike wherever it is checked or used: the session options, the execution
providers for a device, running a session on torch tensors (bound on the GPU), and :class:`VisualSession`, the
frozen CNN's session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def session_options(threads: int | None = None, quiet: bool = False):
    """``onnxruntime.SessionOptions``: ``threads`` intra-op threads (None: one per core), every graph optimisation,
    no memory arena, and ONNX Runtime's errors logged (severity 3: its warnings are not), only fatal ones when
    ``quiet`` (the export reports a failure itself)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4 if quiet else 3
    if threads:
        options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Without its arena, ONNX Runtime returns each run's buffers to the allocator instead of keeping the largest
    # warm-up batch's worth per session (two per model): docs/decisions.md#onnx-runtime-without-its-memory-arena
    options.enable_cpu_mem_arena = False
    # Intra-op threads sleep between runs instead of spinning: every session has a pool of its own (three per
    # model, with the shared CNN), and their spinning took the cores the other sessions, the decoder's Python and
    # the event loop were waiting for (docs/decisions.md#onnx-runtime-threads-that-do-not-spin)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def execution_providers(device: torch.device) -> list:
    """The providers a session on ``device`` asks for, first choice first: CUDA's on a CUDA device where this
    ``onnxruntime`` package has it, then the CPU's."""
    import onnxruntime as ort

    if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        return [("CUDAExecutionProvider", {"device_id": device.index or 0}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def cuda_provider_available(device: torch.device) -> bool:
    """Whether ONNX Runtime offers its CUDA execution provider for ``device`` (a CUDA device, and an ``onnxruntime``
    package built with CUDA): the provider its sessions there are asked to run on first."""
    first = execution_providers(device)[0]  # a provider is a name, or (name, options)
    return (first[0] if isinstance(first, tuple) else first) == "CUDAExecutionProvider"


def open_session(path: str | Path, device: torch.device, threads: int | None = None, quiet: bool = False):
    """An ``onnxruntime.InferenceSession`` of the graph at ``path`` for ``device``, with the project's options."""
    import onnxruntime as ort

    return ort.InferenceSession(str(path), session_options(threads, quiet), providers=execution_providers(device))


def runs_on_gpu(session, device: torch.device) -> bool:
    """Whether ``session`` runs on ``device``'s GPU (the CUDA provider loaded: it can fail to, falling back)."""
    return session.get_providers()[0] == "CUDAExecutionProvider" and device.type == "cuda"


def run_session(session, inputs: dict[str, torch.Tensor], outputs: list[str], device: torch.device,
                on_gpu: bool) -> list[torch.Tensor]:
    """Run an ONNX Runtime session on torch tensors, returning torch tensors on the same device."""
    if not on_gpu:
        # CPU: numpy views of torch tensors and back, no copies
        feed = {name: inputs[name].detach().contiguous().numpy() for name in inputs}
        return [torch.from_numpy(np.ascontiguousarray(v)) for v in session.run(outputs, feed)]
    # CUDA: bind device buffers directly (I/O binding), so nothing goes through host memory.  The contiguous
    # copies are held until the run ends (a copy dropped after binding could be reused by PyTorch's allocator
    # while ONNX Runtime reads it), and PyTorch's stream is drained first: ONNX Runtime reads the buffers on a
    # stream of its own, whose order after the kernels that wrote them would otherwise rest on how each library
    # happens to create its streams
    bound = {name: tensor.contiguous() for name, tensor in inputs.items()}
    torch.cuda.current_stream(device).synchronize()
    binding = session.io_binding()
    for name, tensor in bound.items():
        binding.bind_input(name, "cuda", device.index or 0, _NUMPY_DTYPES[tensor.dtype], tuple(tensor.shape),
                           tensor.data_ptr())
    for name in outputs:
        binding.bind_output(name, "cuda", device.index or 0)
    session.run_with_iobinding(binding)
    return [torch.from_dlpack(value) for value in binding.get_outputs()]


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32,
                 torch.bool: np.bool_}


class VisualSession:
    """The frozen CNN of one encoder spec on ONNX Runtime (``visual.onnx``, or its int8 copy: pixels → grid
    features). The service shares one per spec between its models; ``captioner eval --encoder-precision`` extracts
    features with one, called as a :class:`~captioner.models.encoder.GridEncoder` is."""

    def __init__(self, path: str | Path, device: torch.device | str = "cpu", threads: int | None = None):
        self.device, self.path = torch.device(device), Path(path)
        self.session = open_session(path, self.device, threads)
        self.providers = self.session.get_providers()
        self.on_gpu = runs_on_gpu(self.session, self.device)

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """Grid features ``[B, rows·cols, feat_dim]`` of preprocessed ``pixels [B, 3, H, W]`` on this device."""
        (feats,) = run_session(self.session, {"pixels": pixels}, ["features"], self.device, self.on_gpu)
        return feats

    __call__ = features
