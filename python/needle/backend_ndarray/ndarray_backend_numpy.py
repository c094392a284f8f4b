"""The reference backend: the backend contract (src/README.md) written in NumPy.

It is both an executable specification for the C++ and CUDA modules and the `cpu_numpy()` device. Buffers are
flat float32 numpy arrays; every function receives the (shape, strides, offset) of a view in elements.
"""
import weakref

import numpy as np

__device_name__ = "cpu_numpy"
__tile_size__ = 1

_ITEMSIZE = 4
_stats = {"current_bytes": 0, "peak_bytes": 0, "allocations": 0}
_limit = [0]


def _release(nbytes):
    _stats["current_bytes"] -= nbytes
    _stats["allocations"] -= 1


class Array:
    """A flat float32 buffer whose bytes are counted from construction until it is garbage collected."""

    def __init__(self, size):
        nbytes = int(size) * _ITEMSIZE
        held = _stats["current_bytes"]
        if _limit[0] and held + nbytes > _limit[0]:
            raise MemoryError(
                f"needle cpu_numpy: cannot allocate {nbytes} bytes: {held} bytes held, limit {_limit[0]} bytes"
            )
        self.array = np.empty(int(size), dtype=np.float32)
        _stats["current_bytes"] = held + nbytes
        _stats["allocations"] += 1
        _stats["peak_bytes"] = max(_stats["peak_bytes"], _stats["current_bytes"])
        weakref.finalize(self, _release, nbytes)

    @property
    def size(self):
        return self.array.size

    def ptr(self):
        return self.array.ctypes.data


def memory_stats():
    return dict(_stats)


def reset_peak_memory_stats():
    _stats["peak_bytes"] = _stats["current_bytes"]


def set_memory_limit(nbytes):
    _limit[0] = int(nbytes)


def _view(a, shape, strides, offset):
    return np.lib.stride_tricks.as_strided(
        a.array[offset:], tuple(shape), tuple(s * _ITEMSIZE for s in strides), writeable=True
    )


def to_numpy(a, shape, strides, offset):
    return _view(a, shape, strides, offset).copy()


def from_numpy(a, out):
    out.array[:] = a.flatten()


def fill(out, val):
    out.array.fill(val)


def compact(a, out, shape, strides, offset):
    out.array[:] = _view(a, shape, strides, offset).flatten()


def ewise_setitem(a, out, shape, strides, offset):
    _view(out, shape, strides, offset)[...] = a.array.reshape(shape)


def scalar_setitem(size, val, out, shape, strides, offset):
    _view(out, shape, strides, offset)[...] = val


def ewise_add(a, b, out):
    out.array[:] = a.array + b.array


def scalar_add(a, val, out):
    out.array[:] = a.array + val


def ewise_mul(a, b, out):
    out.array[:] = a.array * b.array


def scalar_mul(a, val, out):
    out.array[:] = a.array * val


def ewise_div(a, b, out):
    out.array[:] = a.array / b.array


def scalar_div(a, val, out):
    out.array[:] = a.array / val


def ewise_power(a, b, out):
    out.array[:] = a.array**b.array


def scalar_power(a, val, out):
    out.array[:] = a.array**val


def ewise_maximum(a, b, out):
    out.array[:] = np.maximum(a.array, b.array)


def scalar_maximum(a, val, out):
    out.array[:] = np.maximum(a.array, val)


def ewise_eq(a, b, out):
    out.array[:] = a.array == b.array


def scalar_eq(a, val, out):
    out.array[:] = a.array == val


def ewise_ge(a, b, out):
    out.array[:] = a.array >= b.array


def scalar_ge(a, val, out):
    out.array[:] = a.array >= val


def ewise_gt(a, b, out):
    out.array[:] = a.array > b.array


def scalar_gt(a, val, out):
    out.array[:] = a.array > val


# ----- element-wise on strided views: out (compact, `shape`) = op(views), nothing materialized ------------------
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "power": np.power,
           "maximum": np.maximum, "eq": np.equal, "ge": np.greater_equal,
           "gt": np.greater}
_UNARY = {"log": np.log, "exp": np.exp, "tanh": np.tanh}


def _op(table, op, fn):
    if op not in table:
        raise ValueError(f"{fn}: unknown op {op!r} (expected {', '.join(table)})")
    return table[op]


def _out_view(fn, out, shape, *inputs):
    if out.size != int(np.prod(shape)):
        raise ValueError(f"{fn}: out has {out.size} elements, expected {int(np.prod(shape))}")
    if any(out is a for a in inputs):
        raise ValueError(f"{fn}: out must not be one of the inputs")
    return out.array.reshape(shape)


def ewise_strided(op, a, a_strides, a_offset, b, b_strides, b_offset, out, shape):
    func = _op(_BINARY, op, "ewise_strided")
    func(_view(a, shape, a_strides, a_offset), _view(b, shape, b_strides, b_offset),
         out=_out_view("ewise_strided", out, shape, a, b))


def scalar_strided(op, a, strides, offset, val, out, shape):
    func = _op(_BINARY, op, "scalar_strided")
    func(_view(a, shape, strides, offset), np.float32(val), out=_out_view("scalar_strided", out, shape, a))


def unary_strided(op, a, strides, offset, out, shape):
    func = _op(_UNARY, op, "unary_strided")
    func(_view(a, shape, strides, offset), out=_out_view("unary_strided", out, shape, a))


def ewise_log(a, out):
    out.array[:] = np.log(a.array)


def ewise_exp(a, out):
    out.array[:] = np.exp(a.array)


def ewise_tanh(a, out):
    out.array[:] = np.tanh(a.array)


def matmul(a, b, out, m, n, p):
    out.array[:] = (a.array[: m * n].reshape(m, n) @ b.array[: n * p].reshape(n, p)).reshape(-1)


def matmul_batched(a, b, out, batch, m, n, p):
    if out is a or out is b:
        raise ValueError("matmul_batched: out must not be one of the inputs")
    np.matmul(a.array[: batch * m * n].reshape(batch, m, n), b.array[: batch * n * p].reshape(batch, n, p),
              out=out.array[: batch * m * p].reshape(batch, m, p))


def matmul_tiled(a, b, out, m, n, p):
    matmul(a, b, out, m, n, p)


def reduce_max(a, out, reduce_size):
    out.array[:] = a.array[: out.size * reduce_size].reshape(-1, reduce_size).max(axis=1)


def reduce_sum(a, out, reduce_size):
    out.array[:] = a.array[: out.size * reduce_size].reshape(-1, reduce_size).sum(axis=1)


def _logsumexp_rows(rows):
    """m + log Σ exp(row - m) per row; a row whose max m is not finite gives m (as the C++ backend)."""
    m = rows.max(axis=1, keepdims=True)
    shift = np.where(np.isfinite(m), m, 0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        lse = shift + np.log(np.exp(rows - shift).sum(axis=1, keepdims=True))
    return np.where(np.isfinite(m), lse, m)[:, 0]


def reduce_logsumexp(a, out, reduce_size):
    out.array[:] = _logsumexp_rows(a.array[: out.size * reduce_size].reshape(-1, reduce_size))


def _row_indices(idx, num_rows):
    rows = idx.array
    ints = rows.astype(np.int64)
    bad = np.nonzero((ints != rows) | (ints < 0) | (ints >= num_rows))[0]
    if bad.size:
        raise IndexError(f"index {rows[bad[0]]:g} is out of range for {num_rows} rows (or not an integer)")
    return ints


def take_rows(a, idx, out, row_size):
    rows = _row_indices(idx, a.size // row_size)
    out.array[: rows.size * row_size] = a.array.reshape(-1, row_size)[rows].reshape(-1)


def scatter_add_rows(src, idx, out, row_size):
    rows = _row_indices(idx, out.size // row_size)
    table = out.array.reshape(-1, row_size)
    np.add.at(table, rows, src.array[: rows.size * row_size].reshape(-1, row_size))


def take_along_rows(a, idx, out, row_size):
    cols = _row_indices(idx, row_size)
    out.array[: cols.size] = a.array[: cols.size * row_size].reshape(-1, row_size)[np.arange(cols.size), cols]


def scatter_along_rows(src, idx, out, row_size):
    cols = _row_indices(idx, row_size)
    out.array[: cols.size * row_size].reshape(-1, row_size)[np.arange(cols.size), cols] += src.array[: cols.size]


def softmax_xent_grad(a, idx, g, out, row_size):
    if row_size <= 0:
        raise ValueError("softmax_xent_grad: row_size must be positive")
    cols = _row_indices(idx, row_size)
    rows = a.array[: cols.size * row_size].reshape(-1, row_size)
    with np.errstate(invalid="ignore"):  # a row of -inf: NaN, as on the other backends
        grad = np.exp(rows - _logsumexp_rows(rows)[:, None]) * g.array[: cols.size, None]
    grad[np.arange(cols.size), cols] -= g.array[: cols.size]
    out.array[: cols.size * row_size] = grad.reshape(-1)
