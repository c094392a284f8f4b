"""The NumPy reference of Adafactor's passes (src/README.md: adafactor_moments, adafactor_sumsq, adafactor_step),
part of ndarray_backend_numpy: every sum as that backend's reduce_sum and matmul sum what the chunk loop of
toolbox/optim/adafactor.py hands them, so the bytes are that loop's."""
import numpy as np


def _values(a):
    return a.array.astype(np.float32, copy=False)


def _adafactor_chunks(fn, grad, n, cols, k):
    """(first row, rows) of each chunk: up to k whole rows of one of grad's size / (n * cols) matrices (n, cols)."""
    if grad.dtype != "float32":
        raise TypeError(f"{fn}: expects float32 arrays, got grad {grad.dtype}")
    if min(n, cols, k) < 1 or grad.size % (n * cols):
        raise ValueError(f"{fn}: needs n, cols, rows_per_chunk >= 1 and a whole number of (n, cols) matrices")
    size = grad.size
    return [(b * n + r, min(k, n - r)) for b in range(size // (n * cols)) for r in range(0, n, k)]


def _adafactor_u(grad, r, c, v, factored, first, n, cols, beta2, eps1):
    """src/README.md's adafactor_step's u (and the new full V, else None) on flat float32 numpy arrays."""
    f32 = np.float32
    with np.errstate(all="ignore"):
        if factored:
            return (grad.reshape(-1, n, cols) * (r.reshape(-1, n, 1) * c.reshape(-1, 1, cols))).reshape(-1), None
        g2 = grad * grad + f32(eps1)
        v = g2 * f32(1 - beta2) if first else v * f32(beta2) + g2 * f32(1 - beta2)
        return grad * np.power(v, f32(-0.5)), v


def adafactor_moments(grad, row_out, col_out, n, cols, rows_per_chunk, eps1):
    g, col = _values(grad), None
    for row, rows in _adafactor_chunks("adafactor_moments", grad, n, cols, rows_per_chunk):
        g2 = g[row * cols:(row + rows) * cols].reshape(rows, cols) ** 2 + np.float32(eps1)
        row_out.array[row:row + rows] = g2.sum(axis=1, dtype=np.float64).astype(np.float32) / np.float32(cols)
        part = (np.ones((1, rows), np.float32) @ g2)[0]  # as matmul sums the columns
        col = part if row % n == 0 else col + part
        if row % n + rows == n:
            col_out.array[row // n * cols:(row // n + 1) * cols] = col / np.float32(n)


def adafactor_sumsq(grad, r, c, v, sums, factored, first, n, cols, rows_per_chunk, beta2, eps1):
    chunks = _adafactor_chunks("adafactor_sumsq", grad, n, cols, rows_per_chunk)
    u, _ = _adafactor_u(_values(grad), _values(r), _values(c), _values(v), factored, first, n, cols, beta2, eps1)
    sums.array[:] = [(u[row * cols:(row + rows) * cols] ** 2).sum(dtype=np.float64)
                     for row, rows in chunks]


def adafactor_step(theta, grad, r, c, v, m, factored, first_v, first_m, momentum, n, cols, beta2, eps1, scale,
                   beta1, lr, weight_decay):
    f32, _ = np.float32, _adafactor_chunks("adafactor_step", grad, n, cols, 1)
    u, new_v = _adafactor_u(_values(grad), _values(r), _values(c), _values(v), factored, first_v, n, cols, beta2, eps1)
    with np.errstate(all="ignore"):
        u = u * f32(scale)
        if momentum:
            u = u * f32(1 - beta1) if first_m else m.array * f32(beta1) + u * f32(1 - beta1)
            m.array[:] = u
        t = theta.array - theta.array * f32(weight_decay * lr) if weight_decay else theta.array
        theta.array[:] = t - u
    if not factored:
        v.array[:] = new_v
