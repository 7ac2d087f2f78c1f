"""int8 CNN (models/export/quantize.py): the quantized graph really holds int8 weights, its features stay close to
the float graph's, the service serves it when CAPTIONER_ENCODER_PRECISION=int8 (decoder graphs still verified
against the PyTorch decoder on the same features), and ``captioner eval --encoder-precision int8`` scores it."""

from __future__ import annotations

import json
import platform
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnxruntime import quantization
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType

from captioner.models.checkpoint import save_checkpoint
from captioner.models.data.karpathy import load_karpathy
from captioner.models.data.scenes import generate
from captioner.models.encoder import EncoderSpec, preprocess
from captioner.models.export import quantize
from captioner.models.export.quantize import FLOAT_PREFIXES, INT8_KERNELS, RECIPE, calibration_pixels, \
    float_convolutions, int8_file, int8_kernels, int8_recipe, quantized_visual_encoder, visual_encoder_file, \
    visual_encoder_path_at
from captioner.models.export.sessions import VisualSession
from captioner.models.images import load_image
from captioner.service import backend_choice
from captioner.service import runtime as runtime_module
from captioner.service.cli import main as captioner
from captioner.service.onnx_backends import HybridRuntime

from .conftest import ROOT, module_folder, script_module
from .serving_helpers import TINY_SPEC, random_images, tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def int8_files(request, tmp_path_factory):
    out = module_folder(request, tmp_path_factory, "onnx")
    quantized = quantized_visual_encoder(TINY_SPEC, out, calibration=4)
    return visual_encoder_file(TINY_SPEC, out), quantized


def test_quantized_cnn_holds_int8_weights_and_stays_close_to_float(int8_files):
    float_path, int8_path = int8_files
    assert int8_path.name == int8_file() and int8_path.parent == float_path.parent
    model = onnx.load(str(int8_path))
    # 8-bit filter banks (4-D; their zero points are 8-bit too, but 1-D): uint8 where int8 would saturate
    weight_type = onnx.TensorProto.INT8 if int8_kernels() == "u8s8" else onnx.TensorProto.UINT8
    int8_filters = [t for t in model.graph.initializer if t.data_type == weight_type and len(t.dims) == 4]
    dense = [n.name for n in onnx.load(str(float_path)).graph.node
             if n.op_type == "Conv" and all(a.name != "group" or a.i == 1 for a in n.attribute)]
    early = [name for name in dense if name.startswith(FLOAT_PREFIXES)]
    assert "/conv_stem/Conv" in early and len(early) < len(dense) // 2
    # every dense convolution past the first two stages quantized; those and the depthwise ones float
    assert len(int8_filters) == len(dense) - len(early) > 0
    pixels = torch.from_numpy(calibration_pixels(TINY_SPEC, 6)[4:])  # scenes the calibration did not see
    want = VisualSession(float_path, "cpu", 1)(pixels)
    got = VisualSession(int8_path, "cpu", 1)(pixels)
    assert got.shape == want.shape and got.dtype == torch.float32
    cosine = torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1))
    # quantization noise, not another network: measured 0.997, and two different scenes' features score 0.56
    assert cosine.min() > 0.98, cosine
    assert not torch.equal(got, want)


def test_the_other_kind_of_int8_cnn_is_made_on_request_beside_this_cpus(int8_files):
    """``kernels=``: the weights' type this CPU would not choose (a benchmark times both kinds side by side)."""
    float_path, own = int8_files
    other = "u8u8" if int8_kernels() == "u8s8" else "u8s8"
    out = float_path.parent.parent  # the fixture's CAPTIONER_ONNX_DIR: the CNN's folder is below it
    made = quantized_visual_encoder(TINY_SPEC, out, calibration=2, kernels=other)
    assert made.name == int8_file(other) and own.is_file()  # this CPU's kind stays
    weight_type = onnx.TensorProto.INT8 if other == "u8s8" else onnx.TensorProto.UINT8
    assert any(t.data_type == weight_type and len(t.dims) == 4 for t in onnx.load(str(made)).graph.initializer)
    with pytest.raises(ValueError, match="u8s8 or u8u8"):
        quantized_visual_encoder(TINY_SPEC, out, calibration=2, kernels="s8s8")


def test_service_serves_the_int8_cnn_and_verifies_decoder_graphs_on_its_features(tmp_path, int8_files):
    ckpt = tiny_checkpoint("sat")
    save_checkpoint(tmp_path / "weights" / "sat", ckpt.model, ckpt.vocab, ckpt.encoder)
    onnx_dir = int8_files[0].parent.parent
    runtimes = runtime_module.load_runtimes(tmp_path / "weights", [], device_name="cpu", default_backend="auto",
                                            onnx_dir=onnx_dir, threads=1, encoder_precision="int8")
    runtime = runtimes["sat"]
    assert runtime.backend == "onnx" and runtime.visual.path == int8_files[1]
    prepared = [runtime.prepare(image) for image in random_images(2, seed=4)]
    hybrid = HybridRuntime("sat", tiny_checkpoint("sat"), runtime.visual, torch.device("cpu"))
    got = [r.hypothesis.token_ids for r in runtime.caption(prepared, 2, 6)]
    assert got == [r.hypothesis.token_ids for r in hybrid.caption(prepared, 2, 6)]


def test_int8_backends_are_verified_on_the_int8_features_not_against_pytorchs_float_captions(tmp_path, int8_files,
                                                                                               monkeypatch):
    """An int8 CNN changes the features, so PyTorch's float captions are no reference for its decoder graphs: they
    are verified against PyTorch's decoder on the same int8 features, and serve even where the float captions
    differ (made to here)."""
    ckpt = tiny_checkpoint("sat")
    save_checkpoint(tmp_path / "weights" / "sat", ckpt.model, ckpt.vocab, ckpt.encoder)

    def float_captions_that_differ(name, ckpt, encoders, prepared):
        return [[0]] * len(prepared)

    monkeypatch.setattr(backend_choice, "reference_captions", float_captions_that_differ)
    runtimes = runtime_module.load_runtimes(tmp_path / "weights", [], device_name="cpu", default_backend="auto",
                                            onnx_dir=int8_files[0].parent.parent, threads=1, encoder_precision="int8")
    assert runtimes["sat"].backend == "onnx" and runtimes["sat"].visual.path == int8_files[1]


def test_eval_scores_the_int8_cnn(tmp_path, int8_files, capsys):
    ckpt = tiny_checkpoint("sat")
    save_checkpoint(tmp_path / "ckpt", ckpt.model, ckpt.vocab, ckpt.encoder)
    generate(tmp_path / "scenes", {"test": 3}, seed=3, progress=False)
    reports = {}
    for precision in ("float32", "int8"):
        out = tmp_path / f"{precision}.json"
        captioner(["eval", str(tmp_path / "ckpt"), "--dataset", str(tmp_path / "scenes"), "--no-meteor",
                   "--threads", "1", "--cache-dir", str(tmp_path / "features"), "--onnx-dir",
                   str(int8_files[0].parent.parent), "--encoder-precision", precision, "--output", str(out)])
        reports[precision] = json.loads(out.read_text())
    assert reports["int8"]["encoder_precision"] == "int8"
    assert reports["int8"]["test"]["images"] == reports["float32"]["test"]["images"] == 3
    # the int8 features went to their own cache, beside the float ones
    caches = sorted(p.name for p in (tmp_path / "features").iterdir())
    assert len(caches) == 2 and f"onnx-int8-{int8_recipe()}" in caches
    assert np.isfinite(reports["int8"]["test"]["CIDEr-D"])
    # and the captions were made from the int8 CNN's features: close to the float ones, not the same
    float_cache, int8_cache = (next((tmp_path / "features" / c).rglob("shard-*.npy")) for c in
                               sorted(caches, key=lambda c: c.startswith("onnx-int8-")))
    full, quantized = (torch.from_numpy(np.load(p)).flatten(1).float() for p in (float_cache, int8_cache))
    assert not torch.equal(full, quantized)
    assert torch.nn.functional.cosine_similarity(full, quantized).min() > 0.98


def test_quantizing_replaces_an_earlier_recipe_and_leaves_the_working_folder_alone(tmp_path, monkeypatch):
    """A new recipe's int8 graph replaces the earlier recipe's (a file name each, in the CNN's folder), and the
    cleanup after older ONNX Runtime versions, which wrote ``augmented_model.onnx`` into the working folder, leaves
    a file of that name it did not make (a user's own, in the folder the server was started from)."""
    monkeypatch.chdir(tmp_path)
    theirs = tmp_path / "augmented_model.onnx"
    theirs.write_bytes(b"someone's model")
    float_path = visual_encoder_file(TINY_SPEC, tmp_path / "onnx")
    # and an earlier recipe's graph beside the float one goes when this recipe's is written, while the graph this
    # recipe makes for the other kind of CPU (a folder shared by machines of both kinds) stays
    for name in ("visual-int8-qdq-minmax-1.onnx", "visual-int8-qdq-minmax-1.onnx.sha256"):
        (float_path.parent / name).write_bytes(b"old")
    other_kind = int8_file("u8u8" if int8_kernels() == "u8s8" else "u8s8")
    for name in (other_kind, other_kind + ".sha256"):
        (float_path.parent / name).write_bytes(b"the other kind's")
    # a graph another process is writing (quantized_visual_encoder's temporary name): removing it failed that one
    writing = f".{other_kind}.99999"
    (float_path.parent / writing).write_bytes(b"half written")
    quantized = quantized_visual_encoder(TINY_SPEC, tmp_path / "onnx", calibration=2)
    assert theirs.read_bytes() == b"someone's model"
    assert sorted(p.name for p in float_path.parent.iterdir()) == sorted(
        [float_path.name, float_path.name + ".sha256", quantized.name, quantized.name + ".sha256", "visual.json",
         other_kind, other_kind + ".sha256", writing])


@pytest.mark.parametrize("machine, flags, kernels", [
    ("x86_64", {"avx2", "avx512f", "avx512_vnni"}, "u8s8"),  # Cascade Lake and later: VPDPBUSD does not saturate
    ("x86_64", {"avx2", "avx_vnni"}, "u8s8"),                # Alder Lake's AVX-VNNI
    ("x86_64", {"avx2", "fma"}, "u8u8"),                     # AVX2 alone: VPMADDUBSW saturates
    ("x86_64", {"avx2", "avx512f", "avx512bw"}, "u8u8"),     # AVX-512 before VNNI (Skylake-SP) saturates too
    ("x86_64", frozenset(), "u8u8"),                         # flags unknown: the kernels right on any x86 CPU
    ("AMD64", {"avx2", "fma"}, "u8u8"),                      # how Windows names x86-64
    ("aarch64", frozenset(), "u8s8"),
])
def test_the_weights_type_follows_whether_the_cpus_int8_kernels_saturate(machine, flags, kernels):
    assert int8_kernels(machine, frozenset(flags)) == kernels
    # each kind has a file of its own, so a folder shared by both kinds of machine keeps both graphs
    assert int8_file(kernels) != int8_file("u8u8" if kernels == "u8s8" else "u8s8")


def test_a_32_bit_x86_cpu_without_vnni_takes_the_kernels_that_do_not_saturate():
    """32-bit Python names an x86 CPU ``x86`` (Windows) or ``i686``/``i386`` (Linux): its u8×s8 kernels saturate
    without VNNI just as x86-64's do, so it must get the uint8 weights too, not the int8 ones ARM CPUs get."""
    for machine in ("x86", "i686", "i386"):
        assert int8_kernels(machine, frozenset({"sse2", "avx2"})) == "u8u8", machine
        assert int8_kernels(machine, frozenset({"avx2", "avx512_vnni"})) == "u8s8", machine


def test_graphs_made_before_the_weights_type_followed_the_cpu_are_served_only_where_they_were_right():
    """The int8 graphs made before (int8 weights) carry the recipe's name: a VNNI machine keeps serving its own, and
    one without VNNI must not pick it up and saturate, so its uint8 graph and feature cache are named apart."""
    assert int8_recipe("u8s8") == RECIPE and int8_file("u8s8") == f"visual-int8-{RECIPE}.onnx"
    assert int8_recipe("u8u8") != RECIPE


def test_the_int8_cnn_lies_beside_the_float_one_under_this_cpus_name_and_another_precision_is_refused(tmp_path):
    float_path = visual_encoder_path_at(TINY_SPEC, tmp_path)
    assert visual_encoder_path_at(TINY_SPEC, tmp_path, "int8") == float_path.with_name(int8_file())
    with pytest.raises(ValueError, match="encoder precision must be one of .*'float16'"):
        visual_encoder_path_at(TINY_SPEC, tmp_path, "float16")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # where it would be: nothing made


@pytest.mark.parametrize("kernels", INT8_KERNELS)
def test_the_int8_cnn_looked_for_is_the_kind_this_cpu_computes_faithfully(tmp_path, monkeypatch, kernels):
    """On a CPU without VNNI the int8 CNN served is the uint8-weights graph: looking for the int8-weights one there
    served the graph whose sums saturate, or quantized again at every start a file never looked for (this
    machine's own kind alone would not tell the two apart)."""
    monkeypatch.setattr(quantize, "int8_kernels", lambda: kernels)
    assert visual_encoder_path_at(TINY_SPEC, tmp_path, "int8").name == int8_file(kernels)


def benchmarks_common():
    """benchmarks/common.py, which its scripts import as ``common`` from their own folder."""
    return script_module(ROOT / "benchmarks" / "common.py")


CPUINFO = ("processor\t: {n}\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon {n}: test\n"
           "flags\t\t: fpu sse2 avx2 fma {extra}\nvmx flags\t: vnmi preemption_timer\nbugs\t\t: spectre_v1\n\n")


@pytest.mark.parametrize("cpuinfo, kernels", [
    ("".join(CPUINFO.format(n=n, extra="avx512f avx512_vnni") for n in range(2)), "u8s8"),
    ("".join(CPUINFO.format(n=n, extra="avx512f") for n in range(2)), "u8u8"),
    (None, "u8u8"),  # no /proc/cpuinfo (macOS, Windows): flags unknown, the kernels right on any x86 CPU
])
def test_this_cpus_kernels_are_read_from_its_cpuinfo(monkeypatch, cpuinfo, kernels):
    class CpuInfo:
        def __init__(self, path):
            assert str(path) == "/proc/cpuinfo"

        def read_text(self):
            if cpuinfo is None:
                raise FileNotFoundError("/proc/cpuinfo")
            return cpuinfo

    monkeypatch.setattr(quantize, "Path", CpuInfo)
    quantize.cpu_info.cache_clear()  # this machine's flags are cached: read the file given here
    try:
        assert int8_kernels("x86_64") == kernels
        # the benchmarks' headers name the first CPU, the whole value after the first colon (without the file, what
        # platform knows)
        assert quantize.cpu_info("model name") == (None if cpuinfo is None else "Xeon 0: test")
        assert benchmarks_common().cpu_name() == ("Xeon 0: test" if cpuinfo else
                                                  platform.processor() or platform.machine())
    finally:
        quantize.cpu_info.cache_clear()  # and this machine's again for the next test


def test_the_int8_cnn_computes_its_quantized_graph_on_this_cpu(int8_files):
    """The fused int8 kernels this CPU runs compute what the QDQ graph says (ONNX Runtime with graph optimisation
    off runs each QuantizeLinear/DequantizeLinear pair in float: quantization's error without the kernels'). With
    int8 weights on an AVX2 CPU the fused kernels saturate and miss the reference by more than the quantization
    itself misses the float CNN."""
    float_path, int8_path = int8_files
    pixels = calibration_pixels(TINY_SPEC, 6)[4:]

    def features(path, level):
        options = ort.SessionOptions()
        options.graph_optimization_level, options.intra_op_num_threads = level, 1
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return torch.from_numpy(session.run(None, {"pixels": pixels})[0])

    reference = features(int8_path, ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    fused = features(int8_path, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    full = features(float_path, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    kernels_error = ((fused - reference).norm() / reference.norm()).item()
    quantization_error = ((reference - full).norm() / full.norm()).item()
    assert kernels_error < quantization_error / 2, (kernels_error, quantization_error)


@pytest.mark.parametrize("kernels", ["u8s8", "u8u8"])
def test_serving_int8_on_a_cpu_without_vnni_says_it_may_not_pay(tmp_path, monkeypatch, caplog, kernels):
    monkeypatch.setattr(runtime_module, "int8_kernels", lambda: kernels)

    def warned():
        return [r.getMessage() for r in caplog.records if "without VNNI" in r.getMessage()]

    with caplog.at_level("WARNING", logger="captioner.runtime"):
        runtime_module.load_runtimes(tmp_path, [], device_name="cpu", encoder_precision="float32")
        assert not warned()  # one load of each, in one log, let a warning on the float32 load pass for the int8 one
        runtime_module.load_runtimes(tmp_path, [], device_name="cpu", encoder_precision="int8")
    assert len(warned()) == (kernels == "u8u8")


def test_serving_int8_on_a_gpu_says_nothing_of_the_hosts_cpu_kernels(tmp_path, monkeypatch, caplog):
    """The VNNI warning is about the CPU's int8 kernels: a server whose CNN runs on a GPU does not run them, so a host
    CPU without VNNI is no reason to warn there (CUDA is made to look available; no checkpoint loads)."""
    monkeypatch.setattr(runtime_module, "int8_kernels", lambda: "u8u8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level("WARNING", logger="captioner.runtime"):
        runtime_module.load_runtimes(tmp_path, [], device_name="cuda", encoder_precision="int8")
    assert not [r.getMessage() for r in caplog.records if "without VNNI" in r.getMessage()]


def test_an_int8_cnn_already_there_is_returned_not_quantized_again(int8_files, monkeypatch):
    """A second call (a benchmark run again, ``bench_encoder`` opening a session on what it returns) gets the intact
    graph's path back without calibrating and quantizing once more, not None."""
    float_path, int8_path = int8_files

    def must_not_quantize(*args, **options):
        raise AssertionError("an intact int8 CNN was quantized again")

    monkeypatch.setattr(quantization, "quantize_static", must_not_quantize)
    out = float_path.parent.parent  # the fixture's folder: the CNN's graphs are in a folder of it
    assert quantized_visual_encoder(TINY_SPEC, out, kernels=int8_kernels()) == int8_path


def test_an_existing_cnn_is_served_without_building_the_pytorch_encoder(int8_files):
    """``make_visual`` builds the PyTorch CNN (the encoder's ImageNet weights): a server whose exports exist must not
    pay for it, whatever the precision."""
    float_path, int8_path = int8_files
    out = float_path.parent.parent  # the folder both were exported into: each spec's graphs are in a folder of it

    def must_not_build():
        raise AssertionError("the PyTorch CNN was built though its ONNX graph exists")

    assert visual_encoder_file(TINY_SPEC, out, "float32", must_not_build) == float_path
    assert visual_encoder_file(TINY_SPEC, out, "int8", must_not_build) == int8_path


def test_the_quantizer_is_handed_every_calibration_scene_percentile_ranges_and_the_layers_kept_float(tmp_path,
                                                                                                     monkeypatch):
    """What ONNX Runtime's ``quantize_static`` is given (its own work is not repeated here): every calibration scene
    once, in batches of 8; the 99.99th-percentile activation ranges; per-channel weights of the kind asked for; and
    the stem, the first two stages and the depthwise convolutions left float, every other convolution quantized."""
    float_path = visual_encoder_file(TINY_SPEC, tmp_path)
    pixels = np.random.default_rng(0).random((20, 3, 4, 4), dtype=np.float32)
    monkeypatch.setattr(quantize, "calibration_pixels", lambda spec, count: pixels[:count])
    handed = []

    def quantize_static(model_input, model_output, reader, **options):
        handed.append(([batch["pixels"] for batch in iter(reader.get_next, None)], options))
        shutil.copyfile(model_input, model_output)

    monkeypatch.setattr(quantization, "quantize_static", quantize_static)
    convolutions = [node for node in onnx.load(str(float_path)).graph.node if node.op_type == "Conv"]
    early = {node.name for node in convolutions if node.name.startswith(FLOAT_PREFIXES)}
    depthwise = {node.name for node in convolutions if any(a.name == "group" and a.i > 1 for a in node.attribute)}
    assert early and depthwise - early and {node.name for node in convolutions} - early - depthwise
    for kernels, weights in (("u8s8", QuantType.QInt8), ("u8u8", QuantType.QUInt8)):
        quantized_visual_encoder(TINY_SPEC, tmp_path, calibration=20, kernels=kernels)
        batches, options = handed.pop()
        assert [len(batch) for batch in batches] == [8, 8, 4] and np.array_equal(np.concatenate(batches), pixels)
        assert options["calibrate_method"] == CalibrationMethod.Percentile
        assert options["extra_options"] == {"CalibPercentile": 99.99}
        assert options["per_channel"] and options["quant_format"] == QuantFormat.QDQ
        assert options["weight_type"] == weights and options["activation_type"] == QuantType.QUInt8
        assert set(options["nodes_to_exclude"]) == early | depthwise


def test_a_resnet_cnn_keeps_its_stem_and_first_stage_float_and_quantizes_the_rest(tmp_path):
    """A torchvision ResNet's int8 CNN leaves its stem (``conv1``) and ``layer1`` float, as the module promises: the
    high-resolution start is where quantization costs the features most (decisions.md).  Every other test quantizes
    an EfficientNet, whose graph holds no ``/conv1/`` node, so this reads the names a real ResNet export has."""
    spec = EncoderSpec(backbone="resnet18", layer="layer4", weights="random", image_size=32)
    graph = onnx.load(str(visual_encoder_file(spec, tmp_path))).graph
    convolutions = [node.name for node in graph.node if node.op_type == "Conv"]
    kept = set(float_convolutions(graph))
    assert "/conv1/Conv" in kept
    assert kept == {name for name in convolutions if name == "/conv1/Conv" or name.startswith("/layer1/")}
    assert any(name.startswith("/layer4/") for name in set(convolutions) - kept)


def test_the_calibration_scenes_are_not_the_default_data_sets_training_images(tmp_path):
    """Calibrated on a seed of its own: scenes the default data set (seed 0) trains on would tune the ranges to
    images the model has seen."""
    index = generate(tmp_path, {"train": 2}, progress=False)
    trained = np.stack([preprocess(load_image(im.path), TINY_SPEC)[0].numpy() for im in load_karpathy(index)])
    calibration = calibration_pixels(TINY_SPEC, 2)
    assert calibration.shape == trained.shape and not np.allclose(calibration, trained)


def test_the_calibration_count_asked_for_is_used_and_only_convolutions_and_matrix_products_are_quantized(
        tmp_path, monkeypatch):
    """``calibration=`` sets how many scenes calibrate (the default, decisions.md's 32, otherwise), and the op types
    handed to ONNX Runtime are the dense convolutions and both kinds of matrix product (a linear layer exports as
    ``Gemm``), as the module's docstring promises."""
    visual_encoder_file(TINY_SPEC, tmp_path)
    asked = []

    def pixels(spec, count):
        asked.append(count)
        return np.zeros((count, 3, 4, 4), dtype=np.float32)

    handed = []

    def quantize_static(model_input, model_output, reader, **options):
        handed.append(options["op_types_to_quantize"])
        shutil.copyfile(model_input, model_output)

    monkeypatch.setattr(quantize, "calibration_pixels", pixels)
    monkeypatch.setattr(quantization, "quantize_static", quantize_static)
    quantized_visual_encoder(TINY_SPEC, tmp_path, calibration=12, kernels="u8s8")
    quantized_visual_encoder(TINY_SPEC, tmp_path, kernels="u8u8")
    assert asked == [12, 32]
    assert [set(types) for types in handed] == [{"Conv", "MatMul", "Gemm"}] * 2


def test_the_decisions_record_the_calibration_the_code_runs():
    """The int8 feature caches are keyed by :data:`RECIPE`, so a calibration changed without the recipe's name would
    serve caches made the old way; the decisions name the scenes' count and seed, and must change with them."""
    decisions = (ROOT / "docs" / "decisions.md").read_text(encoding="utf-8")
    assert (f"Calibration on {quantize.CALIBRATION_IMAGES} generated scenes of their own seed** "
            f"({quantize.CALIBRATION_SEED}, not a dataset split's)") in decisions


def test_a_damaged_int8_cnn_is_quantized_again_not_served(tmp_path, monkeypatch):
    """An int8 graph cut short on disk (or left without its seal) is made again, as the float one is: loading it
    would fail every start."""
    float_path = visual_encoder_file(TINY_SPEC, tmp_path)
    monkeypatch.setattr(quantize, "calibration_pixels", lambda spec, count: np.zeros((2, 3, 4, 4), np.float32))
    monkeypatch.setattr(quantization, "quantize_static",
                        lambda model_input, model_output, reader, **options: shutil.copyfile(model_input, model_output))
    damaged = visual_encoder_path_at(TINY_SPEC, tmp_path, "int8")
    damaged.write_bytes(b"half a graph")
    made = visual_encoder_file(TINY_SPEC, tmp_path, "int8")
    assert made == damaged and made.read_bytes() == float_path.read_bytes()


def test_a_quantization_that_fails_midway_leaves_no_partial_graph_beside_the_float_cnn(tmp_path, monkeypatch):
    """The int8 graph is written under a temporary name first; a quantization that fails after writing part of it
    (ONNX Runtime's error, a full disk, Ctrl-C) removes that file, rather than leaving a CNN's worth of bytes in the
    export folder for good at every failed start."""
    float_path = visual_encoder_file(TINY_SPEC, tmp_path)
    before = sorted(p.name for p in float_path.parent.iterdir())
    monkeypatch.setattr(quantize, "calibration_pixels", lambda spec, count: np.zeros((2, 3, 4, 4), np.float32))

    def quantize_static(model_input, model_output, reader, **options):
        shutil.copyfile(model_input, model_output)
        raise RuntimeError("quantization failed after writing its output")

    monkeypatch.setattr(quantization, "quantize_static", quantize_static)
    with pytest.raises(RuntimeError, match="quantization failed"):
        quantized_visual_encoder(TINY_SPEC, tmp_path, calibration=2)
    assert sorted(p.name for p in float_path.parent.iterdir()) == before


def test_the_pytorch_cnn_given_is_the_one_quantized(tmp_path, monkeypatch):
    """``make_visual``'s encoder (the server's own, already built) goes to the exporter, not a second one built from
    the spec."""
    given = object()
    handed = []
    monkeypatch.setattr(quantize, "quantized_visual_encoder",
                        lambda spec, out_dir, visual: handed.append(visual) or tmp_path / "int8.onnx")
    visual_encoder_file(TINY_SPEC, tmp_path, "int8", lambda: given)
    assert handed == [given]
