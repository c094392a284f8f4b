"""Element-wise, shape, matrix and convolution ops: one class each, `compute` and `gradient` side by side.

`compute` works on raw arrays (NDArray, or numpy.ndarray under NEEDLE_BACKEND=np) through `array_api`;
`gradient` builds Tensors, so gradients are differentiable. `saves` declares which forward values the gradient
reads (see autograd.Op); checkpointing keeps or recomputes exactly those.
"""
import math

import numpy as np

from ..autograd import TensorOp
from ..backend_ndarray.ndarray import compact_strides  # the strides NDArray gives a compact array
from ..backend_selection import array_api, device_of
from ..specs import dtype_named

__all__ = [
    "AddScalar", "BroadcastTo", "Cast", "Conv", "Dilate", "DivScalar", "EWiseAdd", "EWiseDiv", "EWiseMul", "EWisePow",
    "EWiseSub", "Exp", "Flip", "GatherRows", "Log", "MatMul", "MulScalar", "Negate", "Pad", "PickColumns",
    "PowerScalar", "ReLUMask", "Reshape", "ScatterAddRows", "ScatterColumns", "Sigmoid", "Slice", "Summation",
    "Tanh", "Transpose", "UnDilate", "add", "add_scalar", "broadcast_to", "cast", "conv", "dilate", "divide",
    "divide_scalar", "exp", "flip", "gather_rows", "log", "matmul", "mul_scalar", "multiply", "negate", "pad",
    "pick_columns", "power", "power_scalar", "relu_mask", "reshape", "scatter_add_rows", "scatter_columns",
    "sigmoid", "slice_window", "subtract", "sum_to_shape", "summation", "tanh", "transpose", "undilate",
]


# Two-input element-wise ops follow the shape rule of the array library they run on: numpy.ndarray
# (NEEDLE_BACKEND=np) broadcasts as NumPy does, as the course's NumPy backend did; NDArray requires equal shapes
# and raises a ValueError naming both (broadcast explicitly with broadcast_to). Their gradients therefore go
# through _sum_to_inputs, which undoes a broadcast and is a no-op when there was none.
class _EWiseBinary(TensorOp):
    """Base of the two-input element-wise ops (not an op itself)."""

    elementwise = True
    autocast = "low"

    def infer_dtype(self, a, b):
        return array_api.promote_types(a, b)  # operands of two dtypes: compute in the promoted one

    def infer_shape(self, a, b):
        # Equal shapes give the output's; otherwise compute decides (NumPy broadcasts, NDArray raises).
        return a if tuple(a) == tuple(b) else None


def sum_to_shape(grad, shape, grad_shape):
    """`grad` (of shape `grad_shape`) summed back to an input's `shape`: over the leading axes broadcasting added
    and the size-1 axes it stretched, then reshaped. `grad` itself when the shapes match: no extra graph node."""
    shape, grad_shape = tuple(shape), tuple(grad_shape)
    if grad_shape == shape:
        return grad
    lead = len(grad_shape) - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape) if n == 1 and grad_shape[lead + i] != 1)
    return reshape(summation(grad, axes), shape)


def _sum_to_inputs(node, *grads):
    """The gradients of `node`'s inputs, each summed back to its input's shape.

    The shapes are read from the forward values (kept, or recorded when checkpointing released them), never
    from the lazily built gradients, so asking for them computes nothing.
    """
    return tuple(sum_to_shape(g, x.shape, node.shape) for g, x in zip(grads, node.inputs))


class EWiseAdd(_EWiseBinary):
    """a + b;  d/da = d/db = out_grad"""

    saves = "none"

    def compute(self, a, b):
        return a + b

    def gradient(self, out_grad, node):
        return _sum_to_inputs(node, out_grad, out_grad)


def add(a, b):
    return EWiseAdd()(a, b)


class EWiseSub(_EWiseBinary):
    """a - b;  d/da = out_grad, d/db = -out_grad"""

    saves = "none"

    def compute(self, a, b):
        return a - b

    def gradient(self, out_grad, node):
        return _sum_to_inputs(node, out_grad, -out_grad)


def subtract(a, b):
    return EWiseSub()(a, b)


class AddScalar(TensorOp):
    """a + c;  d/da = out_grad"""

    elementwise = True

    saves = "none"

    def __init__(self, scalar):
        self.scalar = scalar

    def compute(self, a):
        return a + self.scalar

    def gradient(self, out_grad, node):
        return (out_grad,)


def add_scalar(a, scalar):
    return AddScalar(scalar)(a)


class EWiseMul(_EWiseBinary):
    """a * b;  d/da = out_grad * b, d/db = out_grad * a"""

    def compute(self, a, b):
        return a * b

    def gradient(self, out_grad, node):
        lhs, rhs = node.inputs
        return _sum_to_inputs(node, out_grad * rhs, out_grad * lhs)


def multiply(a, b):
    return EWiseMul()(a, b)


class MulScalar(TensorOp):
    """a * c;  d/da = out_grad * c"""

    elementwise = True

    saves = "none"

    def __init__(self, scalar):
        self.scalar = scalar

    def compute(self, a):
        return a * self.scalar

    def gradient(self, out_grad, node):
        return (out_grad * self.scalar,)


def mul_scalar(a, scalar):
    return MulScalar(scalar)(a)


class EWisePow(_EWiseBinary):
    """a ** b;  d/da = out_grad * b * a^(b-1), d/db = out_grad * a^b * log(a)"""

    saves = "both"

    def compute(self, a, b):
        return a**b

    def gradient(self, out_grad, node):
        a, b = node.inputs
        return _sum_to_inputs(node, out_grad * b * a ** (b - 1), out_grad * node * log(a))


def power(a, b):
    return EWisePow()(a, b)


class PowerScalar(TensorOp):
    """a ** c for a number c;  d/da = out_grad * c * a^(c-1)"""

    elementwise = True

    def __init__(self, scalar):
        self.scalar = scalar

    def compute(self, a):
        return a**self.scalar

    def gradient(self, out_grad, node):
        a = node.inputs[0]
        return (out_grad * self.scalar * a ** (self.scalar - 1),)


def power_scalar(a, scalar):
    return PowerScalar(scalar)(a)


class EWiseDiv(_EWiseBinary):
    """a / b;  d/da = out_grad / b, d/db = -out_grad * a / b^2"""

    def compute(self, a, b):
        return a / b

    def gradient(self, out_grad, node):
        a, b = node.inputs
        return _sum_to_inputs(node, out_grad / b, -out_grad * a / (b * b))


def divide(a, b):
    return EWiseDiv()(a, b)


class DivScalar(TensorOp):
    """a / c;  d/da = out_grad / c"""

    elementwise = True

    saves = "none"

    def __init__(self, scalar):
        self.scalar = scalar

    def compute(self, a):
        return a / self.scalar

    def gradient(self, out_grad, node):
        return (out_grad / self.scalar,)


def divide_scalar(a, scalar):
    return DivScalar(scalar)(a)


class Negate(TensorOp):
    """-a;  d/da = -out_grad"""

    elementwise = True

    saves = "none"

    def compute(self, a):
        return a * -1

    def gradient(self, out_grad, node):
        return (-out_grad,)


def negate(a):
    return Negate()(a)


class Cast(TensorOp):
    """`a` stored in another dtype (rounded to nearest);  d/da = out_grad cast back to a's dtype"""

    saves = "none"
    elementwise = True

    def __init__(self, dtype):
        self.dtype = str(np.dtype(dtype))  # one spelling ("bfloat16") for names, NumPy dtypes and types

    def infer_dtype(self, a):
        return self.dtype

    def compute(self, a):
        return array_api.astype(a, self.dtype)

    def gradient(self, out_grad, node):
        return (cast(out_grad, node.inputs[0].dtype),)


def cast(a, dtype):
    """`a` in `dtype`: `a` itself when it already is, else a Cast node (differentiable)."""
    dtype = dtype_named(dtype, "cast")
    if str(np.dtype(a.dtype)) == dtype:
        return a
    return Cast(dtype)(a)


class Transpose(TensorOp):
    """Swap two axes (the last two by default);  the gradient swaps them back"""

    saves = "none"
    view = True

    def view_strides(self, shape, strides, out_shape):
        return tuple(strides[i] for i in self._permutation(len(shape)))  # NDArray.permute

    def __init__(self, axes=None):
        if axes is not None and len(axes) != 2:
            raise ValueError(f"Transpose: axes must be a pair, got {axes}")
        self.axes = tuple(axes) if axes is not None else None

    def _permutation(self, ndim):
        if ndim < 2:
            raise ValueError(f"Transpose: needs at least 2 dimensions, got {ndim}")
        i, j = self.axes if self.axes is not None else (ndim - 2, ndim - 1)
        if not (-ndim <= i < ndim and -ndim <= j < ndim):
            raise ValueError(f"Transpose: axes {self.axes} out of range for {ndim} dimensions")
        perm = list(range(ndim))
        perm[i], perm[j] = perm[j], perm[i]
        return tuple(perm)

    def infer_shape(self, shape):
        return tuple(shape[i] for i in self._permutation(len(shape)))

    def compute(self, a):
        return array_api.transpose(a, self._permutation(len(a.shape)))

    def gradient(self, out_grad, node):
        return (transpose(out_grad, self.axes),)


def transpose(a, axes=None):
    return Transpose(axes)(a)


class Reshape(TensorOp):
    """a viewed with a new shape (same number of elements);  the gradient reshapes back"""

    saves = "none"
    view = True

    def view_strides(self, shape, strides, out_shape):
        # NDArray.reshape views compact arrays only; a strided one is compacted (copied) first.
        return compact_strides(out_shape) if tuple(strides) == compact_strides(shape) else None

    def __init__(self, shape):
        self.shape = tuple(shape)

    def infer_shape(self, shape):
        known = -math.prod(self.shape) if -1 in self.shape else None
        return tuple(math.prod(shape) // known if n == -1 else n for n in self.shape)

    def compute(self, a):
        try:
            return array_api.reshape(a, self.shape)
        except ValueError as err:
            raise ValueError(f"Reshape: cannot reshape {tuple(a.shape)} into {self.shape}") from err

    def gradient(self, out_grad, node):
        return (reshape(out_grad, node.inputs[0].shape),)


def reshape(a, shape):
    return Reshape(shape)(a)


class BroadcastTo(TensorOp):
    """a repeated along size-1 (or new leading) axes;  the gradient sums over those axes"""

    saves = "none"
    view = True

    def view_strides(self, shape, strides, out_shape):
        # NDArray.broadcast_to: new leading axes and stretched size-1 axes get stride 0.
        lead = len(out_shape) - len(shape)
        return (0,) * lead + tuple(0 if n != m else st for st, n, m in zip(strides, shape, out_shape[lead:]))

    def __init__(self, shape):
        self.shape = tuple(shape)

    def infer_shape(self, shape):
        return self.shape

    def compute(self, a):
        try:
            return array_api.broadcast_to(a, self.shape)
        except ValueError as err:
            raise ValueError(f"BroadcastTo: cannot broadcast {tuple(a.shape)} to {self.shape}") from err

    def gradient(self, out_grad, node):
        in_shape = node.inputs[0].shape
        lead = len(self.shape) - len(in_shape)
        axes = tuple(range(lead)) + tuple(
            lead + i for i, (n, m) in enumerate(zip(in_shape, self.shape[lead:])) if n == 1 and m != 1
        )
        grad = summation(out_grad, axes) if axes else out_grad
        return (reshape(grad, in_shape),)


def broadcast_to(a, shape):
    return BroadcastTo(shape)(a)


def _normalize_axes(axes, ndim, op):
    if axes is None:
        return tuple(range(ndim))
    if isinstance(axes, (int, np.integer)):
        axes = (axes,)
    if not isinstance(axes, (tuple, list)) or any(isinstance(ax, bool) or not isinstance(ax, (int, np.integer))
                                                  for ax in axes):
        raise TypeError(f"{op}: axes must be None, an int or a tuple of ints, got {axes!r}")
    for ax in axes:
        if not -ndim <= ax < max(ndim, 1):
            raise ValueError(f"{op}: axis {ax} is out of range for {ndim} dimensions")
    normalized = [int(ax) % max(ndim, 1) for ax in axes]
    if len(set(normalized)) != len(normalized):  # NumPy refuses them too; summing an axis twice has no meaning
        raise ValueError(f"{op}: axes {tuple(axes)} name an axis twice")
    return tuple(sorted(normalized))


class Summation(TensorOp):
    """Sum over `axes` (None: all), dropping them;  the gradient broadcasts out_grad back"""

    saves = "none"
    compacts_inputs = True
    autocast = "float32"  # means and variances (layer norm's statistics) stay float32

    def __init__(self, axes=None):
        self.axes = axes

    def infer_shape(self, shape):
        axes = _normalize_axes(self.axes, len(shape), "Summation")
        return tuple(n for i, n in enumerate(shape) if i not in axes)

    def workspace(self, shape):
        axes = _normalize_axes(self.axes, len(shape), "Summation")
        if axes == tuple(range(len(shape) - len(axes), len(shape))):
            return 0  # trailing axes: each output reduces one contiguous row in place
        if axes == tuple(range(len(axes))):
            return math.prod(shape[i] for i in axes)  # leading axes: ones @ a, the ones row
        return math.prod(shape)  # other axes are moved last: a permuted copy

    def compute(self, a):
        axes = _normalize_axes(self.axes, len(a.shape), "Summation")
        return array_api.sum(a, axis=axes)

    def gradient(self, out_grad, node):
        in_shape = node.inputs[0].shape
        axes = _normalize_axes(self.axes, len(in_shape), "Summation")
        kept = tuple(1 if i in axes else n for i, n in enumerate(in_shape))
        return (broadcast_to(reshape(out_grad, kept), in_shape),)


def summation(a, axes=None):
    return Summation(axes)(a)


class MatMul(TensorOp):
    """a @ b (batch axes broadcast);  d/da = out_grad @ b^T, d/db = a^T @ out_grad, summed to each shape"""

    saveable = True
    compacts_inputs = True
    autocast = "low"

    def infer_dtype(self, a, b):
        return array_api.promote_types(a, b)

    def infer_shape(self, a, b):
        if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
            return None  # let compute raise its error
        return tuple(np.broadcast_shapes(a[:-2], b[:-2])) + (a[-2], b[-1])

    def reads_transposed(self, a, b):
        return len(a) == 2 and len(b) == 2  # a transposed operand is read in place (NDArray.__matmul__)

    def compute(self, a, b):
        if len(a.shape) < 2 or len(b.shape) < 2 or a.shape[-1] != b.shape[-2]:
            raise ValueError(f"MatMul: shapes {tuple(a.shape)} and {tuple(b.shape)} are not aligned")
        return array_api.matmul(a, b)

    def gradient(self, out_grad, node):
        a, b = node.inputs
        return _sum_to(matmul(out_grad, transpose(b)), a.shape), _sum_to(matmul(transpose(a), out_grad), b.shape)


def _sum_to(grad, shape):
    """Sum the leading batch axes that broadcasting added, so the gradient has the input's shape."""
    lead = len(grad.shape) - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape[:-2]) if n == 1 and
                                      grad.shape[lead + i] != 1)
    if axes:
        grad = reshape(summation(grad, axes), shape)
    return grad


def matmul(a, b):
    return MatMul()(a, b)


class Log(TensorOp):
    """log(a);  d/da = out_grad / a"""

    autocast = "float32"
    elementwise = True

    def compute(self, a):
        return array_api.log(a)

    def gradient(self, out_grad, node):
        return (out_grad / node.inputs[0],)


def log(a):
    return Log()(a)


class Exp(TensorOp):
    """exp(a);  d/da = out_grad * exp(a)"""

    autocast = "low"
    elementwise = True

    saves = "output"

    def compute(self, a):
        return array_api.exp(a)

    def gradient(self, out_grad, node):
        return (out_grad * node,)


def exp(a):
    return Exp()(a)


class ReLUMask(TensorOp):
    """1 where a > 0, else 0 (the derivative of relu);  its own derivative is 0"""

    elementwise = True

    saves = "none"

    def compute(self, a):
        return a > 0

    def gradient(self, out_grad, node):
        return (out_grad * 0.0,)


def relu_mask(a):
    return ReLUMask()(a)


class Tanh(TensorOp):
    """tanh(a);  d/da = out_grad * (1 - tanh(a)^2)"""

    autocast = "low"
    elementwise = True

    saves = "output"

    def compute(self, a):
        return array_api.tanh(a)

    def gradient(self, out_grad, node):
        return (out_grad * (1 - node * node),)


def tanh(a):
    return Tanh()(a)


class Sigmoid(TensorOp):
    """1 / (1 + exp(-a));  d/da = out_grad * s * (1 - s)"""

    autocast = "low"
    elementwise = True

    saves = "output"

    def workspace(self, a):
        return math.prod(a)  # one temporary of a's size beside the result

    def compute(self, a):
        return (array_api.exp(a * -1) + 1) ** -1

    def gradient(self, out_grad, node):
        return (out_grad * node * (1 - node),)


def sigmoid(a):
    return Sigmoid()(a)


class Flip(TensorOp):
    """a reversed along `axes`;  the gradient flips back"""

    elementwise = True

    saves = "none"

    def __init__(self, axes):
        self.axes = (axes,) if isinstance(axes, int) else tuple(axes)

    def compute(self, a):
        axes = _normalize_axes(self.axes, len(a.shape), "Flip")
        return array_api.flip(a, axes)

    def gradient(self, out_grad, node):
        return (flip(out_grad, self.axes),)


def flip(a, axes):
    return Flip(axes)(a)


class Dilate(TensorOp):
    """Insert `dilation` zeros after every element along `axes` (size n -> n * (dilation + 1))"""

    saves = "none"

    def __init__(self, axes, dilation):
        self.axes = (axes,) if isinstance(axes, int) else tuple(axes)
        self.dilation = dilation

    def infer_shape(self, shape):
        axes = _normalize_axes(self.axes, len(shape), "Dilate")
        return tuple(n * (self.dilation + 1) if i in axes else n for i, n in enumerate(shape))

    def compute(self, a):
        shape = list(a.shape)
        axes = _normalize_axes(self.axes, len(shape), "Dilate")
        for ax in axes:
            shape[ax] *= self.dilation + 1
        out = array_api.full(tuple(shape), 0.0, dtype=a.dtype, device=_device_of(a))
        out[tuple(slice(None, None, self.dilation + 1) if i in axes else slice(None) for i in range(len(shape)))] = a
        return out

    def gradient(self, out_grad, node):
        return (undilate(out_grad, self.axes, self.dilation),)


def dilate(a, axes, dilation):
    return Dilate(axes, dilation)(a)


class UnDilate(TensorOp):
    """Keep every (dilation + 1)-th element along `axes`;  the gradient dilates back"""

    saves = "none"

    def __init__(self, axes, dilation):
        self.axes = (axes,) if isinstance(axes, int) else tuple(axes)
        self.dilation = dilation

    def infer_shape(self, shape):
        axes = _normalize_axes(self.axes, len(shape), "UnDilate")
        return tuple(len(range(0, n, self.dilation + 1)) if i in axes else n for i, n in enumerate(shape))

    def compute(self, a):
        axes = _normalize_axes(self.axes, len(a.shape), "UnDilate")
        index = tuple(slice(None, None, self.dilation + 1) if i in axes else slice(None) for i in range(len(a.shape)))
        return _copy(a[index])

    def gradient(self, out_grad, node):
        return (dilate(out_grad, self.axes, self.dilation),)


def undilate(a, axes, dilation):
    return UnDilate(axes, dilation)(a)


class Pad(TensorOp):
    """Zero padding: axes[i] = (before, after) for axis i;  the gradient is the window of the original"""

    saves = "none"

    def __init__(self, axes):
        self.axes = tuple(tuple(p) for p in axes)

    def infer_shape(self, shape):
        if len(self.axes) != len(shape) or any(lo < 0 or hi < 0 for lo, hi in self.axes):
            return None  # compute raises the error
        return tuple(n + lo + hi for n, (lo, hi) in zip(shape, self.axes))

    def compute(self, a):
        if len(self.axes) != len(a.shape):
            raise ValueError(f"Pad: {len(self.axes)} (before, after) pairs for shape {tuple(a.shape)}")
        return array_api.pad(a, self.axes)

    def gradient(self, out_grad, node):
        return (slice_window(out_grad, tuple(lo for lo, _ in self.axes), node.inputs[0].shape),)


def pad(a, axes):
    return Pad(axes)(a)


class Slice(TensorOp):
    """The window a[start_i : start_i + size_i] on every axis i;  the gradient zero-pads it back"""

    saves = "none"
    view = True

    def view_strides(self, shape, strides, out_shape):
        # compute copies the window, unless it is the whole (compact) array: then compact() returns it as is.
        return strides if tuple(out_shape) == tuple(shape) and strides == compact_strides(shape) else None

    def __init__(self, starts, sizes):
        self.starts, self.sizes = tuple(starts), tuple(sizes)

    def infer_shape(self, shape):
        fits = len(self.sizes) == len(shape) and all(s >= 0 and s + n <= m for s, n, m in
                                                      zip(self.starts, self.sizes, shape))
        return self.sizes if fits else None  # compute raises the error

    def compute(self, a):
        if any(s < 0 or s + n > m for s, n, m in zip(self.starts, self.sizes, a.shape)):
            raise ValueError(f"Slice: window at {self.starts} of size {self.sizes} exceeds shape {tuple(a.shape)}")
        return _copy(a[tuple(slice(s, s + n) for s, n in zip(self.starts, self.sizes))])

    def gradient(self, out_grad, node):
        shape = node.inputs[0].shape
        return (pad(out_grad, tuple((s, m - s - n) for s, n, m in zip(self.starts, self.sizes, shape))),)


def slice_window(a, starts, sizes):
    return Slice(starts, sizes)(a)


class Conv(TensorOp):
    """2-D convolution, NHWC input (N, H, W, C_in), weight (K, K, C_in, C_out), by im2col on a strided view.

    d/dZ is the full convolution of the (dilated) out_grad with the flipped weight; d/dW correlates Z with it.
    """

    saveable = True
    compacts_inputs = (1,)  # the weight: reshaped for the matmul (the input is read through a strided view)
    autocast = "low"

    def infer_dtype(self, a, b):
        return array_api.promote_types(a, b)

    def __init__(self, stride=1, padding=0):
        for name, value, low in (("stride", stride, 1), ("padding", padding, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"conv: {name} must be an integer >= {low}, got {value!r}")
        self.stride = int(stride)
        self.padding = int(padding)

    def infer_shape(self, z, w):
        if len(z) != 4 or len(w) != 4 or z[3] != w[2]:
            return None  # compute raises the error
        H, Wd = z[1] + 2 * self.padding, z[2] + 2 * self.padding
        if H < w[0] or Wd < w[1]:
            return None
        return (z[0], (H - w[0]) // self.stride + 1, (Wd - w[1]) // self.stride + 1, w[3])

    def workspace(self, z, w):
        out = self.infer_shape(z, w)
        if out is None:
            return 0
        padded = z[0] * (z[1] + 2 * self.padding) * (z[2] + 2 * self.padding) * z[3] if self.padding else 0
        return padded + out[0] * out[1] * out[2] * w[0] * w[1] * z[3]  # the padded input and im2col's rows

    def compute(self, Z, W):
        # The kernel may be rectangular (KH, KW): the weight gradient of a non-square image convolves with one.
        if len(Z.shape) != 4 or len(W.shape) != 4 or Z.shape[3] != W.shape[2]:
            raise ValueError(f"Conv: input {tuple(Z.shape)} (N, H, W, C_in) and weight {tuple(W.shape)} "
                             f"(KH, KW, C_in, C_out) do not match")
        p, s = self.padding, self.stride
        if p:
            Z = array_api.pad(Z, ((0, 0), (p, p), (p, p), (0, 0)))
        N, H, Wd, C = Z.shape
        KH, KW, _, C_out = W.shape
        if H < KH or Wd < KW:
            raise ValueError(f"Conv: kernel {(KH, KW)} larger than the padded input {(H, Wd)}")
        H_out, W_out = (H - KH) // s + 1, (Wd - KW) // s + 1
        # im2col: element (n, i, j, di, dj, c) of the view is Z[n, i*s + di, j*s + dj, c]; no copy until compact.
        Ns, Hs, Ws, Cs = _strides(Z)
        cols = _as_strided(Z, (N, H_out, W_out, KH, KW, C), (Ns, Hs * s, Ws * s, Hs, Ws, Cs))
        cols = array_api.reshape(cols, (N * H_out * W_out, KH * KW * C))
        out = array_api.matmul(cols, array_api.reshape(W, (KH * KW * C, C_out)))
        return array_api.reshape(out, (N, H_out, W_out, C_out))

    def gradient(self, out_grad, node):
        Z, W = node.inputs
        if W.shape[0] != W.shape[1]:
            raise NotImplementedError(f"Conv: the gradient needs a square kernel, got {tuple(W.shape[:2])}")
        K, p, s = W.shape[0], self.padding, self.stride
        H, Wd = Z.shape[1] + 2 * p, Z.shape[2] + 2 * p
        if s > 1:
            out_grad = dilate(out_grad, (1, 2), s - 1)
            # dilation leaves (H_out * s) rows; the correlation needs exactly H - K + 1.
            N, _, _, C_out = out_grad.shape
            out_grad = slice_window(out_grad, (0, 0, 0, 0), (N, H - K + 1, Wd - K + 1, C_out))
        W_flip = transpose(flip(W, (0, 1)), (2, 3))
        Z_grad = conv(out_grad, W_flip, padding=K - 1 - p)
        Z_t = transpose(Z, (0, 3))  # (C_in, H, W, N)
        grad_t = transpose(transpose(out_grad, (0, 1)), (1, 2))  # (H_out, W_out, N, C_out)
        W_grad = transpose(transpose(conv(Z_t, grad_t, padding=p), (0, 1)), (1, 2))
        return Z_grad, W_grad


def conv(a, b, stride=1, padding=0):
    return Conv(stride, padding)(a, b)


class GatherRows(TensorOp):
    """table[ids] for a (n, d) table and integer-valued ids (k,) -> (k, d);  d/dtable scatter-adds out_grad"""

    compacts_inputs = True

    def infer_shape(self, table, ids):
        return (ids[0], table[1]) if len(table) == 2 and len(ids) == 1 else None

    def compute(self, table, ids):
        if len(table.shape) != 2 or len(ids.shape) != 1:
            raise ValueError(f"GatherRows: table {tuple(table.shape)} must be 2-D and ids {tuple(ids.shape)} 1-D")
        return array_api.take_rows(table, ids)

    def gradient(self, out_grad, node):
        table, ids = node.inputs
        return scatter_add_rows(out_grad, ids, table.shape[0]), None  # ids are integers: no gradient


def gather_rows(table, ids):
    return GatherRows()(table, ids)


class ScatterAddRows(TensorOp):
    """A (num_rows, d) zero table with rows[i] added at row ids[i];  d/drows = out_grad[ids]"""

    compacts_inputs = True

    def __init__(self, num_rows):
        self.num_rows = num_rows

    def infer_shape(self, rows, ids):
        return (self.num_rows, rows[1])

    def compute(self, rows, ids):
        return array_api.scatter_add_rows(rows, ids, self.num_rows)

    def gradient(self, out_grad, node):
        rows, ids = node.inputs
        return gather_rows(out_grad, ids), None  # ids are integers: no gradient


def scatter_add_rows(rows, ids, num_rows):
    return ScatterAddRows(num_rows)(rows, ids)


class PickColumns(TensorOp):
    """a[i, ids[i]] for a (n, c) and integer-valued ids (n,) -> (n,);  d/da puts out_grad[i] at [i, ids[i]]"""

    saves = "inputs"
    compacts_inputs = True

    def infer_shape(self, a, ids):
        return (a[0],)

    def compute(self, a, ids):
        if len(a.shape) != 2 or tuple(ids.shape) != (a.shape[0],):
            raise ValueError(f"PickColumns: need a (n, c) and ids (n,), got {tuple(a.shape)} and {tuple(ids.shape)}")
        return array_api.take_along_rows(a, ids)

    def gradient(self, out_grad, node):
        a, ids = node.inputs
        return scatter_columns(out_grad, ids, a.shape[1]), None  # ids are integers: no gradient


def pick_columns(a, ids):
    return PickColumns()(a, ids)


class ScatterColumns(TensorOp):
    """A (n, num_cols) zero array with values[i] at [i, ids[i]];  d/dvalues = out_grad[i, ids[i]]"""

    compacts_inputs = True

    def __init__(self, num_cols):
        self.num_cols = num_cols

    def infer_shape(self, values, ids):
        return (values[0], self.num_cols)

    def compute(self, values, ids):
        return array_api.scatter_along_rows(values, ids, self.num_cols)

    def gradient(self, out_grad, node):
        return pick_columns(out_grad, node.inputs[1]), None


def scatter_columns(values, ids, num_cols):
    return ScatterColumns(num_cols)(values, ids)


# ----- small helpers that hide the one difference between NDArray and numpy.ndarray that ops meet -----------------
def _device_of(array):
    return device_of(array)


def _copy(view):
    """A compact copy of a view (NDArray.compact / numpy.ascontiguousarray)."""
    return view.compact() if hasattr(view, "compact") else view.copy()


def _strides(a):
    if hasattr(a, "compact"):
        return a.strides
    return tuple(s // a.itemsize for s in a.strides)


def _as_strided(a, shape, strides):
    if hasattr(a, "compact"):
        return a.as_strided(shape, strides)
    return np.lib.stride_tricks.as_strided(a, shape, tuple(x * a.itemsize for x in strides), writeable=False)
