"""Training: recipes, the loop, losses, optimizers, checkpoints and evaluation."""

from tformer.training.config import TrainConfig
from tformer.training.distributed import DistributedFailure
from tformer.training.recipe import evaluate_checkpoint, load_recipe, run_recipe
from tformer.training.trainer import Trainer, TrainingDiverged

__all__ = [
    "DistributedFailure",
    "Trainer",
    "TrainConfig",
    "TrainingDiverged",
    "evaluate_checkpoint",
    "load_recipe",
    "run_recipe",
]
