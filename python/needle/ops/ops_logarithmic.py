"""Numerically stable log-sum-exp and log-softmax (max-shifted, so exp never overflows)."""
from ..autograd import TensorOp
from ..backend_selection import array_api
from .ops_mathematic import _normalize_axes, broadcast_to, exp, reshape, summation

__all__ = ["LogSoftmax", "LogSumExp", "logsoftmax", "logsumexp"]


def _kept_shape(shape, axes):
    return tuple(1 if i in axes else n for i, n in enumerate(shape))


class LogSumExp(TensorOp):
    """log Σ_axes exp(z) = m + log Σ exp(z - m), m = max_axes z;  d/dz = out_grad * exp(z - lse)"""

    saves = "both"

    def __init__(self, axes=None):
        self.axes = axes

    def infer_shape(self, shape):
        axes = _normalize_axes(self.axes, len(shape), "LogSumExp")
        return tuple(n for i, n in enumerate(shape) if i not in axes)

    def compute(self, Z):
        axes = _normalize_axes(self.axes, len(Z.shape), "LogSumExp")
        m = array_api.max(Z, axis=axes, keepdims=True)
        shifted = Z - array_api.broadcast_to(m, Z.shape)
        lse = array_api.log(array_api.sum(array_api.exp(shifted), axis=axes, keepdims=True)) + m
        return array_api.reshape(lse, tuple(n for i, n in enumerate(Z.shape) if i not in axes))

    def gradient(self, out_grad, node):
        Z = node.inputs[0]
        axes = _normalize_axes(self.axes, len(Z.shape), "LogSumExp")
        kept = _kept_shape(Z.shape, axes)
        lse = broadcast_to(reshape(node, kept), Z.shape)
        return broadcast_to(reshape(out_grad, kept), Z.shape) * exp(Z - lse)


def logsumexp(a, axes=None):
    return LogSumExp(axes)(a)


class LogSoftmax(TensorOp):
    """z - logsumexp(z) over the last axis;  d/dz = out_grad - softmax(z) * Σ out_grad"""

    saves = "output"
    elementwise = True  # the output has the input's shape

    def compute(self, Z):
        axis = len(Z.shape) - 1
        m = array_api.max(Z, axis=axis, keepdims=True)
        shifted = Z - array_api.broadcast_to(m, Z.shape)
        lse = array_api.log(array_api.sum(array_api.exp(shifted), axis=axis, keepdims=True))
        return shifted - array_api.broadcast_to(lse, Z.shape)

    def gradient(self, out_grad, node):
        axis = len(node.shape) - 1
        total = broadcast_to(reshape(summation(out_grad, axis), _kept_shape(node.shape, (axis,))), node.shape)
        return out_grad - exp(node) * total


def logsoftmax(a):
    return LogSoftmax()(a)
