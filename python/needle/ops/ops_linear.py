"""x W + b (and a relu after it) as one op: what nn.Linear computes, in one graph node instead of five.

Composed from ops, a Linear layer on (B, T, n) inputs is a reshape to rows, a matmul, a broadcast of the bias, an
add and a reshape back: five graph nodes, each a Python call in forward and a backward step of its own. `linear`
is one node. Its compute makes the same backend calls in the same order (so the bytes are the composite's), and
its gradient is the composite's gradient graph (g Wᵀ, xᵀ g, the bias's row sum), so the Budget's ledger counts
its temporaries as it counts any ops'. Under autocast the (m,) bias is cast to 16 bits once, as PyTorch's autocast
linear does (the composite cast its broadcast (rows, m) copy), so the bias's gradient is a 16-bit row sum.
"""
import functools
import math

from .. import lazy
from ..autograd import TensorOp, TensorTupleOp
from ..backend_selection import array_api
from ..backend_ndarray.ndarray_backend_numpy import code_bytes
from .ops_activation import ActivationGrad, activation_values, check_bits, check_relu_bits
from .ops_mathematic import matmul, relu_mask, reshape, summation, transpose
from .ops_tuple import tuple_get_item

__all__ = ["Linear", "LinearActivation", "linear"]
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")  # linear's `activation`: None or one of these


def _fits(x, w, b=None):
    return len(x) >= 1 and len(w) == 2 and x[-1] == w[0] and (b is None or tuple(b) in ((w[1],), (1, w[1])))


class Linear(TensorOp):
    """y = x W + b over the last axis, x (..., n), W (n, m), b (1, m) or (m,);  dx = g Wᵀ, dW = xᵀ g, db = Σ_rows g

    With relu: y = max(x W + b, 0), and g is first masked by y > 0 (the pre-activation is never a graph value).
    """

    saveable = True  # a matmul: expensive to recompute, so the "selective" policy keeps it
    compacts_inputs = True  # a strided x is copied by its reshape to rows (W, b: by the matmul, the add)
    autocast = "low"

    def __init__(self, bias=False, relu=False):
        self.bias, self.relu = bias, relu
        self.saves = "both" if relu else "inputs"  # relu's mask is read from the output

    def infer_dtype(self, *dtypes):
        return functools.reduce(array_api.promote_types, dtypes)

    def infer_shape(self, x, w, *b):
        return tuple(x[:-1]) + (w[1],) if _fits(x, w, *b) else None  # None: compute raises the error

    def workspace(self, x, w, *b):
        # x W before the bias is added into a new array, or x W (+ b) before relu is applied into a new one
        return math.prod(x[:-1]) * w[1] if self.bias or self.relu else 0

    def workspace_16bit(self, x, w, *b):
        return math.prod(x[:-1]) * w[1] if b else 0  # the bias's (rows, m) broadcast, copied for the add

    def compute(self, x, w, *b):
        if not _fits(x.shape, w.shape, *(t.shape for t in b)):
            raise ValueError(f"linear: needs x (..., n), weight (n, m) and bias (m,) or (1, m); got x {tuple(x.shape)}"
                             f", weight {tuple(w.shape)}" + (f", bias {tuple(b[0].shape)}" if b else ""))
        rows, m = math.prod(x.shape[:-1]), w.shape[1]
        out = array_api.matmul(array_api.reshape(x, (rows, x.shape[-1])), w)
        if b:
            out = out + array_api.broadcast_to(array_api.reshape(b[0], (1, m)), (rows, m))
        if self.relu:
            out = array_api.maximum(out, 0)
        return array_api.reshape(out, tuple(x.shape[:-1]) + (m,))

    def gradient(self, out_grad, node):
        if self.relu:
            out_grad = out_grad * relu_mask(node)  # relu's gradient, as ops.relu has it
        return linear_gradients(node.inputs, out_grad)


def linear_gradients(inputs, g):
    """(dx, dW[, db]) of x W + b for the gradient g of its output: g Wᵀ, xᵀ g, g's row sum."""
    x, w, *b = inputs
    rows, (n, m) = math.prod(x.shape[:-1]), w.shape
    g = g if len(x.shape) == 2 else reshape(g, (rows, m))
    rows_x = x if len(x.shape) == 2 else reshape(x, (rows, n))
    dx = matmul(g, transpose(w))
    grads = (dx if len(x.shape) == 2 else reshape(dx, x.shape), matmul(transpose(rows_x), g))
    if b:
        grads += (reshape(summation(g, (0,)), b[0].shape),)
    return grads


class LinearActivation(TensorTupleOp):
    """(f(z), z), z = x W + b, f in "gelu", "gelu_tanh", "silu";  dz = g f'(z) (ActivationGrad), then linear's

    GELU's and SiLU's gradients read the pre-activation z, so unlike relu's it is an output of its own; `linear`
    hands out only f(z) (tuple element 0), so nothing else reads z and its gradient is zero (not read here).
    With `bits` (few-bit derivatives, the toolbox's fewbit.py) the second output is z's packed `bits`-bit codes
    instead: z is a temporary inside the op, and dz = g q(z) (FewBitGrad). relu with bits=1: (relu(z), its mask).
    """

    saveable = True  # a matmul, as Linear
    compacts_inputs = True
    autocast = "low"
    saves = "both"  # x and W for the matmuls' gradients, z for the activation's
    compressible_outputs = (0,)  # f(z) is read by the next layer, never by this gradient

    def __init__(self, bias, kind, bits=None):
        self.bias, self.kind, self.bits = bias, kind, bits

    def infer_dtype(self, *dtypes):
        dtype = functools.reduce(array_api.promote_types, dtypes)
        return dtype if self.bits is None else (dtype, "uint8")

    def infer_shape(self, x, w, *b):
        out = tuple(x[:-1]) + (w[1],)
        second = out if self.bits is None else (code_bytes(math.prod(out), self.bits),)
        return (out, second) if _fits(x, w, *b) else None

    def workspace(self, x, w, *b):
        # Without bits, x W and z (the bias added) coexist before f(z) exists: no more than the two outputs. With
        # bits z is a temporary beside f(z) and the codes (x W and z before them: no more).
        return 0 if self.bits is None else math.prod(x[:-1]) * w[1]

    def compute(self, x, w, *b):
        z = Linear(self.bias).compute(x, w, *b)
        second = z if self.bits is None else lazy.load("fewbit").pack_input_codes(z, self.kind, self.bits)
        return activation_values(z, self.kind), second

    def gradient(self, out_grad, node):
        second = tuple_get_item(node, 1)
        if self.bits is None:
            dz = ActivationGrad(self.kind)(second, out_grad[0])
        else:
            dz = lazy.load("fewbit").FewBitGrad(self.kind, self.bits)(second, out_grad[0])
        return linear_gradients(node.inputs, dz)


def linear(x, weight, bias=None, activation=None, activation_bits=None):
    """x @ weight + bias over the last axis of x (..., n), weight (n, m), bias (m,) or (1, m) or None, as one op;
    activation "relu", "gelu" (exact), "gelu_tanh" or "silu" applies it in the same op; activation_bits (gelu,
    gelu_tanh, silu) keeps a few-bit code of the pre-activation for backward instead of the pre-activation.

    The same numbers as `reshape`, `matmul`, `broadcast_to`, `+` (and the activation's op), and their gradients, in
    one node (with gelu or silu, a tuple node and the element handed out).
    """
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"linear: activation must be None or one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    shapes = (tuple(x.shape), tuple(weight.shape)) + (() if bias is None else (tuple(bias.shape),))
    if not _fits(*shapes):
        raise ValueError(f"linear: needs x (..., n), weight (n, m) and bias (m,) or (1, m); got x {shapes[0]}, "
                         f"weight {shapes[1]}" + ("" if bias is None else f", bias {shapes[2]}"))
    if activation == "relu":
        check_relu_bits("linear", activation_bits)
    else:
        check_bits("linear", activation_bits)
    if activation_bits is not None and activation is None:
        raise ValueError("linear: activation_bits is for an activation (relu: 1, its mask; gelu, gelu_tanh, silu: "
                         "1..4), got activation None")
    inputs = (x, weight) + (() if bias is None else (bias,))
    if activation is None or (activation == "relu" and activation_bits is None):
        return Linear(bias is not None, activation == "relu")(*inputs)
    return tuple_get_item(LinearActivation(bias is not None, activation, activation_bits)(*inputs), 0)
