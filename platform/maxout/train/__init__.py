"""Training: ``train(cfg)`` runs one tracked fine-tuning run (see run.py); the loop is in loop.py."""

from .callbacks import Callback, TrainState
from .run import TrainResult, train

__all__ = ["Callback", "TrainState", "TrainResult", "train"]
