"""What test_dtypes.py (backend) and test_precision.py (toolbox) share: the dtypes, the tolerance per dtype, and
check_op, which checks an operation on the reference against the rule (float32 arithmetic rounded once to the
storage dtype) and a device against the reference.
"""

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, settings

from needle import backend_ndarray as nd

# How far a compiled backend (cpu, cuda) may be from the reference, per dtype: rtol = 1 ulp of the dtype at 1.0
# (machine epsilon, so at least one ulp of every normal value), plus a small atol for results near zero, where
# float32 accumulation order (sums, matmuls) and cancellation decide the last bits. float32 gets a few ulp:
# exp/log/tanh are within ~1-2 ulp of the exact result and sums/matmuls accumulate in another order.
TOLERANCE = {
    "float32": dict(rtol=8 * 2.0**-23, atol=1e-5),
    "float16": dict(rtol=2.0**-10, atol=1e-4),
    "bfloat16": dict(rtol=2.0**-7, atol=1e-3),
}
FLOATS = ["float32", "float16", "bfloat16"]
INTS = ["int8", "uint8", "int32"]
NP = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
      "int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8), "int32": np.dtype(np.int32)}
REF = nd.cpu_numpy()
CPU = nd.cpu() if nd.cpu().enabled() else nd.cpu_numpy()  # the device models train on
HYPOTHESIS = settings(derandomize=True, max_examples=25, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.too_slow])


# ----- helpers ------------------------------------------------------------------------------------------------------
def rounded(values, dtype):
    """float32 values rounded to `dtype` and back to float32: inputs every dtype holds exactly."""
    with np.errstate(over="ignore", invalid="ignore"):  # float16 overflow to inf is wanted here
        return np.asarray(values, dtype=np.float32).astype(NP[dtype]).astype(np.float32)


def oracle(values, dtype):
    """The rule: float32 results rounded once to `dtype` (ml_dtypes for bfloat16)."""
    with np.errstate(all="ignore"):
        return np.asarray(values, dtype=np.float32).astype(NP[dtype])


def as64(a):
    """An NDArray's (or numpy array's) values as float64, for comparisons."""
    return np.asarray(a.numpy() if isinstance(a, nd.NDArray) else a).astype(np.float64)


def assert_close(ours, expected, dtype):
    """`ours` (an NDArray) has `dtype` and is within TOLERANCE[dtype] of `expected` (NaN where it is NaN)."""
    assert isinstance(ours, nd.NDArray)
    assert ours.dtype == dtype, (ours.dtype, dtype)
    assert ours.numpy().dtype == NP[dtype]
    expected = as64(expected)
    assert ours.shape == expected.shape, (ours.shape, expected.shape)
    np.testing.assert_allclose(as64(ours), expected, equal_nan=True, **TOLERANCE[dtype])


def assert_exact(ours, expected, dtype):
    """`ours` (an NDArray) has `dtype` and exactly the values of `expected` (NaN where it is NaN)."""
    assert ours.dtype == dtype, (ours.dtype, dtype)
    assert ours.numpy().dtype == NP[dtype]
    np.testing.assert_array_equal(as64(ours), as64(expected))


def check_op(device, dtype, fn_nd, fn_np, arrays, exact_reference=True):
    """Apply `fn_nd` to the NDArrays built from `arrays` (float32 numpy arrays, already representable in `dtype`,
    or (array, view function) pairs) on the reference and on `device`:
    the reference must equal fn_np(float32 inputs) rounded to `dtype` (exactly for element-wise ops, within
    TOLERANCE for reductions and matmuls, whose float32 accumulation order is NumPy's), and `device` must be
    within TOLERANCE of the reference."""
    arrays = [a if isinstance(a, tuple) else (a, lambda v: v) for a in arrays]
    expected = oracle(fn_np(*[view(base) for base, view in arrays]), dtype)
    ref = fn_nd(*[view(nd.array(base, dtype=dtype, device=REF)) for base, view in arrays])
    if exact_reference:
        assert_exact(ref, expected, dtype)
    else:
        assert_close(ref, expected, dtype)
    if device != REF:
        ours = fn_nd(*[view(nd.array(base, dtype=dtype, device=device)) for base, view in arrays])
        assert_close(ours, ref.numpy(), dtype)
    return ref


def layout(shape, name):
    """(base shape, view function usable on numpy arrays and NDArrays) for a non-compact view of `shape`."""
    shape = tuple(shape)
    if name == "compact":
        return shape, lambda a: a
    if name == "permuted":  # stored with the axes reversed, then permuted back
        axes = tuple(reversed(range(len(shape))))
        return shape[::-1], lambda a: a.permute(axes) if isinstance(a, nd.NDArray) else a.transpose(axes)
    if name == "sliced":  # every other element of a bigger buffer, from an offset
        idx = tuple(slice(1, 1 + 2 * n, 2) for n in shape)
        return tuple(2 * n + 3 for n in shape), lambda a: a[idx]
    if name == "broadcast":  # the first axis repeated with stride 0
        return (1,) + shape[1:], lambda a: a.broadcast_to(shape) if isinstance(a, nd.NDArray) \
            else np.broadcast_to(a, shape)
    raise AssertionError(name)


def operand(rng, shape, name, dtype, kind="normal"):
    """(float32 base representable in dtype, view function) of the given layout."""
    base_shape, view = layout(shape, name)
    draw = {"normal": lambda s: rng.standard_normal(s),
            "positive": lambda s: rng.uniform(0.5, 2.0, s),
            "nonzero": lambda s: rng.uniform(0.5, 2.0, s) * rng.choice([-1.0, 1.0], s),
            "discrete": lambda s: rng.integers(-2, 3, s) * 0.5}[kind]  # many ties, for comparisons
    return rounded(draw(base_shape), dtype), view


def lowbias32_bits(values, seed):
    """round_stochastic's bits written from the contract's words alone (Python ints), for finite values."""
    out = []
    for i, v in enumerate(np.asarray(values, dtype=np.float32).view(np.uint32).tolist()):
        h = (i ^ ((seed * 0x9E3779B9) & 0xFFFFFFFF)) & 0xFFFFFFFF
        h ^= h >> 16
        h = (h * 0x7FEB352D) & 0xFFFFFFFF
        h ^= h >> 15
        h = (h * 0x846CA68B) & 0xFFFFFFFF
        h ^= h >> 16
        out.append(((v + (h & 0xFFFF)) & 0xFFFFFFFF) >> 16)
    return np.array(out, dtype=np.uint16)


def int_rule(values, dtype):
    """The contract: drop the fraction, saturate at the type's range, NaN -> 0."""
    info = np.iinfo(NP[dtype])
    wide = np.nan_to_num(np.asarray(values, np.float64), nan=0.0, posinf=info.max, neginf=info.min)
    return np.clip(np.trunc(wide), info.min, info.max).astype(NP[dtype])
