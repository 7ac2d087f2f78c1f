"""Training phases of SPEC §8.6 on one shared loop (:mod:`.loop`): cross-entropy (:mod:`.xe`, which also runs
SAT-hard's REINFORCE objective) and self-critical CIDEr-D optimisation (:mod:`.scst`)."""

from . import scst, xe  # noqa: F401  (importing a phase registers it)
from ..evaluation.evaluate import caption_dataset, evaluate_checkpoint
from .loop import PHASES, TrainConfig, TrainingInterrupted, train

__all__ = ["PHASES", "TrainConfig", "TrainingInterrupted", "train", "caption_dataset", "evaluate_checkpoint"]
