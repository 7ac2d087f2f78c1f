"""The options of every ONNX Runtime session the project opens: the service's, ``captioner eval``'s int8 CNN and
the export's own check, so that a graph runs alike wherever it is checked or used."""

from __future__ import annotations


def session_options(threads: int | None = None, quiet: bool = False):
    """``onnxruntime.SessionOptions``: ``threads`` intra-op threads (None: one per core), every graph optimisation,
    no memory arena, and warnings logged unless ``quiet`` (the export reports a failure itself)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4 if quiet else 3
    if threads:
        options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Without its arena, ONNX Runtime returns each run's buffers to the allocator instead of keeping the largest
    # warm-up batch's worth per session (two per model): docs/decisions.md#onnx-runtime-without-its-memory-arena
    options.enable_cpu_mem_arena = False
    return options
