"""Training phases (:mod:`.phase`) on one shared loop (:mod:`.loop`): cross-entropy (:mod:`.xe`, which also runs
SAT-hard's REINFORCE objective) and self-critical CIDEr-D optimisation (:mod:`.scst`); paper schedules
(:mod:`.schedules`, recipes in ``models/recipes``), warm starts (:mod:`.warm_start`), resume (:mod:`.resume`,
:mod:`.state`), the run log (:mod:`.run_log`), data parallelism (:mod:`.distributed`) and mixed precision
(:mod:`.precision`)."""

from . import scst, xe  # noqa: F401  (importing a phase registers it)
from .config import Progress, TrainConfig
from .loop import Run, TrainingDiverged, TrainingInterrupted, fit, prepare_run, train
from .phase import PHASES
from .recipes import RECIPES_DIR, available_recipes, load_recipe

__all__ = ["PHASES", "Progress", "Run", "TrainConfig", "TrainingDiverged", "TrainingInterrupted", "fit", "prepare_run",
           "train", "RECIPES_DIR", "available_recipes", "load_recipe"]
