"""Fused attention: softmax(scale q kᵀ + mask) v without the T_q × T_k scores ever existing whole.

FlashAttention (Dao et al. 2022) and FlashAttention-2 (Dao 2023): the forward pass computes the scores one tile of
queries × keys at a time, carries a running maximum and sum per query row from tile to tile (online softmax), and
writes only the output and one log-sum-exp per row; the backward pass recomputes each tile's probabilities from
that log-sum-exp. Tiling only reorders sums, so the numbers are the unfused ones up to rounding, and the memory an
attention call holds is linear in T. The kernels are the backends' `attention_forward` / `attention_backward`
(src/README.md; the NumPy reference writes the same algorithm as plain loops over tiles).
"""
import math

import numpy

from .. import autograd
from ..autograd import Tensor, TensorTupleOp
from ..backend_selection import array_api
from .ops_tuple import tuple_get_item

__all__ = ["ScaledDotProductAttention", "ScaledDotProductAttentionGrad", "scaled_dot_product_attention"]


class ScaledDotProductAttention(TensorTupleOp):
    """(out, lse): out = softmax(s) v and lse_i = log Σ_j exp(s_ij), s = scale q kᵀ (causal: s_ij = -inf for
    j > i + T_k - T_q), one tile of s at a time;  d/dq, d/dk, d/dv: ScaledDotProductAttentionGrad (tiles recomputed)

    Inputs q (B, H, T_q, D), k (B, H, T_k, D), v (B, H, T_k, D_v) of one floating dtype; outputs out (B, H, T_q, D_v)
    in that dtype and lse (B, H, T_q) in float32. `dropout_p` > 0 multiplies the probabilities by keep / (1 - p),
    keep a hash of (seed, position) (src/README.md): the same mask in the forward pass, in its recomputation and in
    the gradient, with nothing stored.
    """

    saves = "both"  # the gradient reads q, k, v and both outputs (out for delta, lse for the probabilities)
    compressible_outputs = (0,)  # out only through delta_i = dout_i · out_i, and the rest is linear in delta
    saveable = True  # recomputing it is two matmuls' worth of work: the "selective" policy keeps it
    compacts_inputs = True  # strided q, k, v (the heads of a projection) are copied compact
    autocast = "low"  # as a matmul: 16-bit storage under autocast, float32 accumulation inside the kernel

    def __init__(self, causal=False, scale=None, dropout_p=0.0, seed=0):
        self.causal, self.scale, self.dropout_p, self.seed = bool(causal), scale, float(dropout_p), int(seed)

    def infer_dtype(self, q, k, v):
        return q if str(q) == "float32" else (q, "float32")  # lse is float32 whatever the storage (specs.spec_of)

    def infer_shape(self, q, k, v):
        if not _fits(q, k, v, self.causal):
            return None  # compute raises the error
        return q[:-1] + (v[-1],), q[:-1]

    def workspace(self, *shapes):
        return 0  # only its outputs (the compact copies of strided inputs are counted by compacts_inputs)

    def compute(self, q, k, v):
        _check_shapes(type(self).__name__, q.shape, k.shape, v.shape, self.causal)
        return array_api.attention_forward(q, k, v, _scale(self.scale, q.shape), self.causal, self.dropout_p,
                                           self.seed)

    def gradient(self, out_grad, node):
        q, k, v = node.inputs
        grads = ScaledDotProductAttentionGrad(self.causal, self.scale, self.dropout_p, self.seed)(
            q, k, v, tuple_get_item(node, 0), tuple_get_item(node, 1), out_grad[0], out_grad[1])
        return tuple(tuple_get_item(grads, i) for i in range(3))


def scaled_dot_product_attention(q, k, v, causal=False, scale=None, dropout_p=0.0, seed=None):
    """softmax(scale · q kᵀ + causal mask) v on (B, H, T, D) tensors, fused: the T_q × T_k scores never exist whole.

    The trade-off: unfused attention (nn.MultiHeadAttention) materializes the scores and the probabilities, B·H·T_q·T_k
    each, and keeps them (and, in training, a dropout mask of that size) for backward; at long sequences they are
    most of a Transformer's activation memory. Here the forward pass computes them a tile at a time and keeps only
    the output and one float32 log-sum-exp per query row; the gradient recomputes each tile's probabilities from it
    (FlashAttention-2). The price is that recomputation (about one more q kᵀ product in backward); the numbers are
    the unfused ones up to float32 rounding. Probabilities are not available: use nn.MultiHeadAttention for those.

    q (B, H, T_q, D), k (B, H, T_k, D), v (B, H, T_k, D_v): one floating dtype (float32, float16, bfloat16; float64
    under NEEDLE_BACKEND=np), arithmetic in float32 (float64 for float64). Returns (B, H, T_q, D_v).
    causal: query i sees keys j <= i + T_k - T_q (the last query aligned with the last key, as MultiHeadAttention's
    mask and PyTorch's causal_lower_right); it needs T_q <= T_k. scale: None is 1 / sqrt(D).
    dropout_p: drop each probability with probability p and scale the rest by 1 / (1 - p); the mask is a hash of
    (seed, position), regenerated in backward, never stored. seed None draws one from NumPy's global RNG (only when
    dropout_p > 0), so np.random.seed reproduces it. Differentiable once in q, k and v.

        q, k, v = (ndl.Tensor(np.random.randn(2, 4, 100, 16)) for _ in range(3))
        out = ndl.ops.scaled_dot_product_attention(q, k, v, causal=True)
        out.sum().backward()  # q.grad, k.grad, v.grad: as nn.MultiHeadAttention(causal=True) gives them
    """
    name = "scaled_dot_product_attention"
    for x, what in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: {what} must be a Tensor, got {type(x).__name__}")
    _check_shapes(name, tuple(q.shape), tuple(k.shape), tuple(v.shape), causal)
    if autograd.active_autocast() is None and len({str(q.dtype), str(k.dtype), str(v.dtype)}) != 1:
        raise TypeError(f"{name}: q, k, v need one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float, numpy.number))
                              or not math.isfinite(scale)):
        raise ValueError(f"{name}: scale must be a finite number or None (1 / sqrt(D)), got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float, numpy.number)) \
            or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{name}: dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if dropout_p == 0:
        seed = 0
    elif seed is None:
        seed = int(numpy.random.randint(0, 2**32, dtype=numpy.uint64))
    scale = None if scale is None else float(scale)
    return tuple_get_item(ScaledDotProductAttention(causal, scale, dropout_p, seed)(q, k, v), 0)


class ScaledDotProductAttentionGrad(TensorTupleOp):
    """(dq, dk, dv): δ_i = dout_i · out_i - dlse_i; per key tile, for each query tile that sees it: p = exp(s - lse),
    dv += (p z)ᵀ dout, ds = p ((dout vᵀ) z - δ) scale, dq += ds k, dk += dsᵀ q  (z: the dropout factor, else 1)

    Inputs (q, k, v, out, lse, dout, dlse); outputs of q's, k's and v's shapes and dtype.
    """

    saves = "inputs"
    compacts_inputs = True  # strided inputs (q, k, v, dout; dlse, a broadcast zero when lse is unused) are copied

    def __init__(self, causal=False, scale=None, dropout_p=0.0, seed=0):
        self.causal, self.scale, self.dropout_p, self.seed = causal, scale, dropout_p, seed

    def infer_shape(self, q, k, v, *rest):
        return (q, k, v) if _fits(q, k, v, self.causal) else None

    def workspace(self, q, *shapes):
        return math.prod(q[:-1])  # delta, one float32 per query row

    def workspace_16bit(self, q, *shapes):
        # the ledger counts 16-bit elements: float32 delta takes two a row, and dlse (the broadcast zero of an unused
        # lse, whose 16-bit compact copy the ledger counts) is copied into float32 instead: one more a row
        return 2 * math.prod(q[:-1])

    def compute(self, q, k, v, out, lse, dout, dlse):
        _check_shapes(type(self).__name__, q.shape, k.shape, v.shape, self.causal)
        return array_api.attention_backward(q, k, v, out, lse, dout, dlse, _scale(self.scale, q.shape), self.causal,
                                            self.dropout_p, self.seed)

    def gradient(self, out_grad, node):
        raise NotImplementedError(
            "ScaledDotProductAttentionGrad: second derivatives of scaled_dot_product_attention are not implemented; "
            "to differentiate twice, use the unfused nn.MultiHeadAttention")


# ----- checks ------------------------------------------------------------------------------------------------
def _scale(scale, q_shape):
    return 1.0 / math.sqrt(q_shape[-1]) if scale is None else scale


def _fits(q, k, v, causal):
    return (len(q) == len(k) == len(v) == 4 and q[:2] == k[:2] == v[:2] and q[3] == k[3] and k[2] == v[2]
            and min(q[2], k[2], q[3], v[3]) >= 1 and not (causal and q[2] > k[2]))


def _check_shapes(name, q, k, v, causal):
    q, k, v = tuple(q), tuple(k), tuple(v)
    if causal and len(q) == len(k) == 4 and q[2] > k[2] >= 1:
        raise ValueError(f"{name}: causal attention with more queries than keys (T_q={q[2]} > T_k={k[2]}) leaves "
                         f"the first {q[2] - k[2]} queries without a key to attend to; the causal mask aligns the last "
                         f"query with the last key (query i sees keys j <= i + T_k - T_q), so it needs T_q <= T_k")
    if not _fits(q, k, v, causal):
        raise ValueError(f"{name}: needs q (B, H, T_q, D), k (B, H, T_k, D), v (B, H, T_k, D_v) with T_q, T_k, D, "
                         f"D_v >= 1; got q {q}, k {k}, v {v}")
