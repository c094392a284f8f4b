"""The `NEEDLE_BACKEND=np` backend: values are plain `numpy.ndarray`, as in the course's early homeworks.

It exposes the same functional API as `needle.backend_ndarray.array_api` (what ops call), implemented with NumPy;
dtypes follow NumPy, so float64 input stays float64.
"""
import math

import ml_dtypes  # noqa: F401  (registers "bfloat16" with NumPy)
import numpy as np

from .backend_ndarray import ndarray_backend_numpy as ref  # the reference backend: its bits are the contract

__all__ = [
    "Device", "activation", "activation_grad", "adam8bit_step", "add_matmul", "adam_step", "all_devices", "array",
    "astype",
    "attention_backward", "attention_forward", "broadcast_to", "cast_like", "copy", "copies_async", "copy_thread",
    "copy_to_host", "cpu",
    "cpu_numpy", "cuda", "default_device", "dequantize_blockwise", "device_of", "dropout", "empty", "exp", "flip",
    "from_host_async", "full", "host_empty", "layer_norm", "layer_norm_backward", "log", "logsumexp", "matmul",
    "max", "maximum", "pack_codes", "quantize_stochastic", "dequantize_linear", "pad", "promote_types",
    "quantize_blockwise", "reshape", "round_stochastic", "scatter_add_rows", "scatter_along_rows", "sgd_step",
    "softmax_xent_grad", "split", "stack", "sum", "take_along_rows", "take_rows", "tanh", "tensor_data", "to_host",
    "to_numpy", "transpose", "unpack_scale", "wait_for_copies", "zeros",
]


def tensor_data(a, dtype=None, device=None):
    """The array a Tensor stores for `a`: a copy, in `dtype` if given (else NumPy's: float64 stays float64)."""
    return np.array(a, dtype=dtype)


def to_numpy(a):
    return a  # the value itself: course code perturbs it in place for finite differences


def cast_like(a, like):
    """`a` in the dtype of `like` (arithmetic with Python floats may have promoted it)."""
    return a.astype(like.dtype, copy=False)


def astype(a, dtype):
    return a.astype(dtype)


def round_stochastic(a, seed, offset=0):
    """float32 -> bfloat16 with stochastic rounding (the reference backend's bits; see src/README.md)."""
    return ref.stochastic_bfloat16(a, seed, offset).reshape(a.shape)


def quantize_blockwise(a, code, block_size):
    """Block-wise 8-bit quantization of float32 `a` (the reference backend's bytes; see src/README.md):
    (uint8 q of a's shape, float32 absmax of shape (ceil(a.size / block_size),))."""
    a, code = np.asarray(a), np.asarray(code)
    ref.num_blocks("quantize_blockwise", a.size, block_size)
    ref.check_blockwise("quantize_blockwise", [("a", a, "float32", a.size), ("code", code, "float32", 256)])
    q, absmax = ref.quantize_blocks(a, code, block_size)
    return q.reshape(a.shape), absmax


def dequantize_blockwise(q, absmax, code, block_size):
    """The inverse: float32 code[q] * absmax of each element's block, of q's shape."""
    q, absmax, code = np.asarray(q), np.asarray(absmax), np.asarray(code)
    blocks = ref.num_blocks("dequantize_blockwise", q.size, block_size)
    ref.check_blockwise("dequantize_blockwise", [("q", q, "uint8", q.size), ("absmax", absmax, "float32", blocks),
                                                 ("code", code, "float32", 256)])
    return ref.dequantize_blocks(q, code, absmax.reshape(-1), block_size).reshape(q.shape)


def _fused(fn, update, theta, grad, state, *hyper, out=None):
    """A fused optimizer step (the reference backend's bytes): its new arrays, or written into `out`."""
    named = [("theta", theta), ("grad", grad)] + [(k, a) for k, a in state.items() if a is not None]
    ref.check_blockwise(fn, [(name, a, "float32", theta.size) for name, a in named])
    new = update(np.asarray(theta), np.asarray(grad), *state.values(), *hyper)
    for array, value in zip(out or (), new):
        array[...] = value
    return out or new


def sgd_step(theta, grad, u, lr, momentum, weight_decay=0.0, out=None):
    """SGD's update (src/README.md): the new (theta, u), u None on the first step and without momentum."""
    new = _fused("sgd_step", ref.sgd_update, theta, grad, {"u": u}, lr, momentum, weight_decay,
                 out=out and out[:1 + bool(momentum)])
    return new[0], new[1] if momentum else None


def adam_step(theta, grad, m, v, lr, beta1, beta2, eps, correction1, correction2, weight_decay=0.0, out=None,
              rounding_seed=None):
    """Adam's update (src/README.md): the new (theta, m, v), m and v None on the first step. A bfloat16 theta is
    updated in place (out=(theta, m, v)), widened and rounded back as the reference backend does."""
    if str(theta.dtype) != "bfloat16":
        return _fused("adam_step", ref.adam_update, theta, grad, {"m": m, "v": v}, lr, beta1, beta2, eps,
                      correction1, correction2, weight_decay, out=out)
    if out is None or out[0] is not theta:
        raise ValueError("adam_step: a bfloat16 theta is updated in place: pass out=(theta, m, v)")
    f32 = [None if a is None else np.asarray(a, np.float32) for a in (theta, grad, m, v)]
    new, new_m, new_v = ref.adam_update(*f32, lr, beta1, beta2, eps, correction1, correction2, weight_decay)
    _round_into(out[0], new, rounding_seed)
    out[1][...], out[2][...] = new_m.astype(out[1].dtype), new_v.astype(out[2].dtype)
    return out


def _round_into(theta, new, seed):
    """float32 `new` into a bfloat16 theta: to nearest, or with `seed` as round_stochastic rounds it."""
    rounded = new.astype(theta.dtype) if seed is None else ref.stochastic_bfloat16(new, seed)
    theta[...] = rounded.reshape(theta.shape)


def copy(a):
    """A C-contiguous copy of `a`."""
    return np.array(a, order="C")


def add_matmul(out, a, b):
    """out += a @ b in place; returns out."""
    out += a @ b
    return out


def adam8bit_step(theta, grad, m_state, v_state, code_m, code_v, block_size, lr, beta1, beta2, eps, correction1,
                  correction2, weight_decay=0.0, out=None, rounding_seed=None):
    """One fused 8-bit Adam step (the reference backend's bytes; see src/README.md): the new float32 theta;
    m_state = (q_m, absmax_m) and v_state = (q_v, absmax_v) are updated in place. A bfloat16 theta is updated in
    place (out=theta), widened and rounded back as the reference backend does."""
    (q_m, absmax_m), (q_v, absmax_v) = m_state, v_state
    low = str(theta.dtype) == "bfloat16"
    if low and out is not theta:
        raise ValueError("adam8bit_step: a bfloat16 theta is updated in place: pass out=theta")
    rounded_theta = theta
    if low:  # widened (a float32 grad as it is): the checks below see float32
        theta, grad = np.asarray(theta, np.float32), np.asarray(grad, np.float32) if grad.dtype == theta.dtype else grad
    n = theta.size
    blocks = ref.num_blocks("adam8bit_step", n, block_size)
    ref.check_blockwise("adam8bit_step", [
        ("theta", theta, "float32", n), ("grad", grad, "float32", n), ("q_m", q_m, "uint8", n),
        ("absmax_m", absmax_m, "float32", blocks), ("q_v", q_v, "uint8", n), ("absmax_v", absmax_v, "float32", blocks),
        ("code_m", code_m, "float32", 256), ("code_v", code_v, "float32", 256)])
    new_theta, *state = ref.adam8bit_blocks(np.asarray(theta), np.asarray(grad), q_m.reshape(-1), absmax_m,
                                            q_v.reshape(-1), absmax_v, np.asarray(code_m), np.asarray(code_v),
                                            block_size, lr, beta1, beta2, eps, correction1, correction2,
                                            weight_decay)
    for stored, new in zip((q_m, absmax_m, q_v, absmax_v), state):
        stored[...] = new.reshape(stored.shape)
    if low:
        _round_into(rounded_theta, new_theta, rounding_seed)
        return rounded_theta
    if out is None:
        return new_theta.reshape(theta.shape)
    out[...] = new_theta.reshape(out.shape)
    return out


def to_host(a, out=None):
    """A host copy for offloading (NumPy arrays are host memory already: a copy, `out` unused)."""
    return np.array(a)


def activation(a, kind):
    """f(a) for f in "gelu", "gelu_tanh", "silu", rounded once to a's dtype (the reference backend's math)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return ref.activation_values(kind, a).astype(a.dtype)


def activation_grad(a, grad, kind):
    """grad * f'(a), rounded once to a's dtype."""
    return (ref.activation_derivative(kind, a) * np.asarray(grad, dtype=np.float64)).astype(a.dtype)


def pack_codes(a, boundaries, bits):
    """The packed `bits`-bit codes of a's elements (the reference backend's bytes; src/README.md)."""
    a, boundaries = np.asarray(a), np.asarray(boundaries, dtype=np.float32)
    bits = ref.check_bits("pack_codes", bits)
    ref.check_blockwise("pack_codes", [("boundaries", boundaries, "float32", 2**bits - 1)])
    x = a.astype(np.float32).reshape(-1)
    return ref.pack_code_values((boundaries[None, :] <= x[:, None]).sum(axis=1), bits)


def unpack_scale(codes, levels, g, bits):
    """g * levels[code] element-wise, rounded once to g's dtype."""
    bits = ref.check_bits("unpack_scale", bits)
    g = np.asarray(g)
    unpacked = ref.unpack_code_values(np.asarray(codes), g.size, bits).reshape(g.shape)
    return (g.astype(np.float32) * np.asarray(levels, dtype=np.float32)[unpacked]).astype(g.dtype)


def quantize_stochastic(a, bits, block_size, seed):
    """(packed k-bit codes, float32 scales): the reference backend's bytes (src/README.md)."""
    a = np.asarray(a)
    bits = ref.check_compress_bits("quantize_stochastic", bits)
    if a.dtype != np.float32:
        raise TypeError(f"quantize_stochastic: needs a float32 array, got {a.dtype}")
    codes, scales = ref.stochastic_codes(a, seed, bits, block_size)
    return ref.pack_code_values(codes, bits), scales


def dequantize_linear(codes, scales, shape, bits, block_size):
    """float32 (code - h) * scale, of `shape`."""
    bits = ref.check_compress_bits("dequantize_linear", bits)
    n = math.prod(shape)
    c = ref.unpack_code_values(np.asarray(codes), n, bits).astype(np.float32)
    half = np.float32(2 ** (bits - 1) - 1)
    with np.errstate(invalid="ignore"):
        return ((c - half) * np.repeat(np.asarray(scales, np.float32), block_size)[:n]).reshape(shape)


def copies_async(device=None):
    """NumPy copies are synchronous: nothing runs beside them."""
    return False


def copy_thread(device=None):
    """No copy thread: the NumPy backend's copies are plain synchronous ones."""
    return None


def host_empty(nbytes, device=None):
    return np.empty(nbytes, dtype=np.uint8)


def copy_to_host(a, out):
    """Copy `a` into the host array `out` (its shape and dtype) and return it."""
    out[...] = a
    return out


def from_host_async(host, device=None):
    """(a copy of `host`, ready): the copy is done, `ready` does nothing."""
    return np.array(host), lambda: None


def wait_for_copies(device=None):
    """Nothing to wait for: NumPy copies are synchronous."""


def layer_norm(x, w, b, eps):
    """Fused layer norm over the last axis (the reference backend's arithmetic; see src/README.md)."""
    x, w, b = np.asarray(x), np.asarray(w), np.asarray(b)
    n = x.shape[-1] if x.ndim else 0
    if n < 1 or w.shape != (n,) or b.shape != (n,):
        raise ValueError(f"layer_norm: needs x (..., n) with n >= 1, w and b (n,), got {x.shape}, {w.shape}, {b.shape}")
    t = _layer_norm_dtype(x, w, b)
    y = ref.layernorm_rows_forward(x.reshape(-1, n).astype(t), w.astype(t), b.astype(t), eps)
    return y.astype(x.dtype).reshape(x.shape)


def _layer_norm_dtype(*arrays):
    """float64 when an operand is float64 (it computes in the dtype it claims), else the contract's float32."""
    return np.float64 if any(a.dtype == np.float64 for a in arrays) else np.float32


def layer_norm_backward(x, w, g, eps):
    """(dx, dw, db) of layer_norm for the output gradient g."""
    x, w, g = np.asarray(x), np.asarray(w), np.asarray(g)
    n, t = x.shape[-1], _layer_norm_dtype(x, w, g)
    dx, dw, db = ref.layernorm_rows_backward(x.reshape(-1, n).astype(t), w.astype(t), g.reshape(-1, n).astype(t), eps)
    return dx.astype(x.dtype).reshape(x.shape), dw.astype(w.dtype), db.astype(w.dtype)


def promote_types(a, b):
    """NumPy's promotion, except that float16 with bfloat16 (which NumPy cannot promote) is float32."""
    if a == b:
        return a
    try:
        return np.promote_types(a, b)
    except TypeError:
        return np.dtype(np.float32)


def device_of(array):
    """The device a value lives on: a numpy.ndarray always lives on cpu()."""
    return cpu()


class Device:
    """A NumPy 'device': data lives in numpy.ndarray; `enabled()` says whether this device exists here."""

    def __init__(self, name, enabled=True):
        self.name = name
        self._enabled = enabled

    def __repr__(self):
        return self.name + "()"

    def __eq__(self, other):
        return isinstance(other, Device) and self.name == other.name

    def __hash__(self):
        return hash(self.name)

    def enabled(self):
        return self._enabled

    def randn(self, *shape, dtype="float32"):
        return np.random.randn(*shape).astype(dtype)

    def rand(self, *shape, dtype="float32"):
        return np.random.rand(*shape).astype(dtype)

    def one_hot(self, n, i, dtype="float32"):
        return np.eye(n, dtype=dtype)[np.asarray(i, dtype=np.int64)]

    def empty(self, shape, dtype="float32"):
        return np.empty(shape, dtype=dtype)

    def full(self, shape, fill_value, dtype="float32"):
        return np.full(shape, fill_value, dtype=dtype)


_CPU = Device("cpu")


def cpu():
    return _CPU


def cpu_numpy():
    return _CPU


def cuda():
    return Device("cuda", enabled=False)


def default_device():
    return _CPU


def all_devices():
    return [_CPU]


def array(a, dtype=None, device=None):
    return np.array(a, dtype=dtype)


def empty(shape, dtype="float32", device=None):
    return np.empty(shape, dtype=dtype)


def full(shape, fill_value, dtype="float32", device=None):
    return np.full(shape, fill_value, dtype=dtype)


def zeros(shape, dtype="float32", device=None):
    return np.zeros(shape, dtype=dtype)


broadcast_to = np.broadcast_to
transpose = np.transpose
maximum = np.maximum
log = np.log
exp = np.exp
tanh = np.tanh
matmul = np.matmul
sum = np.sum
max = np.max
flip = np.flip
pad = np.pad
stack = np.stack


def reshape(a, new_shape):
    return np.reshape(a, new_shape)


def split(a, axis=0):
    return tuple(np.take(a, i, axis=axis) for i in range(a.shape[axis]))


def take_rows(table, ids):
    rows = np.asarray(ids).astype(np.int64)
    if rows.size and (rows.min() < 0 or rows.max() >= table.shape[0]):
        raise IndexError(f"index {rows[(rows < 0) | (rows >= table.shape[0])][0]} is out of range for "
                         f"{table.shape[0]} rows")
    return table[rows]


def scatter_add_rows(rows, ids, num_rows):
    out = np.zeros((num_rows,) + rows.shape[1:], dtype=rows.dtype)
    np.add.at(out, np.asarray(ids).astype(np.int64), rows)
    return out


def take_along_rows(table, ids):
    cols = np.asarray(ids).astype(np.int64)
    if cols.size and (cols.min() < 0 or cols.max() >= table.shape[1]):
        raise IndexError(f"index {cols[(cols < 0) | (cols >= table.shape[1])][0]} is out of range for "
                         f"{table.shape[1]} columns")
    return table[np.arange(table.shape[0]), cols]


def scatter_along_rows(values, ids, num_cols):
    out = np.zeros((values.shape[0], num_cols), dtype=values.dtype)
    out[np.arange(values.shape[0]), np.asarray(ids).astype(np.int64)] += values
    return out


def logsumexp(a, axis=None, keepdims=False):
    """m + log Σ exp(a - m) over the axes, m the maximum; where m is not finite, m."""
    m = np.max(a, axis=axis, keepdims=True)
    shift = np.where(np.isfinite(m), m, 0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        out = np.where(np.isfinite(m), shift + np.log(np.sum(np.exp(a - shift), axis=axis, keepdims=True)), m)
    return out if keepdims else np.squeeze(out, axis=axis)


def _attention_dtype(fn, q, k, v):
    """The dtype attention computes in: float64 stays float64, every other float computes in float32."""
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise TypeError(f"{fn}: q, k, v need one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return np.float64 if q.dtype == np.float64 else np.float32


def dropout(a, p, seed):
    """a · m / (1 - p) with the reference backend's counter-based mask for (seed, flat index), in a's dtype."""
    if not 0 <= p < 1:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")
    a = np.asarray(a)
    keep = ref.dropout_keep(seed, np.arange(a.size), np.zeros(1, np.int64), 1, ref.dropout_threshold(p))
    return a * keep.reshape(a.shape).astype(a.dtype) / a.dtype.type(1 - p)


def attention_forward(q, k, v, scale, causal=False, dropout_p=0.0, seed=0):
    """(out, lse): the reference backend's tiled FlashAttention forward on (..., T, D) arrays (see src/README.md)."""
    acc = _attention_dtype("attention_forward", q, k, v)
    batch, (t_q, d), (t_k, d_v) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    ref.check_attention("attention_forward", (int(np.prod(batch)), t_q, t_k, d, d_v), causal, dropout_p, [], [])
    q3, k3, v3 = (np.asarray(a, dtype=acc).reshape((-1,) + a.shape[-2:]) for a in (q, k, v))
    out, lse = ref.attention_tiles_forward(q3, k3, v3, scale, causal, (dropout_p, seed) if dropout_p > 0 else None)
    return out.reshape(batch + (t_q, d_v)).astype(q.dtype, copy=False), lse.reshape(batch + (t_q,))


def attention_backward(q, k, v, out, lse, dout, dlse, scale, causal=False, dropout_p=0.0, seed=0):
    """(dq, dk, dv) of attention_forward, its probabilities recomputed tile by tile (FlashAttention-2)."""
    acc = _attention_dtype("attention_backward", q, k, v)
    batch, (t_q, d), (t_k, d_v) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    ref.check_attention("attention_backward", (int(np.prod(batch)), t_q, t_k, d, d_v), causal, dropout_p, [], [])
    arrays = [np.asarray(np.broadcast_to(a, a.shape), dtype=acc) for a in (q, k, v, out, lse, dout, dlse)]
    q3, k3, v3, o3, g3 = (a.reshape((-1,) + a.shape[-2:]) for a in arrays[:4] + arrays[5:6])
    lse2, dlse2 = (a.reshape(-1, t_q) for a in (arrays[4], arrays[6]))
    dq, dk, dv, _ = ref.attention_tiles_backward(q3, k3, v3, o3, lse2, g3, dlse2, scale, causal,
                                                 (dropout_p, seed) if dropout_p > 0 else None)
    return tuple(g.reshape(a.shape).astype(a.dtype, copy=False) for g, a in zip((dq, dk, dv), (q, k, v)))


def softmax_xent_grad(logits, ids, g):
    take_along_rows(logits, ids)  # raises IndexError for an id outside [0, c)
    with np.errstate(invalid="ignore"):  # a row of -inf: NaN, as on the other backends
        out = np.exp(logits - logsumexp(logits, axis=1, keepdims=True)) * g[:, None]
    out[np.arange(logits.shape[0]), np.asarray(ids).astype(np.int64)] -= g
    return out
