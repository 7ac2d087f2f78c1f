"""int8 CNN: ONNX Runtime static quantization of the frozen visual encoder (``visual.onnx`` →
``visual-int8-<recipe>.onnx`` beside it), run as the float CNN is (``sessions.VisualSession``).

Static (calibrated) rather than dynamic quantization: dynamic quantization turns convolutions into
``ConvInteger``, which ONNX Runtime's CPU provider runs slower than float; a QDQ graph with calibrated activation
ranges is fused into ``QLinearConv`` kernels.  Only dense convolutions and matrix products are quantized (weights
int8 per output channel, activations uint8 with 99.99th-percentile ranges): depthwise convolutions, pooling,
resizing and the hypercolumn concatenation stay float, so the grid features come out in float32 as from the float
graph.  On an x86 CPU without VNNI the weights are uint8 too (:func:`int8_kernels`): int8 weights saturate there.
Calibration uses generated scenes of a seed that no dataset split uses, prepared exactly as the service prepares
uploads.  Whether captions survive is measured by
``captioner eval --encoder-precision int8`` against the float encoder (``benchmarks/bench_int8.py``), not
assumed: docs/decisions.md, "int8 CNN by ONNX Runtime static quantization".
"""

from __future__ import annotations

import functools
import os
import platform
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..encoder import EncoderSpec, GridEncoder, preprocess

#: bump when the quantization recipe changes: the int8 file and the feature caches of int8 encoders are keyed by
#: it, so an export cache (the service's, ``captioner eval``'s) never serves a graph quantized the old way
RECIPE = "qdq-percentile-dense-3"
#: CPU flags of the instructions ONNX Runtime's x86 u8×s8 kernels multiply with when the CPU has them
VNNI_FLAGS = frozenset({"avx_vnni", "avx512_vnni", "amx_int8"})
#: activation range: this percentile of the calibration values (MinMax lets rare outliers widen every step)
PERCENTILE = 99.99
CALIBRATION_IMAGES, CALIBRATION_SEED = 32, 90817
ENCODER_PRECISIONS = ("float32", "int8")
#: graph-name prefixes of the layers kept float, the high-resolution start of the network: the stem and the first
#: two stages of EfficientNet-Lite0 (timm names), the stem and ``layer1`` of a torchvision ResNet.  Quantized one
#: at a time on the default checkpoint's hypercolumns, the stem convolution alone gave the features a relative L2
#: error of 0.40 (its BatchNorm-folded filters reach |w| = 17 on some channels and amplify the input's rounding)
#: and the first stage-1 expansion 0.09; every later layer 0.006-0.03.  docs/decisions.md, "int8 CNN by ONNX
#: Runtime static quantization", has the numbers.
FLOAT_PREFIXES = ("/conv_stem/", "/blocks.0/", "/blocks.1/", "/conv1/", "/layer1/")


@functools.cache
def cpu_info(field: str) -> str | None:
    """The value of ``field`` (``flags``, ``model name``) for this machine's first CPU in ``/proc/cpuinfo``; None
    where there is no such file (macOS, Windows) or no such field.  Read once per field and process."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((value.strip() for name, _, value in (line.partition(":") for line in lines)
                 if name.strip() == field), None)


def _cpu_flags() -> frozenset[str] | None:
    """The instruction-set flags of this machine's CPU; None where they cannot be read."""
    flags = cpu_info("flags")
    return None if flags is None else frozenset(flags.split())


#: the int8 CNN's kinds, by their kernels: int8 weights (u8s8) or uint8 weights (u8u8)
INT8_KERNELS = ("u8s8", "u8u8")


def int8_kernels(machine: str | None = None, flags: frozenset[str] | None = None) -> str:
    """``u8s8`` (uint8 activations, int8 weights) or ``u8u8``: the weights' type that computes the quantized graph
    faithfully on this CPU (``machine``/``flags``: another's, for tests).  Without VNNI an x86 CPU runs ONNX
    Runtime's u8×s8 kernels on ``VPMADDUBSW``, whose 16-bit sums of two products saturate (ONNX Runtime's
    quantization guide); measured on an AVX2 EPYC, that raised the default checkpoint's feature error against the
    float CNN from 0.103 to 0.158.  u8×u8 kernels widen to 16 bits before multiplying and do not saturate: 0.102
    there.  docs/decisions.md, "int8 on CPUs without VNNI"."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return "u8s8"  # VPMADDUBSW, the saturating instruction, is x86's
    flags = _cpu_flags() if flags is None else flags
    return "u8s8" if flags and flags & VNNI_FLAGS else "u8u8"  # unknown flags: the kernels that are right anywhere


def int8_recipe(kernels: str | None = None) -> str:
    """The recipe's name with its weights' type where that is not the original's: it names the int8 file and the
    int8 feature caches, so a folder shared by machines of both kinds holds each kind's graph apart."""
    kernels = kernels or int8_kernels()
    return RECIPE if kernels == "u8s8" else f"{RECIPE}-{kernels}"


def int8_file(kernels: str | None = None) -> str:
    """File name of the int8 CNN beside ``visual.onnx`` (:func:`int8_recipe`)."""
    return f"visual-int8-{int8_recipe(kernels)}.onnx"


def calibration_pixels(spec: EncoderSpec, count: int = CALIBRATION_IMAGES) -> np.ndarray:
    """``count`` generated scenes (seed :data:`CALIBRATION_SEED`), preprocessed for ``spec``: ``[count, 3, S, S]``."""
    from ..data.karpathy import load_karpathy
    from ..data.scenes import generate
    from ..images import load_image

    with tempfile.TemporaryDirectory() as tmp:
        # the train split's generator under a seed of its own: images no dataset made with another seed contains
        index = generate(Path(tmp), {"train": count}, seed=CALIBRATION_SEED, progress=False)
        return torch.stack([preprocess(load_image(im.path), spec)[0] for im in load_karpathy(index)]).numpy()


def float_convolutions(graph) -> list[str]:
    """Names of the ``Conv`` nodes of an exported CNN graph that int8 leaves float: the stem and first two stages
    (:data:`FLOAT_PREFIXES`) and every depthwise convolution.  Depthwise ones because one filter per channel leaves
    per-tensor uint8 activations no averaging to hide their rounding in, and they are a small share of the
    arithmetic."""
    return [node.name for node in graph.node if node.op_type == "Conv"
            and (node.name.startswith(FLOAT_PREFIXES) or any(a.name == "group" and a.i > 1 for a in node.attribute))]


def quantized_visual_encoder(spec: EncoderSpec, out_dir: str | Path, visual: GridEncoder | None = None,
                             calibration: int = CALIBRATION_IMAGES, kernels: str | None = None) -> Path:
    """Path of the int8 CNN of ``spec`` in ``out_dir`` (beside its float ``visual.onnx``), made when missing
    (``calibration``: generated scenes that set the activation ranges; ``kernels``: ``u8s8`` or ``u8u8``, the
    weights' type, :func:`int8_kernels`'s choice for this CPU unless given: a benchmark times the other too)."""
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)

    from .folder import SEAL_SUFFIX, intact, seal
    from .onnx import export_visual_encoder

    import onnx

    if kernels not in (None, *INT8_KERNELS):
        raise ValueError(f"kernels must be u8s8 or u8u8, got {kernels!r}")
    float_path = export_visual_encoder(spec, out_dir, visual)
    kernels = kernels or int8_kernels()
    path = float_path.with_name(int8_file(kernels))
    if intact(path):
        return path
    pixels = calibration_pixels(spec, calibration)
    kept_float = float_convolutions(onnx.load(str(float_path)).graph)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"pixels": pixels[i:i + 8]} for i in range(0, len(pixels), 8)])

        def get_next(self):
            return next(self.batches, None)

    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    stray = Path("augmented_model.onnx")
    someone_elses = stray.exists()  # before quantize_static could write one: not ours to remove
    try:
        quantize_static(str(float_path), str(tmp), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8 if kernels == "u8s8" else QuantType.QUInt8,
                        op_types_to_quantize=["Conv", "MatMul", "Gemm"], nodes_to_exclude=kept_float,
                        calibrate_method=CalibrationMethod.Percentile, extra_options={"CalibPercentile": PERCENTILE})
        seal(path, written=tmp)
        os.replace(tmp, path)  # a concurrent reader sees the whole file or none
        current = {name + suffix for name in map(int8_file, INT8_KERNELS) for suffix in ("", SEAL_SUFFIX)}
        for earlier in path.parent.glob("visual-int8-*"):  # an earlier recipe's graph and seal: asked for no more
            if earlier.name not in current:
                earlier.unlink(missing_ok=True)
    finally:
        tmp.unlink(missing_ok=True)
        # quantize_static leaves its augmented calibration model in the working directory on some versions
        if not someone_elses:
            stray.unlink(missing_ok=True)
    return path


def visual_encoder_path_at(spec: EncoderSpec, out_dir: str | Path, precision: str = "float32") -> Path:
    """Where the ONNX CNN of ``spec`` at ``precision`` lives in ``out_dir``, whether or not it is there yet: the
    float graph, or this CPU's int8 graph beside it (:func:`int8_file`)."""
    from .onnx import visual_encoder_path

    if precision not in ENCODER_PRECISIONS:
        raise ValueError(f"encoder precision must be one of {ENCODER_PRECISIONS}, got {precision!r}")
    path = visual_encoder_path(spec, out_dir)
    return path.with_name(int8_file()) if precision == "int8" else path


def visual_encoder_file(spec: EncoderSpec, out_dir: str | Path, precision: str = "float32",
                        make_visual: Callable[[], GridEncoder | None] = lambda: None) -> Path:
    """The ONNX CNN of ``spec`` at ``precision`` (``float32`` or ``int8``), exported (and quantized) when missing.
    ``make_visual`` gives the PyTorch encoder to export (None: the exporter builds one); it is called only when
    the file must be made, so a server whose exports exist never builds the PyTorch CNN."""
    from .folder import intact
    from .onnx import export_visual_encoder

    path = visual_encoder_path_at(spec, out_dir, precision)
    if intact(path):
        return path
    if precision == "int8":
        return quantized_visual_encoder(spec, out_dir, make_visual())
    return export_visual_encoder(spec, out_dir, make_visual())
