"""Checks shared by the model tests: the step loop as a reference for parallel training passes, the memorisation
smoke test (memorise 10 random feature maps with fixed random captions), a stand-in feature store, and the 2×2
grid the grounding tests place attention on."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from captioner.models.checkpoint import load_checkpoint, save_checkpoint
from captioner.models.decoding import beam_search, greedy
from captioner.models.encoder import EncoderSpec, grid_geometry
from captioner.models.vocab import SPECIALS, Vocabulary
from captioner.models.evaluation.metrics import score_captions
from captioner.models.protocol import Captioner, Geometry, VisualBatch

VOCAB = 20  # ids 0..2 are <pad>, <bos>, <eos>; captions use 3..19


def stepwise(model: Captioner, vis: VisualBatch, tokens: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Teacher-forced log-probs ``[B, T, V]`` and attention records from the protocol's one-step-at-a-time loop
    (the base class's, even where a model overrides it), the reference for a model's parallel ``forward_xe``."""
    logprobs, records, _ = Captioner.teacher_force(model, vis, tokens)
    return logprobs, records


def assert_beam_one_is_greedy(model: Captioner, vis: VisualBatch, max_len: int = 8) -> None:
    """Decoding invariant: beam search with k = 1 returns the greedy caption and the same attention rows."""
    for by_beam, by_greedy in zip(beam_search(model, vis, k=1, max_len=max_len), greedy(model, vis, max_len)):
        assert by_beam[0].token_ids == by_greedy.token_ids
        torch.testing.assert_close(by_beam[0].attention, by_greedy.attention)


def rescored_beams(model: Captioner, vis: VisualBatch, max_len: int = 8, tolerance: dict | None = None):
    """Alignment of beam search (k = 3, 2 best per image): re-scoring each returned caption step by step gives
    the same attention rows and token log-probs (so rows were reordered with their beams), every row sums to 1
    and masked items get none.  Yields ``(single-image batch, tokens, hypothesis, records)`` for model-specific
    checks."""
    tolerance = tolerance or {}
    for row, hyps in enumerate(beam_search(model, vis, k=3, max_len=max_len, n_best=2)):
        single = VisualBatch(vis.feats[row:row + 1], vis.mask[row:row + 1])
        for hyp in hyps:
            tokens = torch.tensor([hyp.token_ids])
            logps, records = stepwise(model, single, tokens)
            torch.testing.assert_close(hyp.attention, torch.cat([r.primary for r in records]), **tolerance)
            torch.testing.assert_close(torch.tensor(hyp.token_logprobs), logps[0].gather(1, tokens.T).squeeze(1),
                                       **tolerance)
            torch.testing.assert_close(hyp.attention.sum(-1), torch.ones(len(hyp.token_ids)))
            assert torch.all(hyp.attention[:, ~single.mask[0]] == 0)
            yield single, tokens, hyp, records


def assert_checkpoint_round_trip(model: Captioner, vis: VisualBatch, folder) -> None:
    """Save and load through the one checkpoint format: same config, same beam-search captions and attention."""
    path = save_checkpoint(folder, model, Vocabulary([f"w{i}" for i in range(model.vocab_size - 4)]), EncoderSpec())
    loaded = load_checkpoint(path).model
    assert loaded.config() == model.config()
    for before, after in zip(beam_search(model, vis, k=3, max_len=8), beam_search(loaded, vis, k=3, max_len=8)):
        assert before[0].token_ids == after[0].token_ids
        torch.testing.assert_close(before[0].attention, after[0].attention)


def memorisation_task(items: int = 64, feat_dim: int = 32,
                      seed: int = 0) -> tuple[VisualBatch, torch.Tensor, list[list[int]]]:
    """10 images of ``items`` random features, each with one random caption of 4–8 words (+ EOS)."""
    generator = torch.Generator().manual_seed(seed)
    feats = torch.randn(10, items, feat_dim, generator=generator)
    # words only: the special ids (<pad>, <bos>, <eos>, <unk>) are never a caption's words (<unk> is never emitted)
    captions = [torch.randint(len(SPECIALS), VOCAB, (int(n),), generator=generator).tolist() + [2]
                for n in torch.randint(4, 9, (10,), generator=generator)]
    targets = torch.zeros(10, max(map(len, captions)), dtype=torch.long)
    for i, caption in enumerate(captions):
        targets[i, :len(caption)] = torch.tensor(caption)
    return VisualBatch.from_features(feats), targets, captions


def train_to_memorise(model: Captioner, vis: VisualBatch, targets: torch.Tensor, steps: int = 300,
                      lr: float = 5e-3, stop_loss: float = 0.05) -> float:
    """Adam on the teacher-forced XE loss (plus the model's auxiliary losses); returns the last loss."""
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(float("inf"))
    for step in range(steps):
        logprobs, aux = model.forward_xe(vis, targets)
        loss = F.nll_loss(logprobs.flatten(0, 1), targets.flatten(), ignore_index=0)
        total = loss + sum(aux.values()) if aux else loss
        optimiser.zero_grad()
        total.backward()
        optimiser.step()
        if step % 25 == 24 and loss.item() < stop_loss:
            break
    model.eval()
    return loss.item()


def memorisation_cider(model: Captioner, vis: VisualBatch, captions: list[list[int]]) -> tuple[float, int, list]:
    """Training-set CIDEr-D of greedy captions, the number reproduced exactly, and the hypotheses."""
    hyps = greedy(model, vis, max_len=12)
    words = lambda ids: " ".join(f"w{i}" for i in ids if i != 2)  # noqa: E731
    scores = score_captions({i: words(h.token_ids) for i, h in enumerate(hyps)},
                            {i: [words(c)] for i, c in enumerate(captions)}, metrics=("CIDEr-D",))
    exact = sum(h.token_ids == c for h, c in zip(hyps, captions))
    return scores["CIDEr-D"], exact, hyps


def constructor_arguments(model: Captioner) -> set[str]:
    """The arguments a model's class takes, all of which its ``config()`` must give back for a checkpoint to rebuild
    it (``ids``, the special tokens' ids, come from the checkpoint's vocabulary instead)."""
    return set(inspect.signature(type(model).__init__).parameters) - {"self", "ids"}


class RecordingDropout(torch.nn.Module):
    """An identity that keeps every tensor it is given: put in place of a model's dropout, it shows which tensors the
    model regularises (in eval mode, or with dropout 0, a misplaced dropout changes no output)."""

    def __init__(self):
        super().__init__()
        self.inputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x)
        return x


def keys_store() -> SimpleNamespace:
    """A stand-in feature store whose batch, moved to any device, is the keys it was asked for: a training phase's
    loss then hands the model the image keys it read, which a test can check."""
    return SimpleNamespace(batch=lambda keys: SimpleNamespace(to=lambda device: keys))


def two_by_two(size=(8, 8), resize="stretch") -> Geometry:
    """A 2×2 grid (64-pixel network input, stride 32) over an image of ``size``, stretched or centre-cropped."""
    return grid_geometry(EncoderSpec(image_size=64, resize=resize, resize_to=64), size)
