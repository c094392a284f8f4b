"""The NumPy-like functional API that ops call: `array`, `sum`, `matmul`, `reshape`, ... on NDArrays.

Ops reach these through `backend_selection.array_api`, which is this module under NEEDLE_BACKEND=nd and
`needle.backend_numpy` (the same functions on numpy.ndarray) under NEEDLE_BACKEND=np. Each function checks its
operands, allocates its result and calls the device's backend module (the contract is in src/README.md); the
arrays themselves, their views and devices are in ndarray.py.

`sum` and `max` shadow the builtins in this module (as in NumPy's namespace).
"""
import functools

import numpy as np

from . import ndarray_backend_numpy
from .copy_thread import CopyThread
from .ndarray import (  # promote_types is part of the API ops call, as NumPy's np.promote_types
    DTYPES, NDArray, _normalize_axis, _require_float, default_device, dtype_name, prod, promote_types,
)

__all__ = [
    "pack_codes",
    "unpack_scale",
    "quantize_stochastic",
    "dequantize_linear",
    "activation",
    "activation_grad",
    "adafactor_moments",
    "adafactor_step",
    "adafactor_sumsq",
    "adam8bit_step",
    "add_matmul",
    "copy",
    "adam_step",
    "array",
    "astype",
    "attention_backward",
    "attention_forward",
    "broadcast_to",
    "cast_like",
    "copies_async",
    "copy_thread",
    "copy_to_host",
    "dequantize_blockwise",
    "dropout",
    "empty",
    "exp",
    "flip",
    "from_host_async",
    "full",
    "host_empty",
    "layer_norm",
    "layer_norm_backward",
    "log",
    "logsumexp",
    "matmul",
    "max",
    "maximum",
    "pad",
    "promote_types",
    "quantize_blockwise",
    "reshape",
    "round_stochastic",
    "scatter_add_rows",
    "scatter_along_rows",
    "sgd_step",
    "softmax_xent_grad",
    "split",
    "stack",
    "sum",
    "take_along_rows",
    "take_rows",
    "tanh",
    "tensor_data",
    "to_host",
    "to_numpy",
    "transpose",
    "wait_for_copies",
    "zeros",
]


def array(a, dtype="float32", device=None):
    return NDArray(a, device=device, dtype=dtype)


def tensor_data(a, dtype=None, device=None):
    """The array a Tensor stores for `a` (array-like or NDArray): an NDArray already on `device` and of `dtype`
    (None: any) is kept as is. Anything else becomes float32 unless `dtype` says otherwise."""
    if dtype in ("bool", bool):  # bool data (randb's masks) is stored as float32 0/1
        dtype = "float32"
    if isinstance(a, NDArray):
        if dtype is not None and dtype_name(dtype) != a.dtype:
            a = a.astype(dtype)
        return a if device is None or a.device == device else a.to(device)
    return NDArray(a, device=device, dtype=dtype)


def to_numpy(a):
    return a.numpy()


def cast_like(a, like):
    """`a` in the dtype of `like` (a converted copy only when they differ)."""
    return a if a.dtype == like.dtype else a.astype(like.dtype)


def astype(a, dtype):
    """`a` converted to `dtype` (a compact copy)."""
    return a.astype(dtype)


def round_stochastic(a, seed, offset=0):
    """A float32 array as bfloat16, each element rounded up with probability equal to the fraction of a bfloat16
    step that rounding drops (so rounding is unbiased on average); `seed` picks the noise, deterministically, and
    element i's is that of element offset + i of a larger array (so a chunk rounds as the whole array would)."""
    if a.dtype != "float32":
        raise TypeError(f"round_stochastic: needs a float32 array, got {a.dtype}")
    a = a.compact()
    out = NDArray._empty(a.shape, a.device, "bfloat16")
    a.device.mod.round_stochastic(a._handle, out._handle, int(seed) & 0xFFFFFFFF, int(offset))
    return out


def _ndarrays_on_one_device(fn, *named):
    """TypeError unless each (name, value) is an NDArray; ValueError unless all live on the first one's device."""
    for name, array in named:
        if not isinstance(array, NDArray):
            raise TypeError(f"{fn}: {name} must be an NDArray, got {type(array).__name__}")
    first, device = named[0][0], named[0][1].device
    for name, array in named[1:]:
        if array.device != device:
            raise ValueError(f"{fn}: {first} is on {device} but {name} on {array.device}")


def quantize_blockwise(a, code, block_size):
    """Block-wise 8-bit quantization (Dettmers et al. 2021) of float32 `a` with a 256-value float32 `code` on a's
    device: (q, absmax), q uint8 of a's shape and absmax float32 of shape (ceil(a.size / block_size),). Block b is
    the elements [b * block_size, (b + 1) * block_size) of a in row-major order; absmax[b] is their largest |a[i]|
    and q[i] the index of the code value nearest to a[i] / absmax[b] (src/README.md gives the exact rule)."""
    fn = "quantize_blockwise"
    _ndarrays_on_one_device(fn, ("a", a), ("code", code))
    blocks = ndarray_backend_numpy.num_blocks(fn, a.size, block_size)
    ndarray_backend_numpy.check_blockwise(fn, [("a", a, "float32", a.size), ("code", code, "float32", 256)])
    a = a.compact()
    q = NDArray._empty(a.shape, a.device, "uint8")
    absmax = NDArray._empty((blocks,), a.device, "float32")
    a.device.mod.quantize_blockwise(a._handle, code.compact()._handle, q._handle, absmax._handle, int(block_size))
    return q, absmax


def dequantize_blockwise(q, absmax, code, block_size):
    """The inverse of quantize_blockwise: float32 code[q] * absmax of each element's block, of q's shape."""
    fn = "dequantize_blockwise"
    _ndarrays_on_one_device(fn, ("q", q), ("absmax", absmax), ("code", code))
    blocks = ndarray_backend_numpy.num_blocks(fn, q.size, block_size)
    ndarray_backend_numpy.check_blockwise(fn, [("q", q, "uint8", q.size), ("absmax", absmax, "float32", blocks),
                                               ("code", code, "float32", 256)])
    q = q.compact()
    out = NDArray._empty(q.shape, q.device, "float32")
    q.device.mod.dequantize_blockwise(q._handle, code.compact()._handle, absmax.compact()._handle, out._handle,
                                      int(block_size))
    return out


def pack_codes(a, boundaries, bits):
    """The `bits`-bit code of each element of floating `a` (how many of the 2**bits - 1 ascending float32
    `boundaries` are <= it), packed: uint8 of shape (ceil(a.size * bits / 8),), the layout of src/README.md."""
    fn = "pack_codes"
    _ndarrays_on_one_device(fn, ("a", a), ("boundaries", boundaries))
    bits = ndarray_backend_numpy.check_bits(fn, bits)
    _require_float(fn, a.dtype)
    ndarray_backend_numpy.check_blockwise(fn, [("boundaries", boundaries, "float32", 2**bits - 1)])
    a = a.compact()
    out = NDArray._empty((ndarray_backend_numpy.code_bytes(a.size, bits),), a.device, "uint8")
    a.device.mod.pack_codes(a._handle, boundaries.compact()._handle, out._handle, bits)
    return out


def unpack_scale(codes, levels, g, bits):
    """g * levels[code] element-wise, the codes unpacked from `codes` (pack_codes' bytes for g's elements): of g's
    shape and dtype."""
    fn = "unpack_scale"
    _ndarrays_on_one_device(fn, ("codes", codes), ("levels", levels), ("g", g))
    bits = ndarray_backend_numpy.check_bits(fn, bits)
    _require_float(fn, g.dtype)
    ndarray_backend_numpy.check_blockwise(fn, [
        ("codes", codes, "uint8", ndarray_backend_numpy.code_bytes(g.size, bits)),
        ("levels", levels, "float32", 2**bits)])
    g = g.compact()
    out = NDArray._empty(g.shape, g.device, g.dtype)
    g.device.mod.unpack_scale(codes.compact()._handle, levels.compact()._handle, g._handle, out._handle, bits)
    return out


def quantize_stochastic(a, bits, block_size, seed):
    """float32 `a` as k-bit linear codes with stochastic rounding, one float32 scale per block of `block_size`
    elements (src/README.md): (codes, scales), codes uint8 of shape (ceil(a.size * bits / 8),) in pack_codes'
    layout, scales float32 of shape (ceil(a.size / block_size),). The noise of element i is a hash of (seed, i)."""
    fn = "quantize_stochastic"
    _ndarrays_on_one_device(fn, ("a", a))
    bits = ndarray_backend_numpy.check_compress_bits(fn, bits)
    if a.dtype != "float32":
        raise TypeError(f"{fn}: needs a float32 array, got {a.dtype}")
    blocks = ndarray_backend_numpy.num_blocks(fn, a.size, block_size)
    a = a.compact()
    codes = NDArray._empty((ndarray_backend_numpy.code_bytes(a.size, bits),), a.device, "uint8")
    scales = NDArray._empty((blocks,), a.device, "float32")
    a.device.mod.quantize_stochastic(a._handle, codes._handle, scales._handle, bits, block_size,
                                     int(seed) & 0xFFFFFFFF)
    return codes, scales


def dequantize_linear(codes, scales, shape, bits, block_size):
    """The inverse of quantize_stochastic: float32 (code - h) * scale of its block, of `shape`."""
    fn = "dequantize_linear"
    _ndarrays_on_one_device(fn, ("codes", codes), ("scales", scales))
    bits = ndarray_backend_numpy.check_compress_bits(fn, bits)
    out = NDArray._empty(tuple(shape), codes.device, "float32")
    ndarray_backend_numpy.check_blockwise(fn, [
        ("codes", codes, "uint8", ndarray_backend_numpy.code_bytes(out.size, bits)),
        ("scales", scales, "float32", ndarray_backend_numpy.num_blocks(fn, out.size, block_size))])
    codes.device.mod.dequantize_linear(codes.compact()._handle, scales.compact()._handle, out._handle, bits,
                                       block_size)
    return out


def _fused_arrays(fn, theta, grad, state, out):
    """A fused step's compact operands (state None on the first step: grad in its place) and outputs, checked."""
    named = [("theta", theta), ("grad", grad)] + [(k, a) for k, a in state.items() if a is not None]
    _ndarrays_on_one_device(fn, *named)
    for name, array in named[1:]:
        if array.shape != theta.shape:
            raise ValueError(f"{fn}: {name} has shape {array.shape}, theta {theta.shape}")
    out = out or tuple(NDArray._empty(theta.shape, theta.device, "float32") for _ in range(1 + len(state)))
    for name, array in zip(["out"] + [f"out_{k}" for k in state], out):
        if not array.is_compact() or array.shape != theta.shape or array.device != theta.device:
            raise ValueError(f"{fn}: {name} must be a compact array of theta's shape on its device")
    theta, grad = theta.compact(), grad.compact()
    return theta, grad, [grad if a is None else a.compact() for a in state.values()], out


def sgd_step(theta, grad, u, lr, momentum, weight_decay=0.0, out=None):
    """SGD's update in one backend pass (src/README.md, sgd_step): the new (theta, u), u None on the first step and
    without momentum; `out` as adam_step's."""
    theta, grad, (u_in,), (out, out_u) = _fused_arrays("sgd_step", theta, grad, {"u": u}, out)
    theta.device.mod.sgd_step(theta._handle, grad._handle, u_in._handle, out._handle, out_u._handle, u is None,
                              float(lr), float(momentum), float(weight_decay))
    return out, out_u if momentum else None


def adam_step(theta, grad, m, v, lr, beta1, beta2, eps, correction1, correction2, weight_decay=0.0, out=None,
              rounding_seed=None):
    """Adam's update of one parameter in one backend pass (src/README.md, adam_step): returns the new (theta, m,
    v); m and v are None on the first step. correction1/2 are Adam's 1 - beta^t. `out`: compact float32 arrays of
    theta's shape to write them into (theta, m, v themselves: the update in place). A bfloat16 theta (its m, v
    and grad bfloat16 or float32) is updated in place only (out=(theta, m, v)): each value widened,
    updated in float32 and rounded back, the state to nearest, theta to nearest or, with `rounding_seed`, as
    round_stochastic(new, rounding_seed) rounds it."""
    if theta.dtype == "bfloat16" and (out is None or out[0] is not theta):
        raise ValueError("adam_step: a bfloat16 theta is updated in place: pass out=(theta, m, v)")
    theta, grad, (m_in, v_in), out = _fused_arrays("adam_step", theta, grad, {"m": m, "v": v}, out)
    seed = -1 if rounding_seed is None else int(rounding_seed) & 0xFFFFFFFF
    theta.device.mod.adam_step(theta._handle, grad._handle, m_in._handle, v_in._handle, *(a._handle for a in out),
                               m is None, float(lr), float(beta1), float(beta2), float(eps), float(correction1),
                               float(correction2), float(weight_decay), seed)
    return out


def adafactor_moments(grad, n, cols, rows_per_chunk, eps1):
    """Adafactor's new row and column means of g * g + eps1 (src/README.md, adafactor_moments): float32 arrays
    (batch * n,) and (batch * cols,) for grad seen as matrices (n, cols), summed rows_per_chunk rows at a time."""
    grad = grad.compact()
    row, col = (NDArray._empty((grad.size // d,), grad.device, "float32") for d in (cols, n))
    grad.device.mod.adafactor_moments(grad._handle, row._handle, col._handle, n, cols, rows_per_chunk, float(eps1))
    return row, col


def _adafactor_handles(fn, grad, rc, v, written=()):
    """grad compact and the handles (r, c, v) of a factored moment (rc = (r, c)) or of the full one (rc None: v);
    arrays written in place (theta, m, v) must be compact."""
    named = [("grad", grad), *zip(("r", "c"), rc or ()), *([] if rc else [("v", v)]), *written]
    _ndarrays_on_one_device(fn, *named)
    if any(name in ("theta", "v", "m") and not a.is_compact() for name, a in named):
        raise ValueError(f"{fn}: theta, v and m are updated in place and must be compact")
    grad = grad.compact()
    r, c = (a.compact() for a in rc) if rc else (grad, grad)
    return grad, (r._handle, c._handle, (grad if rc else v)._handle)


def adafactor_sumsq(grad, rc, v, first, n, cols, rows_per_chunk, beta2, eps1):
    """The sums of u * u over Adafactor's chunks (src/README.md, adafactor_sumsq): float32 (chunks,)."""
    grad, handles = _adafactor_handles("adafactor_sumsq", grad, rc, v)
    sums = NDArray._empty((grad.size // (n * cols) * -(-n // rows_per_chunk),), grad.device, "float32")
    grad.device.mod.adafactor_sumsq(grad._handle, *handles, sums._handle, rc is not None, first, n, cols,
                                    rows_per_chunk, float(beta2), float(eps1))
    return sums


def adafactor_step(theta, grad, rc, v, m, first_v, first_m, n, cols, beta2, eps1, scale, beta1, lr, weight_decay):
    """Adafactor's update in one pass, written into theta, the full v (rc None) and m (None: no first moment) in
    place (src/README.md, adafactor_step); rc, v as adafactor_sumsq's."""
    written = (("theta", theta),) + ((("m", m),) if m is not None else ())
    grad, handles = _adafactor_handles("adafactor_step", grad, rc, v, written)
    theta.device.mod.adafactor_step(theta._handle, grad._handle, *handles, (grad if m is None else m)._handle,
                                    rc is not None, first_v, first_m, m is not None, n, cols, float(beta2),
                                    float(eps1), float(scale), float(beta1 or 0), float(lr), float(weight_decay))


def adam8bit_step(theta, grad, m_state, v_state, code_m, code_v, block_size, lr, beta1, beta2, eps, correction1,
                  correction2, weight_decay=0.0, out=None, rounding_seed=None):
    """One Adam step for a parameter whose moments are stored block-wise in 8 bits, fused into one pass per block
    (src/README.md, adam8bit_step): returns the new theta and updates `m_state` = (q_m, absmax_m) and
    `v_state` = (q_v, absmax_v) in place (q_v holds sqrt(v)). correction1/2 are Adam's 1 - beta^t; weight_decay
    as adam_step's. `out`: a compact array of theta's shape and dtype for the new theta (theta itself: in place).
    A bfloat16 theta (its grad bfloat16 or float32) is updated in place only (out=theta), each element widened,
    updated in float32 and rounded back: to nearest, or with `rounding_seed` stochastically, as
    round_stochastic(new, rounding_seed) rounds it."""
    fn = "adam8bit_step"
    (q_m, absmax_m), (q_v, absmax_v) = m_state, v_state
    named = [("theta", theta), ("grad", grad), ("q_m", q_m), ("absmax_m", absmax_m), ("q_v", q_v),
             ("absmax_v", absmax_v), ("code_m", code_m), ("code_v", code_v)]
    _ndarrays_on_one_device(fn, *named)
    for name, array in named[2:6]:
        if not array.is_compact():
            raise ValueError(f"{fn}: {name} is updated in place and must be compact")
    if grad.shape != theta.shape:
        raise ValueError(f"{fn}: grad has shape {grad.shape}, theta {theta.shape}")
    if out is None:
        out = NDArray._empty(theta.shape, theta.device, "float32")
    elif not out.is_compact() or out.shape != theta.shape or out.device != theta.device:
        raise ValueError(f"{fn}: out must be a compact array of theta's shape on its device")
    if theta.dtype == "bfloat16" and out is not theta:
        raise ValueError(f"{fn}: a bfloat16 theta is updated in place: pass out=theta")
    seed = -1 if rounding_seed is None else int(rounding_seed) & 0xFFFFFFFF
    theta.device.mod.adam8bit_step(
        (theta if out is theta else theta.compact())._handle, grad.compact()._handle, q_m._handle, absmax_m._handle,
        q_v._handle, absmax_v._handle, code_m.compact()._handle, code_v.compact()._handle, out._handle,
        int(block_size), float(lr), float(beta1), float(beta2), float(eps), float(correction1), float(correction2),
        float(weight_decay), seed)
    return out


def _layer_norm_dims(fn, x, w, *others):
    _ndarrays_on_one_device(fn, ("x", x), ("w", w), *others)
    n = x.shape[-1] if x.ndim else 0
    if n < 1 or w.shape != (n,):
        raise ValueError(f"{fn}: needs x (..., n) with n >= 1 and w (n,), got x {x.shape} and w {w.shape}")
    return x.size // n, n


def layer_norm(x, w, b, eps):
    """Fused layer norm over the last axis (src/README.md, layernorm_forward): per row, (x - mean) * rstd * w + b
    with rstd = 1 / sqrt(var + eps), in x's dtype (w and b (n,) of the same dtype); float32 arithmetic."""
    rows, n = _layer_norm_dims("layer_norm", x, w, ("b", b))
    if b.shape != (n,):
        raise ValueError(f"layer_norm: b must have shape ({n},), got {b.shape}")
    x, w, b = x.compact(), w.compact(), b.compact()
    out = NDArray._empty(x.shape, x.device, x.dtype)
    x.device.mod.layernorm_forward(x._handle, w._handle, b._handle, out._handle, rows, n, float(eps))
    return out


def layer_norm_backward(x, w, g, eps):
    """(dx, dw, db) of layer_norm for the output gradient g (x's shape), each row's mean and rstd recomputed."""
    rows, n = _layer_norm_dims("layer_norm_backward", x, w, ("g", g))
    if g.shape != x.shape:
        raise ValueError(f"layer_norm_backward: g must have x's shape {x.shape}, got {g.shape}")
    x, w, g = x.compact(), w.compact(), g.compact()
    dx, dw, db = (NDArray._empty(a.shape, x.device, x.dtype) for a in (x, w, w))
    x.device.mod.layernorm_backward(x._handle, w._handle, g._handle, dx._handle, dw._handle, db._handle, rows, n,
                                    float(eps))
    return dx, dw, db


# ----- offloading: host copies that overlap the device's work where the backend can ----------------------------
# A backend with asynchronous copies (cuda: pinned host memory, a copy stream; src/ndarray_backend_cuda.cu) gets
# them; elsewhere (cpu, the reference) these are plain synchronous copies, so callers need no second code path.
# offload.py also uses cpu()'s copy thread (`copy_thread`), whose rules (who frees what, when) are its own.
def copies_async(device):
    """Whether `device`'s backend copies to and from the host asynchronously (a copy stream beside its work)."""
    return callable(getattr(getattr(device, "mod", None), "copy_from_host_async", None))


def copy_thread(device):
    """The copy thread (copy_thread.CopyThread) that runs offloading's host copies beside `device`'s compute: on
    the C++ cpu() backend; None elsewhere (cuda has its copy stream, cpu_numpy copies synchronously)."""
    mod = getattr(device, "mod", None)
    if not callable(getattr(mod, "copy_thread_to_host", None)):
        return None
    thread = _COPY_THREADS.get(mod)
    if thread is None:
        thread = _COPY_THREADS[mod] = CopyThread(mod)
    return thread


_COPY_THREADS = {}  # backend module -> its CopyThread


def to_host(a, out=None):
    """A host (NumPy) copy of `a` for offloading. On a device with asynchronous copies it goes into page-locked
    memory, into `out` when `out` (an earlier result) has a's shape and dtype, and it may still be running when
    this returns: call `wait_for_copies(a.device)` before reading it. Elsewhere a plain copy (`out` unused)."""
    if not copies_async(a.device):
        return a.numpy()
    a, numpy_dtype = a.compact(), DTYPES[a.dtype]
    if out is None or out.shape != a.shape or out.dtype != numpy_dtype:
        out = a.device.mod.pinned_empty(a.size, a.dtype).view(numpy_dtype).reshape(a.shape)
    a.device.mod.copy_to_host_async(a._handle, out)
    return out


def host_empty(nbytes, device):
    """An uninitialized uint8 host (NumPy) array of `nbytes` for copies to and from `device`: page-locked on a
    device with asynchronous copies (so they run on the copy stream beside the device's work; allocating one is
    slow, so callers keep and reuse them: offload.HostPool), plain host memory elsewhere."""
    if copies_async(device):
        return device.mod.pinned_empty(nbytes, "uint8")
    return np.empty(nbytes, dtype=np.uint8)


def copy_to_host(a, out):
    """Copy `a` into `out`, a host (NumPy) array of a's shape and dtype that the caller reuses, and return `out`.
    On a device with asynchronous copies (`out` from `host_empty`, page-locked) the copy is queued on the copy
    stream and may still be running: the device's later work waits for it, so `a` may be freed at once and a copy
    back (`from_host_async`) queued behind it reads what it wrote, but the host must call `wait_for_copies` before
    it reads `out` itself. Elsewhere the copy is done on return, straight into `out` (no host array made per copy:
    offload.py's pool relies on it)."""
    if not copies_async(a.device):
        return a.numpy_into(out)
    a.device.mod.copy_to_host_async(a.compact()._handle, out)
    return out


def from_host_async(host, device):
    """(NDArray on `device` holding the NumPy array `host`, ready): with asynchronous copies the copy is only
    queued, and `ready()` must be called before the array is first used (the device then waits for the copy, not
    the host, and work queued before `ready()` overlaps it); elsewhere the copy is done and `ready` does nothing."""
    dtype = dtype_name(host.dtype)
    if not copies_async(device):
        return NDArray(host, device=device, dtype=dtype), lambda: None
    out = NDArray._empty(host.shape, device, dtype)
    event = device.mod.copy_from_host_async(np.ascontiguousarray(host), out._handle)
    return out, lambda: device.mod.wait_copy(event)


def wait_for_copies(device):
    """Block until every host copy `to_host` started on `device` is complete (nothing to wait for elsewhere)."""
    if copies_async(device):
        device.mod.synchronize_copies()


def empty(shape, dtype="float32", device=None):
    return (device or default_device()).empty(shape, dtype)


def full(shape, fill_value, dtype="float32", device=None):
    return (device or default_device()).full(shape, fill_value, dtype)


def zeros(shape, dtype="float32", device=None):
    return (device or default_device()).full(shape, 0.0, dtype, fn="zeros")


def broadcast_to(a, shape):
    return a.broadcast_to(shape)


def reshape(a, new_shape):
    return a.compact().reshape(new_shape)


def transpose(a, axes):
    return a.permute(axes)


def maximum(a, b):
    return a.maximum(b)


def log(a):
    return a.log()


def exp(a):
    return a.exp()


def tanh(a):
    return a.tanh()


def activation(a, kind):
    """f(a) for f in "gelu", "gelu_tanh", "silu" (NDArray.activation)."""
    return a.activation(kind)


def activation_grad(a, grad, kind):
    """grad * f'(a) (NDArray.activation_grad)."""
    return a.activation_grad(grad, kind)


def matmul(a, b):
    return a @ b


def copy(a):
    """A compact copy of `a` in a new buffer (a broadcast view written out once)."""
    return a.copy()


def add_matmul(out, a, b):
    """out += a @ b in place, without a temporary (NDArray.add_matmul); returns out."""
    return out.add_matmul(a, b)


def sum(a, axis=None, keepdims=False):
    return a.sum(axis=axis, keepdims=keepdims)


def logsumexp(a, axis=None, keepdims=False):
    return a.logsumexp(axis=axis, keepdims=keepdims)


def max(a, axis=None, keepdims=False):
    return a.max(axis=axis, keepdims=keepdims)


def flip(a, axes):
    return a.flip(axes)


def pad(a, axes):
    return a.pad(axes)


def stack(arrays, axis=0):
    arrays = list(arrays)
    dtype = functools.reduce(promote_types, [a.dtype for a in arrays])  # as every op on mixed dtypes
    arrays = [a if a.dtype == dtype else a.astype(dtype) for a in arrays]
    shape = arrays[0].shape
    if any(a.shape != shape for a in arrays):
        raise ValueError(f"stack: all arrays need one shape, got {[a.shape for a in arrays]}")
    axis = _normalize_axis(axis, len(shape) + 1, "stack")
    out = empty(shape[:axis] + (len(arrays),) + shape[axis:], dtype=arrays[0].dtype, device=arrays[0].device)
    for i, a in enumerate(arrays):
        out[(slice(None),) * axis + (i,)] = a
    return out


def split(a, axis=0):
    axis = _normalize_axis(axis, a.ndim, "split")
    return tuple(a[(slice(None),) * axis + (i,)].compact() for i in range(a.shape[axis]))


def take_rows(table, ids):
    """table (n, d), ids (k,) of integer values -> (k, d): row ids[i] of the table."""
    if ids.device != table.device:
        raise ValueError(f"take_rows: table on {table.device} but ids on {ids.device}")
    ids = ids.compact()
    out = NDArray.make((ids.size, table.shape[1]), device=table.device, dtype=table.dtype)
    table.device.mod.take_rows(table.compact()._handle, ids._handle, out._handle, table.shape[1])
    return out


def scatter_add_rows(rows, ids, num_rows):
    """The adjoint of take_rows: a (num_rows, d) array of zeros with rows[i] added at row ids[i]."""
    if ids.device != rows.device:
        raise ValueError(f"scatter_add_rows: rows on {rows.device} but ids on {ids.device}")
    out = zeros((num_rows, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    rows.device.mod.scatter_add_rows(rows.compact()._handle, ids.compact()._handle, out._handle, rows.shape[1])
    return out


def take_along_rows(table, ids):
    """table (n, c), ids (n,) of integer values in [0, c) -> (n,): table[i, ids[i]]."""
    if ids.device != table.device:
        raise ValueError(f"take_along_rows: table on {table.device} but ids on {ids.device}")
    if table.ndim != 2 or ids.shape != (table.shape[0],):
        raise ValueError(f"take_along_rows: need table (n, c) and ids (n,), got {table.shape} and {ids.shape}")
    out = NDArray.make((table.shape[0],), device=table.device, dtype=table.dtype)
    table.device.mod.take_along_rows(table.compact()._handle, ids.compact()._handle, out._handle, table.shape[1])
    return out


def scatter_along_rows(values, ids, num_cols):
    """The adjoint of take_along_rows: a (n, num_cols) array of zeros with values[i] at [i, ids[i]]."""
    if ids.device != values.device:
        raise ValueError(f"scatter_along_rows: values on {values.device} but ids on {ids.device}")
    out = zeros((values.shape[0], num_cols), dtype=values.dtype, device=values.device)
    values.device.mod.scatter_along_rows(values.compact()._handle, ids.compact()._handle, out._handle, num_cols)
    return out


def softmax_xent_grad(logits, ids, g):
    """logits (n, c), ids (n,), g (n,) -> (n, c): g[i] * (softmax(logits[i]) - onehot(ids[i])), fused."""
    if ids.device != logits.device or g.device != logits.device:
        raise ValueError(f"softmax_xent_grad: logits on {logits.device}, ids on {ids.device}, g on {g.device}")
    n = logits.shape[0] if logits.ndim == 2 else -1
    if logits.ndim != 2 or ids.shape != (n,) or g.shape != (n,):
        raise ValueError(f"softmax_xent_grad: need logits (n, c), ids (n,) and g (n,), got {logits.shape}, "
                         f"{ids.shape} and {g.shape}")
    out = NDArray.make(logits.shape, device=logits.device, dtype=logits.dtype)
    logits.device.mod.softmax_xent_grad(logits.compact()._handle, ids.compact()._handle, g.compact()._handle,
                                        out._handle, logits.shape[1])
    return out


def _attention_dims(fn, q, k, v):
    """(batch, t_q, t_k, d, d_v) of q (..., t_q, d), k (..., t_k, d), v (..., t_k, d_v) with one batch shape."""
    _ndarrays_on_one_device(fn, ("q", q), ("k", k), ("v", v))
    if (min(q.ndim, k.ndim, v.ndim) < 2 or q.shape[:-2] != k.shape[:-2] or k.shape[:-1] != v.shape[:-1]
            or q.shape[-1] != k.shape[-1]):
        raise ValueError(f"{fn}: needs q (..., T_q, D), k (..., T_k, D), v (..., T_k, D_v) with one batch shape, "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise TypeError(f"{fn}: q, k, v need one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _require_float(fn, q.dtype)
    return prod(q.shape[:-2]), q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]


def dropout(a, p, seed):
    """a · m / (1 - p), m a counter-based mask: element i kept by a hash of (seed, i) (src/README.md, dropout), so
    the same seed gives the same mask on every backend and call."""
    a = a.compact()
    out = NDArray._empty(a.shape, a.device, a.dtype)
    a.device.mod.dropout(a._handle, out._handle, float(p), int(seed) & 0xFFFFFFFF)
    return out


def attention_forward(q, k, v, scale, causal=False, dropout_p=0.0, seed=0):
    """Fused attention (FlashAttention-2's tiled forward): (out, lse) for q (..., T_q, D), k (..., T_k, D),
    v (..., T_k, D_v) of one floating dtype. out (..., T_q, D_v) = softmax(scale q k^T + mask) v in that dtype,
    lse (..., T_q) float32 the log-sum-exp of each score row; the T_q x T_k scores exist one tile at a time.
    causal: query i sees keys j <= i + T_k - T_q. dropout_p > 0 drops probabilities by a hash of (seed, index)."""
    dims = _attention_dims("attention_forward", q, k, v)
    q, k, v = q.compact(), k.compact(), v.compact()
    out = NDArray._empty(q.shape[:-1] + (v.shape[-1],), q.device, q.dtype)
    lse = NDArray._empty(q.shape[:-1], q.device, "float32")
    q.device.mod.attention_forward(q._handle, k._handle, v._handle, out._handle, lse._handle, *dims, float(scale),
                                   bool(causal), float(dropout_p), int(seed) & 0xFFFFFFFF)
    return out, lse


def attention_backward(q, k, v, out, lse, dout, dlse, scale, causal=False, dropout_p=0.0, seed=0):
    """(dq, dk, dv) of attention_forward's (out, lse) for their gradients dout and dlse, the probabilities recomputed
    tile by tile (FlashAttention-2's backward). A float32 scratch of one value per query row (delta) is the only
    other array it allocates (and a float32 copy of dlse where that is not compact float32)."""
    dims = _attention_dims("attention_backward", q, k, v)
    fn = "attention_backward"
    _ndarrays_on_one_device(fn, ("q", q), ("out", out), ("lse", lse), ("dout", dout), ("dlse", dlse))
    row_shape = q.shape[:-1]
    if out.shape != row_shape + (v.shape[-1],) or dout.shape != out.shape or lse.shape != row_shape \
            or dlse.shape != row_shape:
        raise ValueError(f"{fn}: needs out and dout {row_shape + (v.shape[-1],)}, lse and dlse {row_shape}, got "
                         f"{out.shape}, {dout.shape}, {lse.shape}, {dlse.shape}")
    q, k, v, out, dout = (a.compact() for a in (q, k, v, out, cast_like(dout, q)))
    lse, dlse = (a.compact() if a.dtype == "float32" else a.astype("float32") for a in (lse, dlse))
    delta = NDArray._empty(row_shape, q.device, "float32")
    dq, dk, dv = (NDArray._empty(a.shape, a.device, a.dtype) for a in (q, k, v))
    q.device.mod.attention_backward(q._handle, k._handle, v._handle, out._handle, lse._handle, dout._handle,
                                    dlse._handle, delta._handle, dq._handle, dk._handle, dv._handle, *dims,
                                    float(scale), bool(causal), float(dropout_p), int(seed) & 0xFFFFFFFF)
    return dq, dk, dv
