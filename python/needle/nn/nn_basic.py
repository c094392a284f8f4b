"""The basic layers: linear maps, activations, containers, normalizations, dropout and the softmax loss.

Every layer reads only shapes in `forward` (never values), so it builds the same graph in eager and lazy mode.
A layer whose interior is worth recomputing calls `self.checkpoint(out, inputs)` last (see Module.checkpoint):
`inputs` are all the Tensors it was called with, never its parameters. Containers (Sequential, Residual) do not
annotate: that would turn their children's boundaries into interior nodes.
"""
import math

import numpy as np

from .. import init, memory_hook, ops
from ..autograd import Tensor
from ..ops.ops_activation import check_bits, check_relu_bits
from ..backend_selection import array_api
from .nn_module import Module, Parameter

__all__ = [
    "BatchNorm1d", "BatchNorm2d", "Dropout", "Flatten", "GELU", "Identity", "LayerNorm1d", "Linear", "ReLU",
    "Residual", "Sequential", "SiLU", "Sigmoid", "SoftmaxLoss", "Tanh",
]


def _prod(shape):
    return math.prod(shape)


def _expect(module, ok, expected, got):
    """Raise ValueError naming the module, the expected and the actual input shape, unless `ok`."""
    if not ok:
        raise ValueError(f"{module}: expected input {expected}, got {tuple(got)}")


def _row(vector, ndim):
    """A (d,) Tensor viewed as (1, ..., 1, d), ready to broadcast over `ndim` axes."""
    return ops.reshape(vector, (1,) * (ndim - 1) + (vector.shape[0],))


def _assign(buffer, value):
    """Replace a plain Tensor's value by the raw `value` (no graph), keeping the buffer's dtype."""
    buffer.cached_data = array_api.cast_like(value, buffer.cached_data)


class Identity(Module):
    def forward(self, x):
        return x


class Linear(Module):
    """y = x W + b, for x of shape (..., in_features); W (in, out), b (1, out) broadcast (a view, no copy)."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype="float32"):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = Parameter(init.kaiming_uniform(in_features, out_features, device=device, dtype=dtype))
        self.bias = None
        if bias:
            b = init.kaiming_uniform(out_features, 1, device=device, dtype=dtype)
            self.bias = Parameter(ops.reshape(b, (1, out_features)))

    def forward(self, X, activation=None, activation_bits=None):
        """activation "relu", "gelu", "gelu_tanh" or "silu": applied in the same op (ops.linear; relu keeps no
        pre-activation, the others keep it for their gradient, or with activation_bits a few-bit code of it)."""
        shape = X.shape
        _expect("Linear", len(shape) >= 1 and shape[-1] == self.in_features, f"(..., {self.in_features})", shape)
        # One graph node (ops.linear): the numbers of reshape, matmul, a broadcast bias add and reshape back.
        return self.checkpoint(ops.linear(X, self.weight, self.bias, activation, activation_bits), [X])


class Flatten(Module):
    """(B, d1, d2, ...) -> (B, d1 * d2 * ...)."""

    def forward(self, X):
        shape = X.shape
        _expect("Flatten", len(shape) >= 1, "(B, ...)", shape)
        return ops.reshape(X, (shape[0], _prod(shape[1:])))


class ReLU(Module):
    """max(x, 0). bits=1 keeps its derivative as a 1-bit mask instead of reading its output (ops.relu)."""

    def __init__(self, bits=None):
        super().__init__()
        check_relu_bits("ReLU", bits)
        self.bits = bits

    def forward(self, x):
        return self.checkpoint(ops.relu(x, self.bits), [x])


class GELU(Module):
    """x Φ(x), as PyTorch's nn.GELU: approximate "none" (erf) or "tanh". Its gradient reads its input, or with
    `bits` a few-bit code of it (ops.gelu)."""

    def __init__(self, approximate="none", bits=None):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        check_bits("GELU", bits)
        self.approximate, self.bits = approximate, bits

    def forward(self, x):
        return self.checkpoint(ops.gelu(x, self.approximate, self.bits), [x])


class SiLU(Module):
    """x σ(x), as PyTorch's nn.SiLU. Its gradient reads its input, or with `bits` a few-bit code of it (ops.silu)."""

    def __init__(self, bits=None):
        super().__init__()
        check_bits("SiLU", bits)
        self.bits = bits

    def forward(self, x):
        return self.checkpoint(ops.silu(x, self.bits), [x])


class Tanh(Module):
    def forward(self, x):
        return ops.tanh(x)


class Sigmoid(Module):
    def forward(self, x):
        return ops.sigmoid(x)


class Sequential(Module):
    """modules applied in order. With checkpointing on it is a stack: its modules' outputs are its boundaries,
    which its policy may drop too ("all" keeps its input and output only; see checkpoint.annotate)."""

    def __init__(self, *modules):
        super().__init__()
        self.modules = modules

    def forward(self, x):
        first = x
        for module in self.modules:
            x = module(x)
        return self.checkpoint(x, [first], stack=True) if isinstance(first, Tensor) else x


class Residual(Module):
    """fn(x) + x."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x) + x


class SoftmaxLoss(Module):
    """mean over the batch of logsumexp(z) - z_y, for logits z (N, C) and integer class ids y (N,).

    One op per row (ops.softmax_cross_entropy): no (N, C) one-hot is ever built, and the gradient is a single
    fused pass over the logits.
    """

    def forward(self, logits, y):
        if not isinstance(y, Tensor):
            y = Tensor(y, device=logits.device, requires_grad=False)
        shape, y_shape = logits.shape, y.shape
        if len(shape) != 2 or tuple(y_shape) != (shape[0],):
            raise ValueError(f"SoftmaxLoss: expected logits (N, C) and labels (N,), got {tuple(shape)} and "
                             f"{tuple(y_shape)}")
        N, C = shape
        _check_labels(y, C)
        if y.requires_grad:
            y = y.detach()
        return ops.summation(ops.softmax_cross_entropy(logits, y)) / N


def _check_labels(y, num_classes):
    # A bad label gets an IndexError naming the loss here, where y's values already exist (a leaf, as data is),
    # so no computation is forced; the backend checks again in any case.
    if y.cached_data is None:
        return
    labels = y.numpy()
    bad = (labels < 0) | (labels >= num_classes) | (labels != np.floor(labels))
    if bad.any():
        raise IndexError(f"SoftmaxLoss: label {labels[bad][0]:g} is not a class id in [0, {num_classes})")


class BatchNorm1d(Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the batch axis of (N, dim) input.

    Train mode uses the batch statistics and updates running = (1 - m) running + m batch_stat (biased batch
    variance); eval mode uses the running statistics. The running buffers are plain Tensors updated on raw
    data, so the graph never grows across steps.
    """

    def __init__(self, dim, eps=1e-5, momentum=0.1, device=None, dtype="float32"):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.momentum = momentum
        self.weight = Parameter(init.ones(dim, device=device, dtype=dtype))
        self.bias = Parameter(init.zeros(dim, device=device, dtype=dtype))
        self.running_mean = init.zeros(dim, device=device, dtype=dtype)
        self.running_var = init.ones(dim, device=device, dtype=dtype)

    def _check(self, shape):
        _expect("BatchNorm1d", len(shape) == 2 and shape[1] == self.dim, f"(N, {self.dim})", shape)

    def forward(self, x):
        shape = x.shape
        self._check(shape)
        N, dim = shape
        if self.training:
            mean = ops.summation(x, (0,)) / N
            centered = ops.subtract(x, ops.broadcast_to(_row(mean, 2), shape))
            var = ops.summation(centered * centered, (0,)) / N
            m = self.momentum
            # The running update needs the batch statistics' values (lazy mode computes them here).
            _assign(self.running_mean, self.running_mean.realize_cached_data() * (1 - m)
                    + mean.realize_cached_data() * m)
            _assign(self.running_var, self.running_var.realize_cached_data() * (1 - m)
                    + var.realize_cached_data() * m)
        else:
            centered = ops.subtract(x, ops.broadcast_to(_row(self.running_mean, 2), shape))
            var = self.running_var
        std = ops.broadcast_to(_row((var + self.eps) ** 0.5, 2), shape)
        weight = ops.broadcast_to(_row(self.weight, 2), shape)
        bias = ops.broadcast_to(_row(self.bias, 2), shape)
        return weight * (centered / std) + bias


class BatchNorm2d(BatchNorm1d):
    """BatchNorm1d over the channels of NCHW input: (N, C, H, W) is normalized as (N*H*W, C)."""

    def forward(self, x):
        shape = x.shape
        _expect("BatchNorm2d", len(shape) == 4 and shape[1] == self.dim, f"(N, {self.dim}, H, W)", shape)
        N, C, H, W = shape
        nhwc = ops.transpose(ops.transpose(x, (1, 2)), (2, 3))
        y = super().forward(ops.reshape(nhwc, (N * H * W, C)))
        y = ops.reshape(y, (N, H, W, C))
        return ops.transpose(ops.transpose(y, (2, 3)), (1, 2))


class LayerNorm1d(Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis (biased variance, eps inside the sqrt)."""

    def __init__(self, dim, eps=1e-5, device=None, dtype="float32"):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = Parameter(init.ones(dim, device=device, dtype=dtype))
        self.bias = Parameter(init.zeros(dim, device=device, dtype=dtype))

    def forward(self, x):
        shape = x.shape
        _expect("LayerNorm1d", len(shape) >= 1 and shape[-1] == self.dim, f"(..., {self.dim})", shape)
        return ops.layer_norm(x, self.weight, self.bias, self.eps)  # one fused op (ops/ops_norm.py)


class Dropout(Module):
    """Train: x * mask / (1 - p), mask = randb(x.shape, p=1 - p) (one np.random.rand of x's shape, a leaf).

    Eval: the identity. Being a leaf, the mask is reused, never redrawn, when checkpointing recomputes.
    p = 0 in training: x itself (x * 1 / 1 is x, bit for bit), after drawing the same numbers from NumPy's RNG, so
    every later draw (and the course's seeded values) is unchanged, without keeping a mask of ones for backward.

    regenerate=True (0 < p < 1): no mask is kept. `ops.dropout` keeps element i by a hash of (seed, i) and its
    gradient regenerates the mask from the seed; the seed comes from the same NumPy draw the mask would have
    taken (`draw_like_rand`), so NumPy's stream advances exactly as with the course's mask. Other elements are
    dropped than with the course's mask (the same rate). TransformerLayer(fused_attention=True) turns it on.
    """

    def __init__(self, p=0.5, regenerate=False):
        super().__init__()
        self.p = p
        self.regenerate = regenerate

    @property
    def p(self):
        return self._p

    @p.setter
    def p(self, p):  # checked whenever it is set: a rate outside [0, 1] would scale or zero silently
        if isinstance(p, bool) or not isinstance(p, (int, float, np.integer, np.floating)) or not 0 <= p <= 1:
            raise ValueError(f"Dropout: p must be a probability in [0, 1], got {p!r}")
        self._p = p

    def forward(self, x):
        if not self.training:
            return x
        if self.p == 0:
            if memory_hook.PREDICTOR is None:  # (ndl.memory.predict's dry run draws nothing)
                np.random.rand(*x.shape)  # the mask's draw, as randb makes it: the stream stays the course's
            return x
        if self.regenerate and self.p < 1:
            return ops.dropout(x, self.p, draw_like_rand(_prod(x.shape)))
        mask = init.randb(*x.shape, p=1 - self.p, device=x.device, dtype=x.dtype)
        if self.p >= 1:
            return x * mask
        return x * mask / (1 - self.p)


_DRAW_CHUNK = 1 << 20


def draw_like_rand(n):
    """Advance NumPy's global RNG exactly as np.random.rand(n) would, a chunk at a time (no n-sized array);
    return a 32-bit seed made from the first number drawn (0 when n is 0)."""
    seed = 0
    if memory_hook.PREDICTOR is not None:  # ndl.memory.predict's dry run draws nothing: the stream is the step's
        return seed
    for start in range(0, n, _DRAW_CHUNK):
        u = np.random.random_sample(min(_DRAW_CHUNK, n - start))
        if start == 0:
            seed = int(u[0] * 2**32)
    return seed
