"""Dropout whose mask is regenerated from a seed instead of kept.

nn.Dropout's course form multiplies by a mask drawn from NumPy's RNG: a leaf as large as the activation, which
backward must keep (checkpointing cannot drop a leaf). `dropout(x, p, seed)` draws nothing: element i is kept
when a hash of (seed, i) clears p (src/README.md, dropout: the rule of the fused attention's mask), so its
gradient, which needs the same mask, regenerates it from the seed. Nothing but the seed is kept.
"""
from ..autograd import TensorOp
from ..backend_selection import array_api

__all__ = ["Dropout", "dropout"]


class Dropout(TensorOp):
    """x · m / (1 - p), m[i] = [hash(seed, i) >= p · 2^32];  d/dx = out_grad · m / (1 - p): the same op on out_grad"""

    saves = "none"  # the gradient reads only out_grad (and the seed)
    elementwise = True

    def __init__(self, p, seed):
        self.p, self.seed = p, seed

    def compute(self, x):
        return array_api.dropout(x, self.p, self.seed)

    def gradient(self, out_grad, node):
        return (Dropout(self.p, self.seed)(out_grad),)


def dropout(x, p, seed):
    """x with each element zeroed with probability p and the rest scaled by 1 / (1 - p), from a counter-based mask:
    the same `seed` gives the same mask on every backend and in the gradient. 0 <= p < 1."""
    if not 0 <= p < 1:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")
    return Dropout(float(p), int(seed) & 0xFFFFFFFF)(x)
