"""Layer normalization as one op: a fused forward and a fused gradient, instead of a dozen element-wise ops.

The composite LayerNorm (mean, subtract, square, mean, add eps, sqrt, divide, scale, shift, with their
reshapes and broadcasts) is about a dozen graph nodes, each a Python call and most of them an activation that
backward keeps. `layer_norm` is one node whose backward needs only its inputs: the gradient op recomputes each
row's mean and 1/std (two passes over a row, cheaper than keeping them) and writes dx, dw and db in one call
(src/README.md: layernorm_forward, layernorm_backward). Arithmetic is float32 whatever the storage, so under
autocast the statistics stay float32 while the values are stored in 16 bits.
"""
from .. import autograd
from ..autograd import TensorOp, TensorTupleOp
from ..backend_selection import array_api
from .ops_mathematic import cast
from .ops_tuple import tuple_get_item

__all__ = ["LayerNorm", "LayerNormGrad", "layer_norm"]


def _fits(x, w, b):
    return len(x) >= 1 and x[-1] >= 1 and tuple(w) == (x[-1],) and tuple(b) == (x[-1],)


class LayerNorm(TensorOp):
    """y = (x - mean) r w + b over the last axis, r = 1 / sqrt(var + eps);  dx = r (g w - mean(g w) - x̂ mean(g w x̂))"""

    autocast = "low"  # the kernels compute the statistics in float32 whatever the storage
    saves = "inputs"
    compacts_inputs = True

    def __init__(self, eps=1e-5):
        self.eps = eps

    def infer_shape(self, x, w, b):
        return tuple(x) if _fits(x, w, b) else None  # None: compute raises the error

    def workspace(self, *shapes):
        return 0  # the kernel writes the output only

    def compute(self, x, w, b):
        return array_api.layer_norm(x, w, b, self.eps)

    def gradient(self, out_grad, node):
        x, w, _ = node.inputs
        grads = LayerNormGrad(self.eps)(x, w, out_grad)
        return tuple(tuple_get_item(grads, i) for i in range(3))


class LayerNormGrad(TensorTupleOp):
    """(dx, dw, db) of layer_norm for g: mean and r recomputed per row; dw = Σ_rows g x̂, db = Σ_rows g"""

    saves = "inputs"
    compacts_inputs = True

    def __init__(self, eps=1e-5):
        self.eps = eps

    def infer_shape(self, x, w, g):
        return (tuple(x), tuple(w), tuple(w)) if _fits(x, w, w) and tuple(g) == tuple(x) else None

    def workspace(self, *shapes):
        return 0  # per-row statistics live in the kernel (8 bytes a row, outside the allocator, like matmul's packing)

    def compute(self, x, w, g):
        return array_api.layer_norm_backward(x, w, g, self.eps)

    def gradient(self, out_grad, node):
        raise NotImplementedError("LayerNormGrad: second derivatives of layer_norm are not implemented; to "
                                  "differentiate twice, build the layer norm from summation, power_scalar and "
                                  "element-wise ops")


def layer_norm(x, weight, bias, eps=1e-5):
    """Layer normalization over the last axis of x (..., n) with weight and bias (n,), as one op.

    Inputs of different dtypes are computed in float32 (needle's promotion rule). The output has x's shape and
    the common dtype; first derivatives in x, weight and bias.
    """
    shapes = tuple(x.shape), tuple(weight.shape), tuple(bias.shape)
    if not _fits(*shapes):
        raise ValueError(f"layer_norm: needs x (..., n) with n >= 1, weight (n,) and bias (n,); got x {shapes[0]}, "
                         f"weight {shapes[1]}, bias {shapes[2]}")
    dtypes = {str(t.dtype) for t in (x, weight, bias)}
    if len(dtypes) > 1 and autograd.active_autocast() is None:  # (under autocast the op's inputs are cast to one dtype)
        x, weight, bias = (t if str(t.dtype) == "float32" else cast(t, "float32") for t in (x, weight, bias))
    return LayerNorm(eps)(x, weight, bias)
