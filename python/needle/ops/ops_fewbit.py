"""Few-bit derivatives (Novikov et al., "Few-Bit Backward", ICML 2023): GELU and SiLU whose backward keeps a
k-bit code of their input instead of the input.

GELU's and SiLU's gradients read x for f'(x). `FewBitActivation(kind, bits)` outputs (f(x), codes): f(x) exactly as
the plain op computes it, and for each element the index of the interval of fewbit.derivative_table(kind, bits)
that x falls in, packed `bits` bits per element (the backends' pack_codes). Its gradient multiplies by that
interval's level (`FewBitGrad`, unpack_scale): the fitted piecewise-constant derivative. It reads its own output
only (`saves = "output"`), so nothing keeps x alive on its account; fused into ops.linear (LinearActivation with
bits) the pre-activation is never a graph value at all. `ops.gelu(x, bits=k)`, `ops.silu(x, bits=k)`,
`ops.linear(..., activation_bits=k)`, `nn.GELU(bits=k)` and `TransformerLayer(activation_bits=k)` use it.

The gradient is an approximation by design: its error, for x from the table's distribution, is the table's
expected error (tests/test_activations.py), which test_autograd's numerical checks would not accept.
"""
import math

import numpy

from ..autograd import TensorOp, TensorTupleOp
from ..backend_ndarray.ndarray_backend_numpy import code_bytes
from ..backend_selection import array_api
from ..fewbit import BITS, derivative_table
from .ops_tuple import tuple_get_item

__all__ = ["FewBitActivation", "FewBitGrad", "activation_values", "check_relu_bits"]


class FewBitActivation(TensorTupleOp):
    """(f(x), codes): codes = x's `bits`-bit interval in fewbit.derivative_table(kind, bits);  d/dx = out_grad · q(x)"""

    autocast = "low"
    saves = "output"  # the codes (beside f(x) in the tuple), never x
    compressible_outputs = (0,)  # f(x) is for the next layer: this gradient reads only the codes

    def __init__(self, kind, bits):
        self.kind, self.bits = kind, bits

    def infer_shape(self, x):
        return x, (code_bytes(math.prod(x), self.bits),)

    def infer_dtype(self, dtype):
        return dtype, "uint8"

    def compute(self, x):
        return activation_values(x, self.kind), pack_input_codes(x, self.kind, self.bits)

    def gradient(self, out_grad, node):
        return (FewBitGrad(self.kind, self.bits)(tuple_get_item(node, 1), out_grad[0]),)


class FewBitGrad(TensorOp):
    """g · q(x), q(x) the level of x's code (packed `codes`) in derivative_table(kind, bits);  linear in g"""

    saves = "inputs"  # the codes (g is the incoming gradient)

    def __init__(self, kind, bits):
        self.kind, self.bits = kind, bits

    def infer_shape(self, codes, g):
        return g

    def infer_dtype(self, codes, g):
        return g

    def compute(self, codes, g):
        table = derivative_table(self.kind, self.bits)
        levels = array_api.array(numpy.asarray(table.levels, numpy.float32), dtype="float32", device=g.device)
        return array_api.unpack_scale(codes, levels, g, self.bits)

    def gradient(self, out_grad, node):
        return None, FewBitGrad(self.kind, self.bits)(node.inputs[0], out_grad)  # codes are integers: no gradient


def activation_values(x, kind):
    """f(x) for an activation of fewbit.derivative_table: relu (max(x, 0), as ReLU computes it) or the backends'."""
    return array_api.maximum(x, 0) if kind == "relu" else array_api.activation(x, kind)


def check_relu_bits(name, bits):
    """ValueError naming `name` unless relu's bits is None or 1 (its derivative is 0 or 1: one bit, exact)."""
    if bits is not None and (isinstance(bits, bool) or bits != 1):
        raise ValueError(f"{name}: relu's derivative is 0 or 1, so its mask takes 1 bit: bits must be None or 1, "
                         f"got {bits!r}")


def pack_input_codes(x, kind, bits):
    """The packed `bits`-bit codes of array x in fewbit.derivative_table(kind, bits) (pack_codes)."""
    table = derivative_table(kind, bits)
    boundaries = array_api.array(numpy.asarray(table.boundaries, numpy.float32), dtype="float32", device=x.device)
    return array_api.pack_codes(x, boundaries, bits)


def check_bits(name, bits):
    """ValueError naming `name` unless bits is None (exact derivatives) or one of fewbit.BITS."""
    if bits is not None and (isinstance(bits, bool) or bits not in BITS):
        raise ValueError(f"{name}: bits must be None (the exact derivative) or one of {', '.join(map(str, BITS))}, "
                         f"got {bits!r}")
