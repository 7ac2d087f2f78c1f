"""Mixed precision: the precision a device gets, and the bf16 autocast code path of the loop, run on CPU."""

import json

import pytest
import torch

from captioner.models.training import TrainConfig, fit, prepare_run
from captioner.models.training.loop import resolve_precision

pytestmark = pytest.mark.usefixtures("one_thread")


def test_precision_is_selected_by_device():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_precision("auto", cpu).dtype is None  # fp32 on CPU
    assert resolve_precision("bf16", cpu).dtype == torch.bfloat16 and not resolve_precision("bf16", cpu).scaled
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        resolve_precision("fp16", cpu)
    fp16 = resolve_precision("fp16", gpu)
    assert fp16.dtype == torch.float16 and fp16.scaled  # fp16 always with a gradient scaler
    if torch.cuda.is_available():
        assert resolve_precision("auto", gpu).name == ("bf16" if torch.cuda.is_bf16_supported() else "fp16")


def test_bf16_autocast_trains_on_cpu_close_to_fp32(scenes, tmp_path):
    common = dict(dataset=str(scenes), cache_dir=str(tmp_path / "features"), encoder={"image_size": 96},
                  model_args=dict(embed_dim=16, hidden_dim=24, attn_dim=16, dropout=0.0), train_limit=4, val_limit=2,
                  batch_size=8, lr=3e-3, max_steps=2, progress=False, log_every=1, device="cpu")
    runs = {}
    for precision in ("fp32", "bf16"):
        run = prepare_run(TrainConfig(out=str(tmp_path / precision), precision=precision, **common))
        seen = []
        hook = run.model.init_h.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
        before = {k: v.clone() for k, v in run.model.state_dict().items()}
        fit(run)
        hook.remove()
        runs[precision] = (run, seen, before)
    run, seen, before = runs["bf16"]
    assert set(seen) == {torch.bfloat16}, "the forward pass did not run under bf16 autocast"
    assert set(runs["fp32"][1]) == {torch.float32}
    after = run.model.state_dict()
    assert all(v.dtype == torch.float32 for v in after.values())  # master weights stay float32
    assert any(not torch.equal(before[k], after[k]) for k in after)  # and the step updated them
    losses = {p: [json.loads(line)["xe"] for line in (tmp_path / p / "metrics.jsonl").read_text().splitlines()]
              for p in runs}
    assert all(torch.isfinite(torch.tensor(losses["bf16"])))
    # bf16 keeps 8 bits of mantissa: the same batches' losses agree to a few per cent
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=0.03)
    assert json.loads((tmp_path / "bf16" / "train_state.json").read_text())["config"]["precision"] == "bf16"
