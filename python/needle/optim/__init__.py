"""Optimizers. Each updates parameters in place from their `.grad`; see optimizer.py for what they share."""
from .adam import Adam
from .optimizer import Optimizer
from .sgd import SGD

__all__ = ["Adam", "Optimizer", "SGD"]
