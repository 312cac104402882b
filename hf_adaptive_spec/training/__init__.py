"""Training LaSpec drafters: target-made data (`data`), the accelerate training loop (`trainer`), the CLI."""

from .data import DrafterExample, EncodedPrompt, build_examples, load_examples, save_examples
from .trainer import TrainConfig, evaluate_acceptance, make_batch, train_drafter

__all__ = ["DrafterExample", "EncodedPrompt", "TrainConfig", "build_examples", "evaluate_acceptance", "load_examples", "make_batch",
           "save_examples", "train_drafter"]
