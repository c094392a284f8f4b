"""GELU and SiLU, the smooth activations of GPT- and Llama-style MLPs, each one op whose gradient reads its input.

ReLU's derivative needs only where its output is positive, so backward can read the output, which the next layer
keeps anyway. GELU's and SiLU's derivatives need the pre-activation itself (`saves = "inputs"`): in a GPT MLP the
widest tensor of the layer, kept for backward on the activation's account alone.

With `bits=k` (k in 1..4) `gelu` and `silu` keep a k-bit code of x instead (few-bit derivatives: the toolbox's
fewbit.py, loaded when `bits` is given).

The kernels are the backends' ewise_gelu / ewise_gelu_tanh / ewise_silu and their *_grad (src/README.md): one
pass each, float32 arithmetic, the result rounded once to the input's dtype.
"""
import math

from .. import lazy
from ..autograd import TensorOp
from ..backend_selection import array_api
from .ops_mathematic import exp, relu_mask, sigmoid, tanh
from .ops_tuple import tuple_get_item

__all__ = ["ActivationGrad", "GELU", "ReLU", "SiLU", "activation_values", "check_bits", "check_relu_bits", "gelu",
           "relu", "silu"]

APPROXIMATIONS = {"none": "gelu", "tanh": "gelu_tanh"}  # GELU's `approximate` -> the backend's kind
BITS = (1, 2, 3, 4)  # the bits per element a few-bit derivative may keep (toolbox/fewbit.py)


class GELU(TensorOp):
    """x Φ(x) (approximate="tanh": 0.5 x (1 + tanh(√(2/π)(x + 0.044715 x³))));  d/dx = out_grad * GELU'(x)"""

    autocast = "low"
    elementwise = True
    saves = "inputs"

    def __init__(self, approximate="none"):
        self.approximate, self.kind = approximate, APPROXIMATIONS[approximate]

    def compute(self, x):
        return array_api.activation(x, self.kind)

    def gradient(self, out_grad, node):
        return (ActivationGrad(self.kind)(node.inputs[0], out_grad),)


class SiLU(TensorOp):
    """x σ(x);  d/dx = out_grad * σ(x)(1 + x(1 − σ(x)))"""

    autocast = "low"
    elementwise = True
    saves = "inputs"
    kind = "silu"

    def compute(self, x):
        return array_api.activation(x, self.kind)

    def gradient(self, out_grad, node):
        return (ActivationGrad(self.kind)(node.inputs[0], out_grad),)


class ActivationGrad(TensorOp):
    """g · f'(x) for f = gelu, gelu_tanh or silu (`kind`);  d/dx = out_grad · g · f''(x), d/dg = out_grad · f'(x)"""

    autocast = "low"
    elementwise = True
    saves = "inputs"

    def __init__(self, kind):
        self.kind = kind

    def compute(self, x, g):
        return array_api.activation_grad(x, g, self.kind)

    def gradient(self, out_grad, node):
        x, g = node.inputs
        return out_grad * g * second_derivative(self.kind, x), ActivationGrad(self.kind)(x, out_grad)


SQRT_2_OVER_PI, TANH_CUBIC = math.sqrt(2 / math.pi), 0.044715


def second_derivative(kind, x):
    """f''(x) from ops (so it is differentiable again): gelu φ(x)(2 − x²); silu σ(1 − σ)(2 + x(1 − 2σ));
    gelu_tanh (1 − t²)(u' + x(u'' − 2t u'²)/2) with u = √(2/π)(x + 0.044715 x³), t = tanh(u)."""
    if kind == "gelu":
        return exp(x * x * -0.5) * (1 / math.sqrt(2 * math.pi)) * (x * x * -1.0 + 2.0)
    if kind == "silu":
        s = sigmoid(x)
        return s * (s * -1.0 + 1.0) * (x * (s * -2.0 + 1.0) + 2.0)
    t = tanh((x + x * x * x * TANH_CUBIC) * SQRT_2_OVER_PI)
    du = (x * x * (3 * TANH_CUBIC) + 1.0) * SQRT_2_OVER_PI
    ddu = x * (6 * TANH_CUBIC * SQRT_2_OVER_PI)
    return (t * t * -1.0 + 1.0) * (du + x * (ddu - t * du * du * 2.0) * 0.5)


class ReLU(TensorOp):
    """max(a, 0);  d/da = out_grad * (a > 0)"""

    autocast = "low"
    elementwise = True

    saves = "output"

    def compute(self, a):
        return array_api.maximum(a, 0)

    def gradient(self, out_grad, node):
        return (out_grad * relu_mask(node),)


def relu(x, bits=None):
    """max(x, 0), the course's ReLU. bits=1 keeps its derivative (0 or 1) as a 1-bit mask beside the output, so its
    gradient does not read the output: worth it where nothing else keeps the output exact (fewbit.py)."""
    check_relu_bits("relu", bits)
    if bits is not None:
        return tuple_get_item(lazy.load("fewbit").FewBitActivation("relu", 1)(x), 0)
    return ReLU()(x)


def gelu(x, approximate="none", bits=None):
    """GELU(x) = x Φ(x), Φ the standard normal CDF, as PyTorch's: approximate "none" (erf) or "tanh". bits: keep a
    `bits`-bit code of x for backward instead of x (few-bit derivative: FewBitActivation)."""
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    check_bits("gelu", bits)
    if bits is not None:
        return tuple_get_item(lazy.load("fewbit").FewBitActivation(APPROXIMATIONS[approximate], bits)(x), 0)
    return GELU(approximate)(x)


def silu(x, bits=None):
    """SiLU(x) = x σ(x) (also called swish), as PyTorch's. bits: as gelu's."""
    check_bits("silu", bits)
    if bits is not None:
        return tuple_get_item(lazy.load("fewbit").FewBitActivation("silu", bits)(x), 0)
    return SiLU()(x)


def activation_values(x, kind):
    """f(x) for an activation kind: relu (max(x, 0), as ReLU computes it) or the backends' (gelu, gelu_tanh, silu)."""
    return array_api.maximum(x, 0) if kind == "relu" else array_api.activation(x, kind)


def check_relu_bits(name, bits):
    """ValueError naming `name` unless relu's bits is None or 1 (its derivative is 0 or 1: one bit, exact)."""
    if bits is not None and (isinstance(bits, bool) or bits != 1):
        raise ValueError(f"{name}: relu's derivative is 0 or 1, so its mask takes 1 bit: bits must be None or 1, "
                         f"got {bits!r}")


def check_bits(name, bits):
    """ValueError naming `name` unless bits is None (exact derivatives) or one of BITS (a few-bit derivative)."""
    if bits is not None and (isinstance(bits, bool) or bits not in BITS):
        raise ValueError(f"{name}: bits must be None (the exact derivative) or one of {', '.join(map(str, BITS))}, "
                         f"got {bits!r}")
