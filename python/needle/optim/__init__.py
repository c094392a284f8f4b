"""Optimizers. Each updates parameters in place from their `.grad`; see optimizer.py for what they share."""
from .adafactor import Adafactor
from .adam import Adam
from .optimizer import Optimizer
from .sgd import SGD

__all__ = ["Adafactor", "Adam", "Optimizer", "SGD"]
