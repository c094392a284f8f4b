"""Optimizers. Each updates parameters in place from their `.grad`; see optimizer.py for what they share."""
from .adafactor import Adafactor
from .adam import Adam
from .adam8bit import Adam8bit
from .optimizer import Optimizer
from .sgd import SGD

__all__ = ["Adafactor", "Adam", "Adam8bit", "Optimizer", "SGD"]
