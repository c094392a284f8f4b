"""Few-bit derivatives: the piecewise-constant approximation of an activation's derivative that a k-bit code of
its input selects (Novikov et al., "Few-Bit Backward", ICML 2023).

GELU's and SiLU's gradients read their whole input x, for f'(x). With k bits per element, backward can keep only
which of 2^k intervals x fell in, and multiply by that interval's level instead of f'(x). The intervals and levels
are fitted once per (activation, k), as the paper does: they minimize the expected squared error of the derivative,

    E[(f'(x) − q(x))²],   q(x) = levels[i] for boundaries[i − 1] <= x < boundaries[i],

under a distribution of x. Here x ~ N(0, 1), the distribution of a pre-activation after layer norm and a linear
layer at initialization (the paper fits under the input's distribution; a standard normal is its usual stand-in).

The fit is exact on a grid: x on [−LIMIT, LIMIT] in GRID steps (the tails beyond carry under 1e−8 of the mass, and
f' there is within 1e−6 of its limits 0 and 1), and the best split of the grid into 2^k contiguous intervals is a
dynamic program over where each interval ends (O(2^k · GRID²), vectorized: well under a second). Each level is
then the mean of f' over its interval, weighted by the density, and each boundary the midpoint between the two
grid points it falls between. `derivative_table(kind, bits)` computes it once and caches it.

ReLU's derivative takes two values, so one bit holds it exactly: `derivative_table("relu", 1)` is the step at 0
(the boundary is the least positive float32, so x = 0 gets 0, as relu's gradient has it), with no error. Its
gradient usually reads relu's own output (the sign), which the next layer keeps anyway; the mask is worth its bit
where that output is not kept exact otherwise (compress.py: then the output is compressed for the next matmul
and the mask keeps the sign).
"""
import functools
import math
from dataclasses import dataclass

import numpy as np

from ..autograd import TensorOp, TensorTupleOp
from ..backend_ndarray.ndarray_backend_numpy import ACTIVATIONS, activation_derivative, code_bytes
from ..backend_selection import array_api
from ..ops.ops_activation import BITS, activation_values
from ..ops.ops_tuple import tuple_get_item

__all__ = ["DISTRIBUTION", "DerivativeTable", "FewBitActivation", "FewBitGrad", "RELU_BOUNDARY", "derivative_table",
           "pack_input_codes", "quantized_derivative"]

DISTRIBUTION = "N(0, 1)"
LIMIT, GRID = 6.0, 1201  # the grid: x from -6 to 6 in steps of 0.01
RELU_BOUNDARY = float(np.nextafter(np.float32(0), np.float32(1)))  # the least positive float32: x > 0 iff x >= it


@dataclass(frozen=True)
class DerivativeTable:
    """The fitted approximation of `kind`'s derivative with `bits` bits: 2^bits `levels` and the 2^bits − 1
    ascending `boundaries` between them; `expected_error` is E[(f' − q)²] under DISTRIBUTION, and `variance` is
    Var[f'] under it (the error of the best 0-bit approximation, a constant), so their ratio says what the bits buy."""

    kind: str
    bits: int
    boundaries: tuple
    levels: tuple
    expected_error: float
    variance: float

    def codes(self, x):
        """The code of each element of x (NumPy): how many boundaries are <= it, 0 .. 2^bits − 1."""
        return np.searchsorted(np.asarray(self.boundaries, dtype=np.float64), np.asarray(x, dtype=np.float64),
                               side="right").astype(np.uint8)


def _segment_costs(prefix_w, prefix_wd, prefix_wdd, ends):
    """cost[i, j] = the weighted squared error of the grid points [i, j) around their weighted mean (inf if j <= i)."""
    i, j = np.arange(len(prefix_w))[:, None], ends[None, :]
    w = prefix_w[j] - prefix_w[i]
    wd = prefix_wd[j] - prefix_wd[i]
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = (prefix_wdd[j] - prefix_wdd[i]) - np.where(w > 0, wd * wd / w, 0.0)
    return np.where(j > i, np.maximum(cost, 0.0), np.inf)


@functools.lru_cache(maxsize=None)
def derivative_table(kind, bits):
    """The optimal `bits`-bit piecewise-constant approximation of `kind`'s derivative ("gelu", "gelu_tanh",
    "silu"), fitted under DISTRIBUTION (see the module docstring)."""
    if kind == "relu":  # two values: one bit, exact
        if bits != 1:
            raise ValueError(f"derivative_table: relu's derivative is 0 or 1, one bit: got bits={bits!r}")
        return DerivativeTable("relu", 1, (RELU_BOUNDARY,), (0.0, 1.0), 0.0, 0.25)
    if kind not in ACTIVATIONS:
        raise ValueError(f"derivative_table: unknown activation {kind!r} (expected relu, {', '.join(ACTIVATIONS)})")
    if bits not in BITS:
        raise ValueError(f"derivative_table: bits must be one of {BITS}, got {bits!r}")
    x = np.linspace(-LIMIT, LIMIT, GRID)
    w = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) * (x[1] - x[0])
    w /= w.sum()
    d = activation_derivative(kind, x)
    prefix = [np.concatenate([[0.0], np.cumsum(v)]) for v in (w, w * d, w * d * d)]
    ends = np.arange(GRID + 1)
    cost = _segment_costs(*prefix, ends)  # (GRID + 1, GRID + 1): start i, end j
    best = cost[0].copy()  # best[j]: the least error of the points [0, j) in one interval
    splits = []
    for _ in range(2**bits - 1):  # one more interval each round: where does the last one start?
        total = best[:, None] + cost
        start = np.argmin(total, axis=0)
        splits.append(start)
        best = total[start, ends]
    starts, end = [], GRID
    for start in reversed(splits):  # walk back from the last interval's start to the first's
        end = int(start[end])
        starts.append(end)
    edges = [0] + sorted(starts) + [GRID]
    levels = [float(np.sum(w[a:b] * d[a:b]) / np.sum(w[a:b])) for a, b in zip(edges, edges[1:])]
    boundaries = [float((x[e - 1] + x[e]) / 2) for e in edges[1:-1]]
    mean = float(np.sum(w * d))
    return DerivativeTable(kind, bits, tuple(boundaries), tuple(levels), float(best[GRID]),
                           float(np.sum(w * (d - mean) ** 2)))


def quantized_derivative(kind, bits, x):
    """q(x): the fitted level of each element of x (NumPy), what a few-bit backward multiplies the gradient by."""
    table = derivative_table(kind, bits)
    return np.asarray(table.levels, dtype=np.float64)[table.codes(x)]


# ----- the ops: f(x) with the codes beside it, and the gradient that reads only the codes ----------------------------
# GELU's and SiLU's gradients read x for f'(x). `FewBitActivation(kind, bits)` outputs (f(x), codes): f(x) exactly as
# the plain op computes it, and for each element the index of the interval of derivative_table(kind, bits) that x
# falls in, packed `bits` bits per element (the backends' pack_codes). Its gradient multiplies by that interval's
# level (`FewBitGrad`, unpack_scale). It reads its own output only (`saves = "output"`), so nothing keeps x alive on
# its account; fused into ops.linear (LinearActivation with bits) the pre-activation is never a graph value at all.
# `ops.gelu(x, bits=k)`, `ops.silu(x, bits=k)`, `ops.linear(..., activation_bits=k)`, `nn.GELU(bits=k)` and
# `TransformerLayer(activation_bits=k)` load this module and use them. The gradient is an approximation by design:
# its error, for x from the table's distribution, is the table's expected error (tests), which the exact numerical
# gradient checks would not accept.


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
        levels = array_api.array(np.asarray(table.levels, np.float32), dtype="float32", device=g.device)
        return array_api.unpack_scale(codes, levels, g, self.bits)

    def gradient(self, out_grad, node):
        return None, FewBitGrad(self.kind, self.bits)(node.inputs[0], out_grad)  # codes are integers: no gradient


def pack_input_codes(x, kind, bits):
    """The packed `bits`-bit codes of array x in fewbit.derivative_table(kind, bits) (pack_codes)."""
    table = derivative_table(kind, bits)
    boundaries = array_api.array(np.asarray(table.boundaries, np.float32), dtype="float32", device=x.device)
    return array_api.pack_codes(x, boundaries, bits)
