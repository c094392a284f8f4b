"""The reference backend: the backend contract (src/README.md) written in NumPy.

It is both an executable specification for the C++ and CUDA modules and the `cpu_numpy()` device. Buffers are
flat numpy arrays of the storage dtype (bfloat16 from ml_dtypes); every function receives the (shape, strides,
offset) of a view in elements. Arithmetic is float32 whatever the storage: operands are read as float32 and the
result is rounded once, when it is assigned into the output buffer.
"""
import math
import operator
import weakref

import ml_dtypes
import numpy as np

from .adafactor_reference import adafactor_moments, adafactor_step, adafactor_sumsq  # noqa: F401 (the contract's)
from .codes_reference import check_bits, code_bytes, pack_code_values, unpack_code_values  # noqa: F401

__device_name__ = "cpu_numpy"
__tile_size__ = 1

DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int32": np.dtype(np.int32),
}
FLOATS = ("float32", "float16", "bfloat16")
_stats = {"current_bytes": 0, "peak_bytes": 0, "allocations": 0}
_limit = [0]


def _release(nbytes):
    _stats["current_bytes"] -= nbytes
    _stats["allocations"] -= 1


class Array:
    """A flat buffer of one dtype whose bytes are counted from construction until it is garbage collected."""

    def __init__(self, size, dtype="float32"):
        if dtype not in DTYPES:
            raise ValueError(f"Array: unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
        self.dtype = dtype
        self.itemsize = DTYPES[dtype].itemsize
        nbytes = int(size) * self.itemsize
        held = _stats["current_bytes"]
        if _limit[0] and held + nbytes > _limit[0]:
            raise MemoryError(
                f"needle cpu_numpy: cannot allocate {nbytes} bytes: {held} bytes held, limit {_limit[0]} bytes"
            )
        self.array = np.empty(int(size), dtype=DTYPES[dtype])
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
        a.array[offset:], tuple(shape), tuple(s * a.itemsize for s in strides), writeable=True
    )


# ----- dtypes: conversion, and the float32 arithmetic rule ------------------------------------------------------
def convert(values, dtype):
    """`values` (a numpy array or a Python number) in `dtype` by the contract's conversion rules.

    Floating values pass through float32 first (a Python float is a float32 on every backend). To a float:
    round to nearest even, overflow to inf. To an integer: drop the fraction, saturate, NaN -> 0."""
    target = DTYPES[dtype]
    values = np.asarray(values)
    if values.dtype.kind in "iub":
        if target.kind in "iu":
            info = np.iinfo(target)
            return np.clip(values.astype(np.int64), info.min, info.max).astype(target)
        values = values.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        values = values.astype(np.float32)
        if target.kind in "iu":
            info = np.iinfo(target)
            wide = np.nan_to_num(values.astype(np.float64), nan=0.0, posinf=info.max, neginf=info.min)
            return np.clip(np.trunc(wide), info.min, info.max).astype(target)
        return values.astype(target)


def _f32(a):
    """The buffer's values as float32, for arithmetic."""
    return a.array.astype(np.float32, copy=False)


def _store(out, values, where=slice(None)):
    """Round float32 results once into out's storage."""
    with np.errstate(over="ignore", invalid="ignore"):
        out.array[where] = np.asarray(values, dtype=np.float32).astype(out.array.dtype)


def _floats(fn, *arrays, out=None):
    """TypeError unless every array (and out) is floating and of one dtype; matmul's out may be float32."""
    dtypes = [a.dtype for a in arrays] + ([] if out is None else [out.dtype])
    if all(d in FLOATS for d in dtypes) and len(set(dtypes)) == 1:
        return
    if out is not None and out.dtype == "float32" and len({a.dtype for a in arrays}) == 1 \
            and arrays[0].dtype in FLOATS and fn.startswith("matmul"):
        return
    raise TypeError(f"{fn}: needs floating arrays of one dtype, got {', '.join(dtypes)}"
                    + ("" if all(d in FLOATS for d in dtypes) else " (integer arrays are storage only)"))


def _float32_only(fn, *arrays):
    if any(a.dtype != "float32" for a in arrays):
        raise TypeError(f"{fn}: float32 only, got {', '.join(a.dtype for a in arrays)}")


def to_numpy(a, shape, strides, offset):
    """A copy of the view; bfloat16 as its uint16 bit patterns (the compiled backends' storage type)."""
    out = _view(a, shape, strides, offset).copy()
    return out.view(np.uint16) if a.dtype == "bfloat16" else out


def from_numpy(a, out):
    a = np.ascontiguousarray(a)
    if a.size != out.size or a.itemsize != out.itemsize:
        raise ValueError(f"from_numpy: got {a.size} elements of {a.itemsize} bytes for a buffer of {out.size} "
                         f"{out.dtype} elements")
    out.array.view(np.uint8)[:] = a.reshape(-1).view(np.uint8)


def fill(out, val):
    out.array.fill(convert(val, out.dtype))


def compact(a, out, shape, strides, offset):
    out.array[:] = convert(_view(a, shape, strides, offset).reshape(-1), out.dtype)


def ewise_setitem(a, out, shape, strides, offset):
    for axis, (n, stride) in enumerate(zip(shape, strides)):
        if stride == 0 and n > 1 and math.prod(shape):  # one element, several values: the last would win
            raise ValueError(f"ewise_setitem: the view of out repeats elements (stride 0 along axis {axis} of {n}): "
                             f"a write through it would keep only one of the values written to each")
    _view(out, shape, strides, offset)[...] = convert(a.array, out.dtype).reshape(shape)


def scalar_setitem(size, val, out, shape, strides, offset):
    _view(out, shape, strides, offset)[...] = convert(val, out.dtype)


def stochastic_bfloat16(values, seed, offset=0):
    """float32 values -> bfloat16, each rounded up with probability equal to the fraction rounding drops: a hash
    of (seed, offset + index) is added to the 16 bits that are cut off (NaN and inf round to nearest)."""
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    index = (np.arange(values.size, dtype=np.uint64) + np.uint64(offset)).astype(np.uint32)  # uint32(offset + i)
    h = index ^ np.uint32((int(seed) * 0x9E3779B9) & 0xFFFFFFFF)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x7FEB352D)
    h ^= h >> np.uint32(15)
    h *= np.uint32(0x846CA68B)
    h ^= h >> np.uint32(16)
    bits = ((values.view(np.uint32) + (h & np.uint32(0xFFFF))) >> np.uint32(16)).astype(np.uint16)
    with np.errstate(invalid="ignore"):  # a signalling NaN converts quietly, as in convert()
        nearest = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    return np.where(np.isfinite(values), bits, nearest).view(ml_dtypes.bfloat16)


def round_stochastic(a, out, seed, offset):
    if a.dtype != "float32" or out.dtype != "bfloat16" or a.size != out.size:
        raise TypeError(f"round_stochastic: needs float32 a and bfloat16 out of one size, got {a.dtype} "
                        f"({a.size}) and {out.dtype} ({out.size})")
    out.array[:] = stochastic_bfloat16(a.array, seed, offset)


# ----- block-wise 8-bit quantization (Dettmers et al. 2021) ------------------------------------------------------
def num_blocks(fn, n, block_size):
    """ceil(n / block_size): how many quantization blocks n elements make (ValueError unless block_size >= 1)."""
    block_size = operator.index(block_size)  # TypeError for a float, as the compiled modules
    if block_size < 1:
        raise ValueError(f"{fn}: block_size must be at least 1, got {block_size}")
    return -(-n // block_size)


def check_blockwise(fn, arrays):
    """`arrays` holds (name, array, dtype, size): TypeError unless every array has its dtype, then ValueError unless
    it has its size. Works for backend buffers and numpy arrays alike (both have .dtype and .size)."""
    if any(a.dtype != dtype for _, a, dtype, _ in arrays):
        raise TypeError(f"{fn}: expects " + ", ".join(f"{dtype} {name}" for name, _, dtype, _ in arrays)
                        + ", got " + ", ".join(f"{name} {a.dtype}" for name, a, _, _ in arrays))
    for name, a, _, size in arrays:
        if a.size != size:
            raise ValueError(f"{fn}: {name} has {a.size} elements, expected {size}")


def quantize_blocks(values, code, block_size):
    """float32 values -> (uint8 indices into code, float32 absmax per block), by the contract's nearest rule."""
    values = values.reshape(-1)
    blocks = np.zeros(num_blocks("quantize_blockwise", values.size, block_size) * block_size, np.float32)
    blocks[: values.size] = values  # the last block padded with zeros, which never change its absmax
    blocks = blocks.reshape(-1, block_size)
    absmax = np.abs(blocks).max(axis=1)  # NaN if the block holds one
    with np.errstate(invalid="ignore"):  # inf / inf is NaN, which goes to index 0 like every NaN
        x = np.divide(blocks, absmax[:, None], out=np.zeros_like(blocks), where=absmax[:, None] != 0)
    lo = np.maximum(np.searchsorted(code, x, side="right") - 1, 0)  # the largest j with code[j] <= x, else 0
    lo[np.isnan(x)] = 0  # (searchsorted sorts NaN last)
    hi = np.minimum(lo + 1, code.size - 1)
    q = np.where(code[hi] - x < x - code[lo], hi, lo)  # float32 subtractions; a tie goes to lo
    return q.reshape(-1)[: values.size].astype(np.uint8), absmax


def dequantize_blocks(q, code, absmax, block_size):
    """uint8 indices -> float32 code[q[i]] * absmax[i // block_size]."""
    q = q.reshape(-1)
    with np.errstate(invalid="ignore"):  # code 0 times an inf absmax is NaN
        return code[q] * np.repeat(absmax, block_size)[: q.size]


def quantize_blockwise(a, code, out, absmax, block_size):
    blocks = num_blocks("quantize_blockwise", a.size, block_size)
    check_blockwise("quantize_blockwise", [("a", a, "float32", a.size), ("code", code, "float32", 256),
                                           ("out", out, "uint8", a.size), ("absmax", absmax, "float32", blocks)])
    out.array[:], absmax.array[:] = quantize_blocks(a.array, code.array, block_size)


def dequantize_blockwise(q, code, absmax, out, block_size):
    blocks = num_blocks("dequantize_blockwise", q.size, block_size)
    check_blockwise("dequantize_blockwise", [("q", q, "uint8", q.size), ("code", code, "float32", 256),
                                             ("absmax", absmax, "float32", blocks), ("out", out, "float32", q.size)])
    out.array[:] = dequantize_blocks(q.array, code.array, absmax.array, block_size)


def sgd_update(theta, grad, u, lr, momentum, weight_decay):
    """src/README.md's sgd_step on flat float32 numpy arrays (u None on the first step) -> (new theta, new u)."""
    f32 = np.float32
    with np.errstate(all="ignore"):
        g = grad + theta * f32(weight_decay) if weight_decay else grad
        if momentum:
            g = g * f32(1 - momentum) if u is None else u * f32(momentum) + g * f32(1 - momentum)
        return theta - g * f32(lr), g


def sgd_step(theta, grad, u, out, out_u, first, lr, momentum, weight_decay):
    check_blockwise("sgd_step", [(k, a, "float32", theta.size) for k, a in zip(
        ("theta", "grad", "u", "out", "out_u"), (theta, grad, u, out, out_u))])
    out.array[:], u = sgd_update(theta.array, grad.array, None if first else u.array, lr, momentum, weight_decay)
    if momentum:
        out_u.array[:] = u


def adam_update(theta, grad, m, v, lr, beta1, beta2, eps, correction1, correction2, weight_decay=0.0):
    """Adam's update on flat float32 numpy arrays, as src/README.md's adam_step (m, v None on the first step):
    float32 arithmetic, each operation rounded once. -> (new theta, new m, new v)."""
    f32 = np.float32
    with np.errstate(all="ignore"):  # inf and NaN propagate as in the element-wise kernels
        grad = grad + theta * f32(weight_decay) if weight_decay else grad  # the coupled weight decay
        m = grad * f32(1 - beta1) if m is None else m * f32(beta1) + grad * f32(1 - beta1)
        v = (grad * grad) * f32(1 - beta2) if v is None else v * f32(beta2) + (grad * grad) * f32(1 - beta2)
        out = theta - m / f32(correction1) * f32(lr) / (np.sqrt(v / f32(correction2)) + f32(eps))
    return out, m, v


def adam_step(theta, grad, m, v, out, out_m, out_v, first, lr, beta1, beta2, eps, correction1, correction2,
              weight_decay, seed=-1):
    """float32 arrays; or a bfloat16 theta updated in place (grad bfloat16 or float32; m, v bfloat16 or float32)."""
    fn, n = "adam_step", theta.size
    bf16 = theta.dtype == "bfloat16"
    dt = "bfloat16" if bf16 else "float32"
    state = dt if out_m.dtype == "bfloat16" else "float32"  # a bfloat16 parameter's: either
    old = m.dtype if first and m.dtype == grad.dtype else state  # first: grad stands in for m and v
    check_blockwise(fn, [(k, a, d, n) for k, a, d in zip(
        ("theta", "grad", "m", "v", "out", "out_m", "out_v"), (theta, grad, m, v, out, out_m, out_v),
        (dt, "bfloat16" if bf16 and grad.dtype == "bfloat16" else "float32", old, old, dt, state, state))])
    new, new_m, new_v = adam_update(
        _f32(theta), _f32(grad), None if first else _f32(m), None if first else _f32(v), lr, beta1, beta2, eps,
        correction1, correction2, weight_decay)
    _store(out_m, new_m)
    _store(out_v, new_v)
    _store_param(fn, theta, out, new, seed)


def _store_param(fn, theta, out, new, seed):
    """A fused step's new float32 theta into out: float32 as it is, or into a bfloat16 theta (out must be theta) to
    nearest (seed < 0) or stochastically (round_stochastic's bits for (seed, index))."""
    if theta.dtype == "bfloat16" and out is not theta:
        raise ValueError(f"{fn}: a bfloat16 theta is updated in place: out must be theta")
    if theta.dtype != "bfloat16" and seed >= 0:
        raise ValueError(f"{fn}: stochastic rounding (seed >= 0) needs a bfloat16 theta")
    new = new.reshape(out.array.shape)
    if seed >= 0:
        out.array[:] = stochastic_bfloat16(new, seed).reshape(out.array.shape)
    else:
        _store(out, new)


def adam8bit_blocks(theta, grad, q_m, absmax_m, q_v, absmax_v, code_m, code_v, block_size, lr, beta1, beta2, eps,
                    correction1, correction2, weight_decay=0.0):
    """One Adam step on 8-bit block-wise moments (q_v stores sqrt(v)), on flat numpy arrays, as src/README.md's
    adam8bit_step: float32 arithmetic, each operation rounded once. -> (new theta, q_m, absmax_m, q_v, absmax_v)."""
    f32 = np.float32
    with np.errstate(all="ignore"):  # inf and NaN propagate as in the element-wise kernels
        m = dequantize_blocks(q_m, code_m, absmax_m, block_size)
        r = dequantize_blocks(q_v, code_v, absmax_v, block_size)
        g = grad.reshape(-1) + theta.reshape(-1) * f32(weight_decay) if weight_decay else grad.reshape(-1)
        m = m * f32(beta1) + g * f32(1 - beta1)
        v = r * r * f32(beta2) + g * g * f32(1 - beta2)
        out = theta.reshape(-1) - m / f32(correction1) * f32(lr) / (np.sqrt(v / f32(correction2)) + f32(eps))
        r = np.sqrt(v)
    return (out, *quantize_blocks(m, code_m, block_size), *quantize_blocks(r, code_v, block_size))


def adam8bit_step(theta, grad, q_m, absmax_m, q_v, absmax_v, code_m, code_v, out, block_size, lr, beta1, beta2, eps,
                  correction1, correction2, weight_decay, seed=-1):
    """float32 theta and out; or a bfloat16 theta updated in place, grad bfloat16 or float32 (_store_param)."""
    fn, n = "adam8bit_step", theta.size
    blocks = num_blocks(fn, n, block_size)
    bf16 = theta.dtype == "bfloat16"
    check_blockwise(fn, [
        ("theta", theta, theta.dtype if bf16 else "float32", n),
        ("grad", grad, "bfloat16" if bf16 and grad.dtype == "bfloat16" else "float32", n), ("q_m", q_m, "uint8", n),
        ("absmax_m", absmax_m, "float32", blocks), ("q_v", q_v, "uint8", n), ("absmax_v", absmax_v, "float32", blocks),
        ("code_m", code_m, "float32", 256), ("code_v", code_v, "float32", 256), ("out", out, theta.dtype, n)])
    new, q_m.array[:], absmax_m.array[:], q_v.array[:], absmax_v.array[:] = adam8bit_blocks(
        _f32(theta), _f32(grad), q_m.array, absmax_m.array, q_v.array, absmax_v.array, code_m.array, code_v.array,
        block_size, lr, beta1, beta2, eps, correction1, correction2, weight_decay)
    _store_param(fn, theta, out, new, seed)


# ----- element-wise on compact buffers ----------------------------------------------------------------------
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "power": np.power,
           "maximum": np.maximum, "eq": np.equal, "ge": np.greater_equal,
           "gt": np.greater}
_UNARY = {"log": np.log, "exp": np.exp, "tanh": np.tanh}


def _ewise(name, a, b, out):
    _floats(f"ewise_{name}", a, b, out)
    _store(out, _BINARY[name](_f32(a), _f32(b)))


def _scalar(name, a, val, out):
    _floats(f"scalar_{name}", a, out)
    _store(out, _BINARY[name](_f32(a), np.float32(val)))


def _unary(name, a, out):
    _floats(f"ewise_{name}", a, out)
    _store(out, _UNARY[name](_f32(a)))


def ewise_add(a, b, out):
    _ewise("add", a, b, out)


def scalar_add(a, val, out):
    _scalar("add", a, val, out)


def ewise_mul(a, b, out):
    _ewise("mul", a, b, out)


def scalar_mul(a, val, out):
    _scalar("mul", a, val, out)


def ewise_div(a, b, out):
    _ewise("div", a, b, out)


def scalar_div(a, val, out):
    _scalar("div", a, val, out)


def ewise_power(a, b, out):
    _ewise("power", a, b, out)


def scalar_power(a, val, out):
    _scalar("power", a, val, out)


def ewise_maximum(a, b, out):
    _ewise("maximum", a, b, out)


def scalar_maximum(a, val, out):
    _scalar("maximum", a, val, out)


def ewise_eq(a, b, out):
    _ewise("eq", a, b, out)


def scalar_eq(a, val, out):
    _scalar("eq", a, val, out)


def ewise_ge(a, b, out):
    _ewise("ge", a, b, out)


def scalar_ge(a, val, out):
    _scalar("ge", a, val, out)


def ewise_gt(a, b, out):
    _ewise("gt", a, b, out)


def scalar_gt(a, val, out):
    _scalar("gt", a, val, out)


def ewise_log(a, out):
    _unary("log", a, out)


def ewise_exp(a, out):
    _unary("exp", a, out)


def ewise_tanh(a, out):
    _unary("tanh", a, out)


# ----- activations and their derivatives (src/README.md: ewise_gelu & co.) -----------------------------------
# GELU(x) = x Φ(x), Φ the standard normal CDF (exact: erf; "gelu_tanh": PyTorch's tanh approximation), SiLU(x) =
# x σ(x). Evaluated in float64 and rounded once (NumPy has no erfc: math.erfc per element; this is the specification,
# not the fast path), so the compiled backends' float32 arithmetic is within a few ulp of it.
_SQRT_2_OVER_PI, _TANH_CUBIC = math.sqrt(2 / math.pi), 0.044715
_erfc = np.frompyfunc(math.erfc, 1, 1)
ACTIVATIONS = ("gelu", "gelu_tanh", "silu")


def activation_values(kind, x):
    """f(x) in float64 for f in ACTIVATIONS."""
    x = np.asarray(x, dtype=np.float64)
    if kind == "gelu":
        return 0.5 * x * _erfc(-x / math.sqrt(2)).astype(np.float64)  # x Φ(x), no cancellation below −3
    if kind == "gelu_tanh":
        return 0.5 * x * (1 + np.tanh(_SQRT_2_OVER_PI * (x + _TANH_CUBIC * x ** 3)))
    if kind == "silu":
        return x / (1 + np.exp(-x))
    raise ValueError(f"activation: unknown kind {kind!r} (expected {', '.join(ACTIVATIONS)})")


def activation_derivative(kind, x):
    """f'(x) in float64: Φ(x) + x φ(x) (gelu), its tanh form's derivative (gelu_tanh), σ(x)(1 + x(1 − σ(x))) (silu)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        if kind == "gelu":
            return 0.5 * _erfc(-x / math.sqrt(2)).astype(np.float64) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        if kind == "gelu_tanh":
            t = np.tanh(_SQRT_2_OVER_PI * (x + _TANH_CUBIC * x ** 3))
            return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _TANH_CUBIC * x * x)
        if kind == "silu":
            s = 1 / (1 + np.exp(-x))
            return s * (1 + x * (1 - s))
    raise ValueError(f"activation: unknown kind {kind!r} (expected {', '.join(ACTIVATIONS)})")


def _activation(kind, a, out):
    _floats(f"ewise_{kind}", a, out)
    with np.errstate(over="ignore", invalid="ignore"):
        _store(out, activation_values(kind, a.array.astype(np.float64)))


def _activation_grad(kind, a, g, out):
    _floats(f"ewise_{kind}_grad", a, g, out)
    _store(out, activation_derivative(kind, a.array.astype(np.float64)) * g.array.astype(np.float64))


def ewise_gelu(a, out):
    _activation("gelu", a, out)


def ewise_gelu_tanh(a, out):
    _activation("gelu_tanh", a, out)


def ewise_silu(a, out):
    _activation("silu", a, out)


def ewise_gelu_grad(a, g, out):
    _activation_grad("gelu", a, g, out)


def ewise_gelu_tanh_grad(a, g, out):
    _activation_grad("gelu_tanh", a, g, out)


def ewise_silu_grad(a, g, out):
    _activation_grad("silu", a, g, out)


# ----- few-bit codes (src/README.md: pack_codes, unpack_scale; their packing: codes_reference.py) ---------------
def pack_codes(a, boundaries, out, bits):
    fn = "pack_codes"
    bits = check_bits(fn, bits)
    _floats(fn, a)
    check_blockwise(fn, [("boundaries", boundaries, "float32", 2**bits - 1),
                         ("out", out, "uint8", code_bytes(a.size, bits))])
    # code = how many boundaries are <= x (float32 comparisons; NaN compares false: code 0)
    x = _f32(a)
    codes = (boundaries.array[None, :] <= x[:, None]).sum(axis=1)
    out.array[:] = pack_code_values(codes, bits)


def unpack_scale(codes, levels, g, out, bits):
    fn = "unpack_scale"
    bits = check_bits(fn, bits)
    _floats(fn, g, out)
    check_blockwise(fn, [("codes", codes, "uint8", code_bytes(g.size, bits)),
                         ("levels", levels, "float32", 2**bits), ("out", out, out.dtype, g.size)])
    _store(out, _f32(g) * levels.array[unpack_code_values(codes.array, g.size, bits)])


# ----- compressed saved activations (ActNN, Chen et al. 2021): k-bit linear codes, stochastic rounding --------
def check_compress_bits(fn, bits):
    return check_bits(fn, bits, low=2)


def uniform_from_counter(seed, n):
    """n float32 numbers in [0, 1), element i's from the hash of (seed, i) as dropout's: its top 24 bits * 2^-24."""
    idx = np.arange(n, dtype=np.uint64)
    key = _lowbias32((idx >> np.uint64(32)).astype(np.uint32) ^ np.uint32((int(seed) * 0x9E3779B9) & 0xFFFFFFFF))
    return (_lowbias32(idx.astype(np.uint32) ^ key) >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)


def stochastic_codes(x, seed, bits, block_size):
    """float32 x -> (codes of 0..2h, float32 scale per block), h = 2^(bits-1) - 1, by the contract's rule: scale =
    absmax / h (NaN if the block holds a NaN), code = floor(x / scale + h + u), u from the counter; a block whose
    scale is 0 or not finite, or an element whose sum is not finite, gets code h (the value 0)."""
    x = np.asarray(x, np.float32).reshape(-1)
    n, half = x.size, np.float32(2 ** (bits - 1) - 1)
    padded = np.zeros(num_blocks("quantize_stochastic", n, block_size) * block_size, np.float32)
    padded[:n] = np.abs(x)
    scale = padded.reshape(-1, block_size).max(axis=1) / half  # float32; np.max propagates NaN
    s = np.repeat(scale, block_size)[:n]
    with np.errstate(all="ignore"):
        c = np.floor((x / s + half) + uniform_from_counter(seed, n))
    ok = np.isfinite(c) & np.isfinite(s) & (s > 0)
    codes = np.where(ok, np.clip(c, 0, 2 * half), half).astype(np.uint8)
    return codes, scale.astype(np.float32)


def quantize_stochastic(a, out, scales, bits, block_size, seed):
    fn = "quantize_stochastic"
    bits = check_compress_bits(fn, bits)
    blocks = num_blocks(fn, a.size, block_size)
    check_blockwise(fn, [("a", a, "float32", a.size), ("out", out, "uint8", code_bytes(a.size, bits)),
                         ("scales", scales, "float32", blocks)])
    codes, scale = stochastic_codes(a.array, seed, bits, block_size)
    out.array[:], scales.array[:] = pack_code_values(codes, bits), scale


def dequantize_linear(codes, scales, out, bits, block_size):
    fn = "dequantize_linear"
    bits = check_compress_bits(fn, bits)
    blocks = num_blocks(fn, out.size, block_size)
    check_blockwise(fn, [("codes", codes, "uint8", code_bytes(out.size, bits)),
                         ("scales", scales, "float32", blocks), ("out", out, "float32", out.size)])
    half = np.float32(2 ** (bits - 1) - 1)
    c = unpack_code_values(codes.array, out.size, bits).astype(np.float32)
    with np.errstate(invalid="ignore"):  # 0 times a non-finite scale
        out.array[:] = (c - half) * np.repeat(scales.array, block_size)[: out.size]


# ----- element-wise on strided views: out (compact, `shape`) = op(views), nothing materialized (float32) ---------
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
    _float32_only("ewise_strided", a, b, out)
    func(_view(a, shape, a_strides, a_offset), _view(b, shape, b_strides, b_offset),
         out=_out_view("ewise_strided", out, shape, a, b))


def scalar_strided(op, a, strides, offset, val, out, shape):
    func = _op(_BINARY, op, "scalar_strided")
    _float32_only("scalar_strided", a, out)
    func(_view(a, shape, strides, offset), np.float32(val), out=_out_view("scalar_strided", out, shape, a))


def unary_strided(op, a, strides, offset, out, shape):
    func = _op(_UNARY, op, "unary_strided")
    _float32_only("unary_strided", a, out)
    func(_view(a, shape, strides, offset), out=_out_view("unary_strided", out, shape, a))


# ----- matmul and reductions: float32 accumulation -------------------------------------------------------------
def matmul(a, b, out, m, n, p, trans_a=False, trans_b=False, accumulate=False):
    """out = a @ b, or with accumulate out += a @ b (out's value added to the float32 product, rounded once)."""
    _floats("matmul", a, b, out=out)
    # Transposed operands as row-major copies: NumPy's BLAS picks its kernel (and summation order) by layout.
    left = np.ascontiguousarray(_f32(a)[: m * n].reshape(n, m).T) if trans_a else _f32(a)[: m * n].reshape(m, n)
    right = np.ascontiguousarray(_f32(b)[: n * p].reshape(p, n).T) if trans_b else _f32(b)[: n * p].reshape(n, p)
    with np.errstate(invalid="ignore"):  # (a BLAS's spurious flag: see the note below matmul_batched)
        product = (left @ right).reshape(-1)
        _store(out, _f32(out)[: m * p] + product if accumulate else product)


def matmul_batched(a, b, out, batch, m, n, p):
    if out is a or out is b:
        raise ValueError("matmul_batched: out must not be one of the inputs")
    _floats("matmul_batched", a, b, out=out)
    with np.errstate(invalid="ignore"):  # (a BLAS's spurious flag: see the note below matmul_batched)
        prod = np.matmul(_f32(a)[: batch * m * n].reshape(batch, m, n), _f32(b)[: batch * n * p].reshape(batch, n, p))
    _store(out, prod.reshape(-1), slice(0, batch * m * p))


# Note: OpenBLAS's SIMD kernels may raise the "invalid" floating-point flag on finite inputs (numpy#28967, #24067),
# which NumPy reports as a RuntimeWarning and the tests turn into errors at random: the product itself is exact, and
# a real NaN still shows in it, so the reference's matmuls ignore that flag.


def matmul_tiled(a, b, out, m, n, p):
    _float32_only("matmul_tiled", a, b, out)
    matmul(a, b, out, m, n, p)


def _rows(a, out, reduce_size):
    return _f32(a)[: out.size * reduce_size].reshape(-1, reduce_size)


def reduce_max(a, out, reduce_size):
    _floats("reduce_max", a, out)
    _store(out, _rows(a, out, reduce_size).max(axis=1))


def reduce_sum(a, out, reduce_size):
    _floats("reduce_sum", a, out)
    _store(out, _rows(a, out, reduce_size).sum(axis=1, dtype=np.float64))


def _logsumexp_rows(rows):
    """m + log Σ exp(row - m) per row; a row whose max m is not finite gives m (as the C++ backend)."""
    m = rows.max(axis=1, keepdims=True)
    shift = np.where(np.isfinite(m), m, 0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        lse = shift + np.log(np.exp(rows - shift).sum(axis=1, keepdims=True))
    return np.where(np.isfinite(m), lse, m)[:, 0]


def reduce_logsumexp(a, out, reduce_size):
    _floats("reduce_logsumexp", a, out)
    _store(out, _logsumexp_rows(_rows(a, out, reduce_size)))


# ----- gathers and scatters -------------------------------------------------------------------------------------
def _row_indices(idx, num_rows):
    rows = idx.array.astype(np.float64)
    ints = rows.astype(np.int64)
    bad = np.nonzero((ints != rows) | (ints < 0) | (ints >= num_rows))[0]
    if bad.size:
        raise IndexError(f"index {rows[bad[0]]:g} is out of range for {num_rows} rows (or not an integer)")
    return ints


def take_rows(a, idx, out, row_size):
    if a.dtype != out.dtype:
        raise TypeError(f"take_rows: a is {a.dtype} but out is {out.dtype}")
    rows = _row_indices(idx, a.size // row_size)
    out.array[: rows.size * row_size] = a.array.reshape(-1, row_size)[rows].reshape(-1)


def scatter_add_rows(src, idx, out, row_size):
    _floats("scatter_add_rows", src, out)
    rows = _row_indices(idx, out.size // row_size)
    table = out.array.reshape(-1, row_size)
    values = src.array[: rows.size * row_size].reshape(-1, row_size)
    if out.dtype == "float32":
        np.add.at(table, rows, values)
        return
    for i, r in enumerate(rows):  # 16-bit: each addition rounded on store, in order (as a simple kernel does)
        _store(out, table[r].astype(np.float32) + values[i].astype(np.float32), slice(r * row_size, (r + 1) * row_size))


def take_along_rows(a, idx, out, row_size):
    _floats("take_along_rows", a, out)
    cols = _row_indices(idx, row_size)
    out.array[: cols.size] = a.array[: cols.size * row_size].reshape(-1, row_size)[np.arange(cols.size), cols]


def scatter_along_rows(src, idx, out, row_size):
    _floats("scatter_along_rows", src, out)
    cols = _row_indices(idx, row_size)
    table = out.array[: cols.size * row_size].reshape(-1, row_size)
    picked = table[np.arange(cols.size), cols].astype(np.float32) + _f32(src)[: cols.size]
    with np.errstate(over="ignore"):
        table[np.arange(cols.size), cols] = picked.astype(out.array.dtype)


def softmax_xent_grad(a, idx, g, out, row_size):
    if row_size <= 0:
        raise ValueError("softmax_xent_grad: row_size must be positive")
    _floats("softmax_xent_grad", a, g, out)
    cols = _row_indices(idx, row_size)
    rows = _f32(a)[: cols.size * row_size].reshape(-1, row_size)
    gs = _f32(g)[: cols.size]
    with np.errstate(invalid="ignore"):  # a row of -inf: NaN, as on the other backends
        grad = np.exp(rows - _logsumexp_rows(rows)[:, None]) * gs[:, None]
    grad[np.arange(cols.size), cols] -= gs
    _store(out, grad.reshape(-1), slice(0, cols.size * row_size))


# ----- fused attention (FlashAttention-2): one tile of scores at a time, never the T_q x T_k matrix ------------------
ATTENTION_TILE = 32  # query rows and key rows per tile here (the compiled backends choose their own; see src/README)


def attention_causal_error(fn, t_q, t_k):
    return (f"{fn}: causal attention with more queries than keys (T_q={t_q} > T_k={t_k}) leaves the first "
            f"{t_q - t_k} queries without a key to attend to; the causal mask aligns the last query with the last "
            f"key (query i sees keys j <= i + T_k - T_q), so it needs T_q <= T_k")


def check_attention(fn, dims, causal, dropout_p, data, stats):
    """dims = (batch, t_q, t_k, d, d_v); `data` and `stats` hold (name, array, elements): the data arrays must be of
    one floating dtype, the row statistics (lse, dlse, delta) float32; ValueError for sizes and arguments."""
    batch, t_q, t_k, d, d_v = dims
    if batch < 0 or min(t_q, t_k, d, d_v) < 1:
        raise ValueError(f"{fn}: needs batch >= 0 and t_q, t_k, d, d_v >= 1, got batch={batch}, t_q={t_q}, "
                         f"t_k={t_k}, d={d}, d_v={d_v}")
    if causal and t_q > t_k:
        raise ValueError(attention_causal_error(fn, t_q, t_k))
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{fn}: dropout_p must be in [0, 1), got {dropout_p}")
    if data:
        _floats(fn, *[a for _, a, _ in data])
    if any(a.dtype != "float32" for _, a, _ in stats):
        raise TypeError(f"{fn}: " + ", ".join(f"{name} must be float32, got {a.dtype}" for name, a, _ in stats
                                              if a.dtype != "float32"))
    for name, a, size in data + stats:
        if a.size != size:
            raise ValueError(f"{fn}: {name} has {a.size} elements, expected {size}")


def dropout_threshold(p):
    """Attention dropout keeps an element when its 32-bit hash is >= this: probability 1 - p (to 2**-32)."""
    return min(int(p * 4294967296.0), 4294967295)


def _lowbias32(h):
    h = h ^ (h >> np.uint32(16))
    h *= np.uint32(0x7FEB352D)
    h ^= h >> np.uint32(15)
    h *= np.uint32(0x846CA68B)
    return h ^ (h >> np.uint32(16))


def dropout_keep(seed, rows, cols, t_k, threshold):
    """keep[..., r, c] for the elements (rows[..., r], cols[c]) of the (batch * t_q, t_k) attention matrix, from a
    hash of (seed, idx), idx = row * t_k + col (64 bits): a counter-based mask, the same bits on every backend."""
    idx = rows[..., None].astype(np.uint64) * np.uint64(t_k) + cols.astype(np.uint64)
    key = _lowbias32((idx >> np.uint64(32)).astype(np.uint32) ^ np.uint32((int(seed) * 0x9E3779B9) & 0xFFFFFFFF))
    return _lowbias32(idx.astype(np.uint32) ^ key) >= np.uint32(threshold)


def dropout(a, out, p, seed):
    _floats("dropout", a, out)
    if a.size != out.size:
        raise ValueError(f"dropout: out has {out.size} elements, a {a.size}")
    if not 0 <= p < 1:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")
    keep = dropout_keep(seed, np.arange(a.size), np.zeros(1, np.int64), 1, dropout_threshold(p)).reshape(-1)
    with np.errstate(all="ignore"):
        _store(out, _f32(a) * keep.astype(np.float32) / np.float32(1 - p))


def _attention_dropout(dropout, n, t_q, t_k, i0, i1, j0, j1, dt):
    """The tile's dropout factor z = keep / (1 - p) (rows i0..i1 of each of the n matrices, keys j0..j1), or None."""
    if dropout is None:
        return None
    p, seed = dropout
    rows = np.arange(n)[:, None] * t_q + np.arange(i0, i1)[None, :]
    keep = dropout_keep(seed, rows, np.arange(j0, j1), t_k, dropout_threshold(p))
    return keep * dt.type(1.0 / (1.0 - p))


def _attention_scores(q, k, scale, causal, i0, j0, shift):
    """scale * q k^T for one tile; -inf where a causal mask hides key j from query i (j > i + shift)."""
    s = (q @ k.transpose(0, 2, 1)) * q.dtype.type(scale)
    if causal:
        hidden = np.arange(j0, j0 + k.shape[1])[None, :] > np.arange(i0, i0 + q.shape[1])[:, None] + shift
        s[:, hidden] = -np.inf
    return s


def attention_tiles_forward(q, k, v, scale, causal, dropout=None, tile=ATTENTION_TILE):
    """(out, lse) of q (n, t_q, d), k (n, t_k, d), v (n, t_k, d_v), computed in their float dtype.

    FlashAttention-2's forward: for each tile of query rows, a running row maximum m, row sum l of exp(s - m) and
    unnormalized output o are carried from key tile to key tile (online softmax: when m grows, l and o are
    rescaled by exp(m_old - m_new)); then out = o / l and lse = m + log l. A causal query tile stops at its last
    visible key. `dropout` (p, seed) multiplies the probabilities (not l) by z = keep / (1 - p)."""
    n, t_q, t_k, dt = q.shape[0], q.shape[1], k.shape[1], q.dtype
    shift = t_k - t_q  # causal: query i sees keys j <= i + shift
    out, lse = np.empty((n, t_q, v.shape[2]), dt), np.empty((n, t_q), dt)
    for i0 in range(0, t_q, tile):
        i1 = min(i0 + tile, t_q)
        m, l = np.full((n, i1 - i0), -np.inf, dt), np.zeros((n, i1 - i0), dt)
        o = np.zeros((n, i1 - i0, v.shape[2]), dt)
        for j0 in range(0, i1 + shift if causal else t_k, tile):
            j1 = min(j0 + tile, t_k)
            s = _attention_scores(q[:, i0:i1], k[:, j0:j1], scale, causal, i0, j0, shift)
            m_new = np.maximum(m, s.max(axis=2))  # finite: every query sees key 0, in the first tile
            p = np.exp(s - m_new[:, :, None])
            alpha = np.exp(m - m_new)
            l = alpha * l + p.sum(axis=2)
            z = _attention_dropout(dropout, n, t_q, t_k, i0, i1, j0, j1, dt)
            o = alpha[:, :, None] * o + (p if z is None else p * z) @ v[:, j0:j1]
            m = m_new
        out[:, i0:i1] = o / l[:, :, None]
        lse[:, i0:i1] = m + np.log(l)
    return out, lse


def attention_tiles_backward(q, k, v, out, lse, dout, dlse, scale, causal, dropout=None, tile=ATTENTION_TILE):
    """(dq, dk, dv, delta) for the forward above, its probabilities recomputed tile by tile from lse.

    FlashAttention-2's backward: delta_i = dout_i . out_i - dlse_i first; then for each key tile (its dk, dv
    accumulated in place) the query tiles that see it: p = exp(s - lse), dv += (p z)^T dout, dp = (dout v^T) z,
    ds = p (dp - delta) scale, dq += ds k, dk += ds^T q."""
    n, t_q, t_k, dt = q.shape[0], q.shape[1], k.shape[1], q.dtype
    shift = t_k - t_q
    delta = (dout * out).sum(axis=2) - dlse
    dq, dk, dv = np.zeros_like(q), np.empty_like(k), np.empty_like(v)
    for j0 in range(0, t_k, tile):
        j1 = min(j0 + tile, t_k)
        dk_j, dv_j = np.zeros((n, j1 - j0, q.shape[2]), dt), np.zeros((n, j1 - j0, v.shape[2]), dt)
        first = max(0, j0 - shift) // tile * tile if causal else 0  # the first query tile that sees key j0
        for i0 in range(first, t_q, tile):
            i1 = min(i0 + tile, t_q)
            s = _attention_scores(q[:, i0:i1], k[:, j0:j1], scale, causal, i0, j0, shift)
            p = np.exp(s - lse[:, i0:i1, None])
            z = _attention_dropout(dropout, n, t_q, t_k, i0, i1, j0, j1, dt)
            dv_j += (p if z is None else p * z).transpose(0, 2, 1) @ dout[:, i0:i1]
            dp = dout[:, i0:i1] @ v[:, j0:j1].transpose(0, 2, 1)
            ds = p * ((dp if z is None else dp * z) - delta[:, i0:i1, None]) * dt.type(scale)
            dq[:, i0:i1] += ds @ k[:, j0:j1]
            dk_j += ds.transpose(0, 2, 1) @ q[:, i0:i1]
        dk[:, j0:j1], dv[:, j0:j1] = dk_j, dv_j
    return dq, dk, dv, delta


def _attention_views(dims, *arrays):
    """float32 views of the compact buffers as (batch, rows, width) matrices: q, k, v, out, dout ..."""
    batch, t_q, t_k, d, d_v = dims
    rows = {"q": (t_q, d), "k": (t_k, d), "v": (t_k, d_v), "o": (t_q, d_v)}
    return [_f32(a).reshape((batch,) + rows[kind]) for kind, a in arrays]


def attention_forward(q, k, v, out, lse, batch, t_q, t_k, d, d_v, scale, causal, dropout_p, seed):
    dims = (batch, t_q, t_k, d, d_v)
    check_attention("attention_forward", dims, causal, dropout_p,
                    [("q", q, batch * t_q * d), ("k", k, batch * t_k * d), ("v", v, batch * t_k * d_v),
                     ("out", out, batch * t_q * d_v)], [("lse", lse, batch * t_q)])
    views = _attention_views(dims, ("q", q), ("k", k), ("v", v))
    o, l = attention_tiles_forward(*views, scale, causal, (dropout_p, seed) if dropout_p > 0 else None)
    _store(out, o.reshape(-1))
    lse.array[:] = l.reshape(-1)


def attention_backward(q, k, v, out, lse, dout, dlse, delta, dq, dk, dv, batch, t_q, t_k, d, d_v, scale, causal,
                       dropout_p, seed):
    dims = (batch, t_q, t_k, d, d_v)
    data = [("q", q, batch * t_q * d), ("k", k, batch * t_k * d), ("v", v, batch * t_k * d_v),
            ("out", out, batch * t_q * d_v), ("dout", dout, batch * t_q * d_v), ("dq", dq, batch * t_q * d),
            ("dk", dk, batch * t_k * d), ("dv", dv, batch * t_k * d_v)]
    stats = [(name, a, batch * t_q) for name, a in (("lse", lse), ("dlse", dlse), ("delta", delta))]
    check_attention("attention_backward", dims, causal, dropout_p, data, stats)
    views = _attention_views(dims, ("q", q), ("k", k), ("v", v), ("o", out))
    row_stats = [a.array.reshape(batch, t_q) for a in (lse, dlse)]
    (g_out,) = _attention_views(dims, ("o", dout))
    grads = attention_tiles_backward(*views, row_stats[0], g_out, row_stats[1], scale, causal,
                                     (dropout_p, seed) if dropout_p > 0 else None)
    for target, g in zip((dq, dk, dv), grads):
        _store(target, g.reshape(-1))
    delta.array[:] = grads[3].reshape(-1)


# ----- layer norm, fused -------------------------------------------------------------------------------------------
def _check_layernorm(fn, rows, n, eps, arrays):
    """arrays: (name, buffer, expected size): one floating dtype, the sizes of rows x n (or n) elements."""
    if rows < 0 or n < 1:
        raise ValueError(f"{fn}: needs rows >= 0 and n >= 1, got rows {rows}, n {n}")
    if not eps >= 0:
        raise ValueError(f"{fn}: eps must be >= 0, got {eps}")
    _floats(fn, *(a for _, a, _ in arrays))
    for name, a, size in arrays:
        if a.size != size:
            raise ValueError(f"{fn}: {name} has {a.size} elements, expected {size}")


def layernorm_rows(x, eps):
    """(mean, rstd) of each row of x (rows, n) in x's dtype (float32: the contract; float64 under
    NEEDLE_BACKEND=np): rstd = 1 / sqrt(mean((x - mean)^2) + eps)."""
    t = x.dtype.type
    mean = x.sum(axis=1, dtype=t) / t(x.shape[1])
    centered = x - mean[:, None]
    var = (centered * centered).sum(axis=1, dtype=t) / t(x.shape[1])
    return mean, t(1) / np.sqrt(var + t(eps))


def layernorm_rows_forward(x, w, b, eps):
    """Layer norm of the rows of x (rows, n) with w, b (n,), all float32 (the contract's arithmetic) or all
    float64."""
    with np.errstate(all="ignore"):
        mean, rstd = layernorm_rows(x, eps)
        return (x - mean[:, None]) * rstd[:, None] * w + b


def layernorm_rows_backward(x, w, g, eps):
    """(dx, dw, db) for the rows of x and g (rows, n) and w (n,), all float32 (the contract) or all float64."""
    t = x.dtype.type
    with np.errstate(all="ignore"):
        mean, rstd = layernorm_rows(x, eps)
        xhat = (x - mean[:, None]) * rstd[:, None]
        gw = g * w
        c1 = gw.sum(axis=1, dtype=t) / t(x.shape[1])
        c2 = (gw * xhat).sum(axis=1, dtype=t) / t(x.shape[1])
        dx = (gw - c1[:, None] - xhat * c2[:, None]) * rstd[:, None]
        return dx, (g * xhat).sum(axis=0, dtype=t), g.sum(axis=0, dtype=t)


def layernorm_forward(x, w, b, out, rows, n, eps):
    _check_layernorm("layernorm_forward", rows, n, eps,
                     [("x", x, rows * n), ("w", w, n), ("b", b, n), ("out", out, rows * n)])
    _store(out, layernorm_rows_forward(_f32(x).reshape(rows, n), _f32(w), _f32(b), eps).reshape(-1))


def layernorm_backward(x, w, g, dx, dw, db, rows, n, eps):
    _check_layernorm("layernorm_backward", rows, n, eps,
                     [("x", x, rows * n), ("w", w, n), ("g", g, rows * n), ("dx", dx, rows * n), ("dw", dw, n),
                      ("db", db, n)])
    grads = layernorm_rows_backward(_f32(x).reshape(rows, n), _f32(w), _f32(g).reshape(rows, n), eps)
    for out, values in zip((dx, dw, db), grads):
        _store(out, values.reshape(-1))
