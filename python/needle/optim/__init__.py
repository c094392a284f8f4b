"""Optimizers. Each updates parameters in place from their `.grad`; see optimizer.py for what they share.

SGD and Adam are the course's; Adam8bit (8-bit state) and Adafactor (factored state) live in the memory toolbox
(needle/toolbox/optim/) and load on first use: `ndl.optim.Adam8bit` works as ever.
"""
from .. import lazy
from .adam import Adam
from .optimizer import Optimizer
from .sgd import SGD

__all__ = ["Adam", "Optimizer", "SGD"]

__getattr__ = lazy.attributes(__name__, {"Adam8bit": "optim.adam8bit:Adam8bit",
                                         "Adafactor": "optim.adafactor:Adafactor"})
