"""The attention cases shared by test_attention.py and its float64 check (`float64_checks`, which
np_backend_checks.py runs under NEEDLE_BACKEND=np in a fresh interpreter: the backend is read once, at import)."""
import numpy as np

import needle as ndl
from needle import nn, ops
from needle.backend_selection import BACKEND

from conftest import numerical_gradient

# (B, H, T_q, T_k, D, D_v, causal). Tiles: 32 rows on the NumPy reference, 64 in C++ and CUDA.
CASES = {
    "tile_multiple_causal": (1, 2, 64, 64, 8, 8, True),
    "T_not_a_tile_multiple_causal": (2, 3, 70, 70, 5, 6, True),
    "T_not_a_tile_multiple_full": (2, 1, 130, 130, 4, 4, False),
    "T_q_lt_T_k_causal": (1, 2, 33, 130, 4, 3, True),
    "T_q_gt_T_k_full": (2, 1, 100, 37, 3, 5, False),
    "T_1": (2, 2, 1, 1, 4, 4, True),
    "D_1": (1, 2, 20, 20, 1, 1, False),
    "one_query_many_keys_causal": (1, 1, 1, 90, 4, 3, True),
}


def make_arrays(B, H, T_q, T_k, D, D_v, seed=0, dtype=np.float32):
    rs = np.random.RandomState(seed)
    return [rs.randn(*shape).astype(dtype) for shape in ((B, H, T_q, D), (B, H, T_k, D), (B, H, T_k, D_v),
                                                          (B, H, T_q, D_v))]  # q, k, v and a projection of out


def run_attention(device, arrays, causal, fused, dtype=None, **kw):
    """(out, [dq, dk, dv]) of (out * projection).sum(), fused or through nn.MultiHeadAttention."""
    q, k, v = (ndl.Tensor(a, device=device, dtype=dtype) for a in arrays[:3])
    if fused:
        out = ops.scaled_dot_product_attention(q, k, v, causal=causal, **kw)
    else:
        out, _ = nn.MultiHeadAttention(causal=causal, device=device).eval()(q, k, v)
    (out * ndl.Tensor(arrays[3], device=device, dtype=dtype, requires_grad=False)).sum().backward()
    return out.numpy(), [x.grad.numpy() for x in (q, k, v)]


def assert_close(got, expected, rtol, common_scale=False):
    """Element-wise within rtol of the largest entry of each expected array (of all of them with common_scale:
    for gradients that are zero but for rounding, such as the bias before the key projection's)."""
    largest = max(float(np.max(np.abs(e.astype(np.float64)))) for e in expected)
    for g, e in zip(got, expected):
        scale = (largest if common_scale else float(np.max(np.abs(e.astype(np.float64))))) or 1.0
        np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=rtol * scale)


def float64_checks():
    """Run under NEEDLE_BACKEND=np only (values are plain float64 numpy.ndarray): the fused numbers equal the
    unfused ones within 1e-6, and central differences (eps 1e-6) match the gradient within 1e-6."""
    assert BACKEND == "np", BACKEND
    for name, (B, H, T_q, T_k, D, D_v, causal) in CASES.items():
        arrays = make_arrays(B, H, T_q, T_k, D, D_v, dtype=np.float64)
        out, grads = run_attention(None, arrays, causal, fused=True, dtype="float64")
        ref_out, ref_grads = run_attention(None, arrays, causal, fused=False, dtype="float64")
        assert out.dtype == np.float64 and all(g.dtype == np.float64 for g in grads), name
        assert_close([out] + grads, [ref_out] + ref_grads, rtol=1e-6)
    q, k, v, proj = make_arrays(1, 2, 5, 7, 3, 2, seed=4, dtype=np.float64)
    tensors = [ndl.Tensor(a, dtype="float64") for a in (q, k, v)]

    def loss_of(*xs):
        out = ops.scaled_dot_product_attention(*xs, causal=True, dropout_p=0.25, seed=11)
        return (out * ndl.Tensor(proj, dtype="float64", requires_grad=False)).sum()

    loss_of(*tensors).backward()
    numeric = numerical_gradient(lambda *xs: float(loss_of(*[ndl.Tensor(x, dtype="float64") for x in xs]).numpy()),
                                 [a.copy() for a in (q, k, v)], eps=1e-6)
    for t, g in zip(tensors, numeric):
        assert t.grad.dtype == np.float64
        np.testing.assert_allclose(t.grad.numpy(), g, rtol=1e-6, atol=1e-8)
