"""The LM-head cases shared by test_linear_cross_entropy.py and its float64 check (`float64_checks`, which
np_backend_checks.py runs under NEEDLE_BACKEND=np in a fresh interpreter: the backend is read once, at import)."""
import numpy as np

import needle as ndl
from needle import nn, ops
from needle.backend_selection import BACKEND

from conftest import numerical_gradient

# (N tokens, H hidden, V vocabulary, chunk_size, bias shape or None)
CASES = {
    "chunks_divide": (12, 5, 9, 4, (1, 9)),
    "chunks_do_not_divide": (10, 4, 7, 3, (7,)),
    "chunk_none": (10, 3, 6, None, (1, 6)),
    "chunk_of_one_row": (5, 3, 4, 1, None),
    "chunk_larger_than_n": (6, 4, 5, 50, (5,)),
    "one_token": (1, 4, 6, None, (1, 6)),
    "one_token_vocab_1": (1, 3, 1, 1, (1,)),
    "vocab_1": (8, 3, 1, 3, None),
    "no_bias": (9, 6, 11, 2, None),
}


def make_arrays(N, H, V, bias, seed=0, dtype=np.float32):
    rs = np.random.RandomState(seed)
    b = None if bias is None else rs.randn(*bias).astype(dtype)
    return rs.randn(N, H).astype(dtype), rs.randn(H, V).astype(dtype), b, rs.randint(0, V, N).astype(dtype)


def fused_and_unfused(device, N, H, V, chunk, bias, dtype=np.float32):
    """(loss, [grads]) of the fused and of the unfused head on the same inputs."""
    h, W, b, y = make_arrays(N, H, V, bias, dtype=dtype)
    target = ndl.Tensor(y, device=device, requires_grad=False)
    results = []
    for fused in (True, False):
        params = [ndl.Tensor(a, device=device) for a in (h, W, b) if a is not None]
        hidden, weight, b_t = params[0], params[1], (params[2] if b is not None else None)
        if fused:
            loss = ops.linear_cross_entropy(hidden, weight, b_t, target, chunk_size=chunk)
        else:
            logits = hidden @ weight
            if b_t is not None:
                logits = logits + ndl.broadcast_to(ndl.reshape(b_t, (1, V)), (N, V))
            loss = nn.SoftmaxLoss()(logits, target)
        loss.backward()
        results.append((loss.numpy(), [p.grad.numpy() for p in params]))
    return results


def assert_close(got, expected, rtol):
    """Element-wise within rtol of the largest entry (an exactly-zero gradient is matched to rounding)."""
    scale = max(float(np.max(np.abs(e))) if np.size(e) else 0.0 for e in expected) or 1.0
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=rtol, atol=rtol * scale)


def float64_checks():
    """Run under NEEDLE_BACKEND=np only (values are plain float64 numpy.ndarray): the fused head's numbers equal the
    unfused head's within 1e-6, and central differences (eps 1e-6) match the gradient within 1e-6."""
    assert BACKEND == "np", BACKEND
    for name, (N, H, V, chunk, bias) in CASES.items():
        (loss, grads), (ref_loss, ref_grads) = fused_and_unfused(None, N, H, V, chunk, bias, dtype=np.float64)
        assert loss.dtype == np.float64 and all(g.dtype == np.float64 for g in grads), name
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, err_msg=name)
        assert_close(grads, ref_grads, rtol=1e-6)
    # Central differences in float64, eps 1e-6, in a random direction of the (scalar) loss.
    h, W, b, y = make_arrays(7, 3, 5, (5,), seed=2, dtype=np.float64)
    tensors = [ndl.Tensor(a) for a in (h, W, b)]

    def loss_of(*xs):
        return ops.linear_cross_entropy(*xs, ndl.Tensor(y, requires_grad=False), chunk_size=3)

    loss_of(*tensors).backward()
    numeric = numerical_gradient(lambda *xs: float(loss_of(*[ndl.Tensor(x) for x in xs]).numpy()),
                                 [a.copy() for a in (h, W, b)], eps=1e-6)
    for t, g in zip(tensors, numeric):
        assert isinstance(t.grad.realize_cached_data(), np.ndarray) and t.grad.dtype == np.float64
        np.testing.assert_allclose(t.grad.numpy(), g, rtol=1e-6, atol=1e-8)
