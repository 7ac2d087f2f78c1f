"""Mixed precision: the precision a device gets, and the bf16 autocast code path of the loop, run on CPU."""

import json
from types import SimpleNamespace

import pytest
import torch

from captioner.models.cli.training import train_config_from_args
from captioner.models.training import Progress, TrainConfig, fit, prepare_run
from captioner.models.training.distributed import DistContext
from captioner.models.training.loop import _snapshot
from captioner.models.training.precision import resolve_precision
from captioner.models.training.resume import restore
from captioner.models.training.state import load_state, rng_state, set_rng_state
from captioner.service.cli import build_parser, main

from .conftest import saved_linear_run

pytestmark = pytest.mark.usefixtures("one_thread")


def test_precision_is_selected_by_device():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_precision("auto", cpu).name == "float32" and resolve_precision("auto", cpu).dtype is None
    assert resolve_precision("bfloat16", cpu).dtype == torch.bfloat16 and not resolve_precision("bfloat16", cpu).scaled
    with pytest.raises(ValueError, match="float16 needs a CUDA device"):
        resolve_precision("float16", cpu)
    fp16 = resolve_precision("float16", gpu)
    assert fp16.dtype == torch.float16 and fp16.scaled  # float16 always with a gradient scaler
    # the names runs recorded before the precisions took torch's dtype names
    assert [resolve_precision(old, gpu).name for old in ("fp32", "bf16", "fp16")] == ["float32", "bfloat16", "float16"]
    with pytest.raises(ValueError, match="unknown precision 'half'"):
        resolve_precision("half", cpu)
    if torch.cuda.is_available():
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        assert resolve_precision("auto", gpu).name == ("bfloat16" if native else "float16")


def test_float16_is_refused_on_every_device_but_cuda():
    """Float16 runs with a gradient scaler only on CUDA: a device torch knows but that is not CUDA (``mps``, ``xpu``,
    which ``--device`` takes) is refused like the CPU, not only the CPU itself."""
    for name in ("cpu", "mps", "xpu", "meta"):
        with pytest.raises(ValueError, match="float16 needs a CUDA device"):
            resolve_precision("float16", torch.device(name))


def test_an_unknown_precision_is_refused_with_every_name_and_alias_taken():
    """A library run (``TrainConfig(precision=...)``) or a saved run's config meets no argparse choices: the refusal
    is all its user reads, and it lists what is taken, the earlier names (aliases) as well as the dtype names."""
    refusal = r"^unknown precision 'half'; choose auto, float32, bfloat16, float16 \(or fp32, bf16, fp16\)$"
    with pytest.raises(ValueError, match=refusal):
        resolve_precision("half", torch.device("cpu"))


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_on_a_gpu_is_bfloat16_where_it_runs_else_scaled_float16(bf16, monkeypatch):
    """``auto`` on a CUDA device asks the run's GPU whether it runs bfloat16 (A100, H100) or not (V100, T4, which take
    float16 with a gradient scaler); its compute capability is mocked so that the choice is held on a machine without
    a GPU, and the device asked is the run's (``cuda:1`` on a machine of mixed GPUs)."""
    asked = []
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: asked.append(device) or ((8, 0) if bf16 else (7, 5)))
    chosen = resolve_precision("auto", torch.device("cuda:1"))
    assert asked == [torch.device("cuda:1")]
    assert (chosen.name, chosen.dtype, chosen.scaled) == \
        (("bfloat16", torch.bfloat16, False) if bf16 else ("float16", torch.float16, True))


def test_auto_on_a_gpu_that_runs_bfloat16_only_by_emulation_is_scaled_float16(monkeypatch):
    """A V100 or T4 (compute capability 7) has no bfloat16 arithmetic, which torch emulates: ``is_bf16_supported()``
    says yes to it unless asked ``including_emulation=False``, and ``auto`` would train such a GPU in emulated
    bfloat16 rather than the float16 with a gradient scaler its docstring promises older GPUs (docs/training_on_coco.md
    keeps bfloat16 to Ampere or newer). The GPU is stood in for by its properties, not by ``is_bf16_supported``'s
    answer, so that any way of asking for native bfloat16 holds here."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(major=7, minor=5))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)  # a bfloat16 tensor is made
    chosen = resolve_precision("auto", torch.device("cuda"))
    assert (chosen.name, chosen.dtype, chosen.scaled) == ("float16", torch.float16, True)


def test_auto_on_a_device_that_is_not_cuda_is_float32_whatever_the_gpu_runs(monkeypatch):
    """``auto`` asks CUDA about bfloat16 only for a CUDA device: a run on ``mps`` or ``xpu`` (which ``--device``
    takes) on a machine that also has a GPU trains in float32, as on the CPU, rather than taking the GPU's answer
    and then being refused float16 or autocast in a dtype its own device was never asked about."""
    for bf16 in (True, False):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, bf16=bf16: (8, 0) if bf16 else (7, 5))
        for name in ("cpu", "mps", "xpu"):
            chosen = resolve_precision("auto", torch.device(name))
            assert (chosen.name, chosen.dtype, chosen.scaled) == ("float32", None, False), (name, bf16)


def test_bf16_autocast_trains_on_cpu_close_to_fp32(scenes, tmp_path):
    common = dict(dataset=str(scenes), cache_dir=str(tmp_path / "features"), encoder={"image_size": 96},
                  model_args=dict(embed_dim=16, hidden_dim=24, attn_dim=16, dropout=0.0), train_limit=4, val_limit=2,
                  batch_size=8, lr=3e-3, max_steps=2, progress=False, log_every=1, device="cpu")
    runs = {}
    for precision in ("float32", "bfloat16"):
        run = prepare_run(TrainConfig(out=str(tmp_path / precision), precision=precision, **common))
        seen = []
        hook = run.model.init_h.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
        before = {k: v.clone() for k, v in run.model.state_dict().items()}
        fit(run)
        hook.remove()
        runs[precision] = (run, seen, before)
    run, seen, before = runs["bfloat16"]
    assert set(seen) == {torch.bfloat16}, "the forward pass did not run under bf16 autocast"
    assert set(runs["float32"][1]) == {torch.float32}
    after = run.model.state_dict()
    assert all(v.dtype == torch.float32 for v in after.values())  # master weights stay float32
    assert any(not torch.equal(before[k], after[k]) for k in after)  # and the step updated them
    losses = {p: [json.loads(line)["xe"] for line in (tmp_path / p / "metrics.jsonl").read_text().splitlines()]
              for p in runs}
    assert all(torch.isfinite(torch.tensor(losses["bfloat16"])))
    # bf16 keeps 8 bits of mantissa: the same batches' losses agree to a few per cent
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=0.03)
    assert json.loads((tmp_path / "bfloat16" / "train_state.json").read_text())["config"]["precision"] == "bfloat16"


def test_a_run_started_with_precision_fp32_still_resumes(scenes, tmp_path):
    """Before the precisions took torch's dtype names, ``--precision fp32`` was recorded as ``fp32`` in the run's
    state: such a run resumes, with the old flag given again or with none, and continues as float32."""
    out, state = tmp_path / "run", tmp_path / "run" / "train_state.json"
    main(["train", "--dataset", str(scenes), "--out", str(out), "--cache-dir", str(tmp_path / "features"),
          "--encoder", "image_size=96", "--set", "embed_dim=16", "--set", "hidden_dim=24", "--set", "attn_dim=16",
          "--train-limit", "8", "--val-limit", "2", "--batch-size", "8", "--device", "cpu", "--no-progress",
          "--precision", "fp32", "--max-steps", "1"])  # 5 steps an epoch: every stop below is inside the first
    for steps, again in ((2, ["--precision", "fp32"]), (3, [])):
        saved = json.loads(state.read_text())
        saved["config"]["precision"] = "fp32"  # the run's state as the earlier vocabulary wrote it
        state.write_text(json.dumps(saved))
        main(["train", "--out", str(out), "--resume", "--max-steps", str(steps), *again])
        resumed = json.loads(state.read_text())
        assert resumed["progress"]["global_step"] == steps  # it trained on from where it stopped
        assert resumed["config"]["precision"] == "float32"


def test_the_command_line_takes_the_dtype_names_and_the_earlier_ones(capsys):
    for given, taken in (("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), ("auto", "auto"),
                         ("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")):
        args = build_parser().parse_args(["train", "--out", "run", "--precision", given])
        assert train_config_from_args(args).precision == taken, given
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--out", "run", "--precision", "half"])
    assert "invalid choice: 'half'" in capsys.readouterr().err


def test_the_gradient_scalers_state_is_saved_and_put_back_on_resume(scenes, tmp_path):
    """A float16 run's loss scale, grown or backed off over its steps, is part of its state: started again at its
    initial value, a resumed run skipped (or underflowed in) other steps than the uninterrupted one.  Float16 needs
    CUDA; the scaler's state is saved and restored the same way on CPU."""
    run = prepare_run(TrainConfig(out=str(tmp_path / "run"), dataset=str(scenes), cache_dir=str(tmp_path / "features"),
                                  encoder={"image_size": 96}, model_args=dict(embed_dim=16, hidden_dim=24, attn_dim=16),
                                  train_limit=4, val_limit=2, progress=False, device="cpu"))
    run.scaler = torch.amp.GradScaler("cpu")
    run.scaler.scale(torch.ones(()))  # the scale is made at its first use
    run.scaler.update(2.0 ** 9)  # where steps with infinite gradients had backed it off to
    _snapshot(run)
    fresh = torch.amp.GradScaler("cpu")
    restore(load_state(run.run_dir), run.cfg, run.run_dir, run.dist, run.model, None, run.optimizer, fresh)
    assert fresh.get_scale() == 2.0 ** 9 and fresh.state_dict() == run.scaler.state_dict()
    # resumed at another precision (float32, or bfloat16 on a machine without CUDA) the run has no scaler: the saved
    # scale is passed over, not loaded into the scaler it does not have
    restore(load_state(run.run_dir), run.cfg, run.run_dir, run.dist, run.model, None, run.optimizer, None)


def test_a_state_saved_without_a_gradient_scaler_resumes_with_one(tmp_path):
    """A float32 or bfloat16 run saves no scaler; resumed with ``--precision float16`` (a run moved onto a GPU) it
    gets a fresh scaler at its initial scale, rather than failing the resume on the state's missing scale."""
    model, optimizer, saved = saved_linear_run()
    fresh = torch.amp.GradScaler("cpu")
    initial = fresh.state_dict()
    restore(saved, TrainConfig(out=str(tmp_path)), tmp_path, DistContext(0, 1), model, None, optimizer, fresh)
    assert fresh.state_dict() == initial


def test_each_rank_resumes_with_its_own_random_stream_or_a_fresh_rank_distinct_one(tmp_path):
    """The random streams saved per rank go back to their ranks; on another number of processes (a state of one
    process resumed by two) each rank is seeded afresh, and differently (with one stream, the ranks' dropout masks
    and samples were the same; indexed by rank, rank 1 of two found no stream saved for it)."""
    streams = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        streams.append(rng_state())
    model, optimizer, saved = saved_linear_run(rng=streams[0])

    def draws(rngs, rank, world):
        torch.manual_seed(0)  # what every process of a resumed run starts from
        restore({**saved, "rng_ranks": rngs}, TrainConfig(out=str(tmp_path)), tmp_path, DistContext(rank, world),
                model, None, optimizer, None)
        return torch.rand(4).tolist()

    expected = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        expected.append(torch.rand(4).tolist())
    assert draws(streams, 1, 2) == expected[1]  # rank 1's own stream
    fresh = [draws(streams[:1], rank, 2) for rank in (0, 1)]
    assert fresh[0] != fresh[1] and expected[0] not in fresh


def test_a_fresh_stream_on_another_number_of_processes_differs_with_the_step_resumed_at(tmp_path):
    """A run resumed on another number of processes again and again (two ranks, then one, then two) is seeded afresh
    each time: seeded by seed and rank alone, every such resume started the same stream over, and drew the dropout
    masks and samples of its first steps after the previous resume again."""
    streams = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        streams.append(rng_state())

    def draws(global_step):
        model, optimizer, saved = saved_linear_run(progress=Progress(global_step=global_step))
        torch.manual_seed(0)
        restore({**saved, "rng_ranks": streams}, TrainConfig(out=str(tmp_path)), tmp_path, DistContext(0, 1), model,
                None, optimizer, None)
        return torch.rand(4).tolist()

    assert draws(10) == draws(10)  # the same resume draws alike: the run's seed, not the clock, picks it
    assert draws(10) != draws(20)


def test_a_state_of_two_ranks_resumed_by_one_process_is_seeded_afresh(tmp_path):
    """Two saved streams and one process: neither rank's stream is the run's own any longer, so it is seeded afresh
    (taking rank 0's, the process drew what an unbroken rank 0 would, in a run of another shape)."""
    streams = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        streams.append(rng_state())
    torch.manual_seed(1)
    rank_0 = torch.rand(4).tolist()
    model, optimizer, saved = saved_linear_run(rng=streams[0])
    torch.manual_seed(0)
    restore({**saved, "rng_ranks": streams}, TrainConfig(out=str(tmp_path)), tmp_path, DistContext(0, 1), model, None,
            optimizer, None)
    assert torch.rand(4).tolist() != rank_0


def test_a_state_saved_with_one_random_stream_resumes_with_it(tmp_path):
    """A state written before the streams were kept per rank holds one, ``rng``, and no ``rng_ranks``: resumed by one
    process it goes on with that stream (seeded afresh instead, its dropout masks and samples were not the ones an
    unbroken run draws)."""
    torch.manual_seed(1)
    model, optimizer, saved = saved_linear_run()
    expected = torch.rand(4).tolist()
    torch.manual_seed(0)
    restore(saved, TrainConfig(out=str(tmp_path)), tmp_path, DistContext(0, 1), model, None, optimizer, None)
    assert torch.rand(4).tolist() == expected


def test_the_cuda_generators_are_saved_and_set_back_where_cuda_is_available(monkeypatch):
    """On a GPU, multinomial sampling (SCST, SAT-hard) draws from the CUDA generators: left out of the saved streams,
    a resumed run samples other captions than the unbroken one. The CUDA calls are stood in for on a CPU machine."""
    generators, set_back = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3], dtype=torch.uint8)], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: generators)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_back.append)
    state = rng_state()
    assert state["cuda"] is generators
    set_rng_state({**state, "cuda": tuple(state["cuda"])})  # as it reads back from the saved state
    (restored,) = set_back
    assert [id(g) for g in restored] == [id(g) for g in generators]


def test_a_state_saved_without_cuda_streams_resumes_on_a_machine_with_cuda(monkeypatch):
    """A run saved on a CPU machine (no ``cuda`` streams in its state) and resumed on a GPU one sets back its CPU
    stream and leaves the CUDA generators to their seeding, rather than failing the resume on the missing key."""
    set_back = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_back.append)
    saved = torch.get_rng_state()
    expected = torch.rand(3)
    set_rng_state({"torch": saved})
    assert torch.equal(torch.rand(3), expected) and set_back == []
