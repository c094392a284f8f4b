"""Numerically stable log-sum-exp and log-softmax (max-shifted, so exp never overflows)."""
import math

from ..autograd import TensorOp
from ..backend_selection import array_api
from .ops_mathematic import _normalize_axes, broadcast_to, exp, pick_columns, reshape, subtract, summation

__all__ = [
    "LogSoftmax", "LogSumExp", "SoftmaxCrossEntropy", "SoftmaxCrossEntropyGrad", "logsoftmax", "logsumexp",
    "softmax_cross_entropy",
]


def _kept_shape(shape, axes):
    return tuple(1 if i in axes else n for i, n in enumerate(shape))


class LogSumExp(TensorOp):
    """log Σ_axes exp(z) = m + log Σ exp(z - m), m = max_axes z;  d/dz = out_grad * exp(z - lse)"""

    autocast = "float32"
    saves = "both"
    compacts_inputs = True

    def __init__(self, axes=None):
        self.axes = axes

    def infer_shape(self, shape):
        axes = _normalize_axes(self.axes, len(shape), "LogSumExp")
        return tuple(n for i, n in enumerate(shape) if i not in axes)

    def compute(self, Z):
        return array_api.logsumexp(Z, axis=_normalize_axes(self.axes, len(Z.shape), "LogSumExp"))

    def gradient(self, out_grad, node):
        Z = node.inputs[0]
        axes = _normalize_axes(self.axes, len(Z.shape), "LogSumExp")
        kept = _kept_shape(Z.shape, axes)
        lse = broadcast_to(reshape(node, kept), Z.shape)
        return (broadcast_to(reshape(out_grad, kept), Z.shape) * exp(subtract(Z, lse)),)


def logsumexp(a, axes=None):
    return LogSumExp(axes)(a)


class LogSoftmax(TensorOp):
    """z - logsumexp(z) over the last axis;  d/dz = out_grad - softmax(z) * Σ out_grad"""

    autocast = "float32"
    saves = "output"
    elementwise = True  # the output has the input's shape

    def workspace(self, shape):
        # z - m lives beside exp(z - m), then beside the result; m and log Σ are one value per row each.
        return math.prod(shape) + 2 * math.prod(shape[:-1])

    def compute(self, Z):
        # (z - m) - log Σ exp(z - m), not z - logsumexp(z): for large |z| the latter cancels away the low bits.
        axis = len(Z.shape) - 1
        m = array_api.max(Z, axis=axis, keepdims=True)
        shifted = Z - array_api.broadcast_to(m, Z.shape)
        lse = array_api.log(array_api.sum(array_api.exp(shifted), axis=axis, keepdims=True))
        return shifted - array_api.broadcast_to(lse, Z.shape)

    def gradient(self, out_grad, node):
        axis = len(node.shape) - 1
        total = broadcast_to(reshape(summation(out_grad, axis), _kept_shape(node.shape, (axis,))), node.shape)
        return (subtract(out_grad, exp(node) * total),)


def logsoftmax(a):
    return LogSoftmax()(a)


class SoftmaxCrossEntropy(TensorOp):
    """logsumexp(z_i) - z_i[y_i] for logits z (n, c), labels y (n,);  d/dz_i = g_i (softmax(z_i) - onehot(y_i))

    The loss of SoftmaxLoss as one op: its gradient is one fused pass over the logits (SoftmaxCrossEntropyGrad)
    instead of the exp, products, one-hot scatter and sum that logsumexp(z) - pick_columns(z, y) takes.
    """

    autocast = "float32"
    saves = "inputs"
    compacts_inputs = True

    def workspace(self, z, y):
        return 2 * z[0]  # the rows' log-sum-exp and their target logits, before the difference

    def infer_shape(self, z, y):
        return (z[0],)

    def compute(self, Z, y):
        if len(Z.shape) != 2 or tuple(y.shape) != (Z.shape[0],):
            raise ValueError(f"SoftmaxCrossEntropy: need logits (n, c) and labels (n,), got {tuple(Z.shape)} and "
                             f"{tuple(y.shape)}")
        return array_api.logsumexp(Z, axis=1) - array_api.take_along_rows(Z, y)

    def gradient(self, out_grad, node):
        Z, y = node.inputs
        return SoftmaxCrossEntropyGrad()(Z, y, out_grad), None  # labels are integers: no gradient


def softmax_cross_entropy(logits, y):
    return SoftmaxCrossEntropy()(logits, y)


class SoftmaxCrossEntropyGrad(TensorOp):
    """g_i (softmax(z_i) - onehot(y_i));  s = softmax(z), r_i = Σ_j u_ij s_ij: d/dz = g s (u - r), d/dg = r - u[y]"""

    saves = "inputs"
    compacts_inputs = True

    def infer_shape(self, z, y, g):
        return z

    def compute(self, Z, y, g):
        return array_api.softmax_xent_grad(Z, y, g)

    def gradient(self, out_grad, node):
        Z, y, g = node.inputs
        n, c = Z.shape

        def per_row(v):  # (n,) -> (n, c), v[i] along row i
            return broadcast_to(reshape(v, (n, 1)), (n, c))

        s = exp(logsoftmax(Z))
        r = summation(out_grad * s, axes=(1,))
        return per_row(g) * s * subtract(out_grad, per_row(r)), None, subtract(r, pick_columns(out_grad, y))
