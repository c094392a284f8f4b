"""Layer-norm checks run under NEEDLE_BACKEND=np (by np_backend_checks.py, in a fresh interpreter):
float64 in, float64 out, so a central-difference gradient check holds at 1e-6 (it failed with relative error
0.55 while the NumPy face computed float64 inputs in float32)."""
import numpy as np

import needle as ndl
from needle import nn, ops


def float64_checks():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 7))
    w, b, g = rng.standard_normal(7), rng.standard_normal(7), rng.standard_normal((3, 7))

    def loss(x_, w_, b_):
        return float((ops.layer_norm(ndl.Tensor(x_), ndl.Tensor(w_), ndl.Tensor(b_)).numpy() * g).sum())

    X, W, B = ndl.Tensor(x), ndl.Tensor(w), ndl.Tensor(b)
    y = ops.layer_norm(X, W, B)
    assert y.cached_data.dtype == np.float64, y.cached_data.dtype
    (y * ndl.Tensor(g)).sum().backward()
    for tensor, values in ((X, x), (W, w), (B, b)):
        assert tensor.grad.cached_data.dtype == np.float64
        numeric = np.zeros_like(values)
        for i in range(values.size):
            plus, minus = values.copy(), values.copy()
            plus.flat[i] += 1e-6
            minus.flat[i] -= 1e-6
            args = [plus if v is values else v for v in (x, w, b)]
            args_minus = [minus if v is values else v for v in (x, w, b)]
            numeric.flat[i] = (loss(*args) - loss(*args_minus)) / 2e-6
        error = np.abs(tensor.grad.numpy() - numeric).max() / np.abs(numeric).max()
        assert error < 1e-6, f"relative error {error}"
    module = nn.LayerNorm1d(7)  # the course's module, through the fused op, stays float64 too
    module.weight, module.bias = nn.Parameter(w), nn.Parameter(b)
    assert module(ndl.Tensor(x)).cached_data.dtype == np.float64
