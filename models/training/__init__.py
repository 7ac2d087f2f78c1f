"""Training: cross-entropy (XE) now; self-critical CIDEr-D and SAT-hard REINFORCE phases plug in here."""

from .evaluate import caption_dataset, evaluate_checkpoint
from .xe import TrainConfig, train

__all__ = ["TrainConfig", "train", "caption_dataset", "evaluate_checkpoint"]
