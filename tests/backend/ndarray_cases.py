"""What the NDArray tests share: views of every layout with their NumPy twins, the comparison, and the one table of
element-wise and scalar operations (test_ndarray.py, test_ndarray_ops.py and test_dtypes.py run them, in float32
against NumPy and in every dtype against the reference; the backends' strided entry points too)."""
import operator

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from needle import backend_ndarray as nd

HYPOTHESIS = settings(derandomize=True, max_examples=40, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.too_slow])
LAYOUTS = ["compact", "permuted", "sliced", "flipped", "broadcast"]

# name: (the NDArray operation, NumPy's, the operands to draw: "normal", "positive" (power's base), "nonzero" (a
# divisor) or "discrete" (many ties, for comparisons)). The names of the backends' ops where they have one.
EWISE_OPS = {
    "add": (operator.add, np.add, "normal"),
    "sub": (operator.sub, np.subtract, "normal"),
    "mul": (operator.mul, np.multiply, "normal"),
    "div": (operator.truediv, np.divide, "nonzero"),
    "power": (operator.pow, np.power, "positive"),
    "maximum": (lambda a, b: a.maximum(b), np.maximum, "normal"),
    "fn_maximum": (nd.maximum, np.maximum, "normal"),
    "eq": (operator.eq, np.equal, "discrete"),
    "ge": (operator.ge, np.greater_equal, "discrete"),
    "gt": (operator.gt, np.greater, "discrete"),
    "ne": (operator.ne, np.not_equal, "discrete"),
    "lt": (operator.lt, np.less, "discrete"),
    "le": (operator.le, np.less_equal, "discrete"),
}

# name: (array op Python scalar, the same in NumPy, the array to draw: "positive" for power and a scalar over it).
SCALAR_OPS = {
    "add": (lambda a, c: a + c, lambda a, c: a + c, "normal"),
    "radd": (lambda a, c: c + a, lambda a, c: c + a, "normal"),
    "sub": (lambda a, c: a - c, lambda a, c: a - c, "normal"),
    "rsub": (lambda a, c: c - a, lambda a, c: c - a, "normal"),
    "mul": (lambda a, c: a * c, lambda a, c: a * c, "normal"),
    "rmul": (lambda a, c: c * a, lambda a, c: c * a, "normal"),
    "div": (lambda a, c: a / c, lambda a, c: a / c, "normal"),
    "rdiv": (lambda a, c: c / a, lambda a, c: c / a, "positive"),
    "power": (lambda a, c: a**c, lambda a, c: a**c, "positive"),
    "neg": (lambda a, c: -a, lambda a, c: -a, "normal"),
    "maximum": (lambda a, c: a.maximum(c), np.maximum, "normal"),
    "eq": (lambda a, c: a == c, np.equal, "normal"),
    "ge": (lambda a, c: a >= c, np.greater_equal, "normal"),
    "gt": (lambda a, c: a > c, np.greater, "normal"),
}


def with_kernels(devices, setter):
    """(device, kernel set) parameters: each device with every kernel set its backend can switch to with `setter`
    (the C++ backend has one exp/log/tanh/sum/max and one matmul implementation per instruction set), the others
    with their one ("default"). For a fixture parametrized indirectly, which switches to it."""
    return [pytest.param(p.values[0], kernels, id=f"{p.id}-{kernels}") for p in devices
            for kernels in (["default", "generic", "avx2", "avx512"] if hasattr(p.values[0].mod, setter)
                            else ["default"])]


def element_strides(a):
    """NumPy's strides in elements (NDArray's unit)."""
    return tuple(s // a.itemsize for s in a.strides)


def assert_same(ours, expected, rtol=1e-5, atol=1e-6):
    assert isinstance(ours, nd.NDArray)
    assert ours.shape == expected.shape, (ours.shape, expected.shape)
    np.testing.assert_allclose(ours.numpy(), expected, rtol=rtol, atol=atol)


def make_view(shape, layout, device, rng, positive=False):
    """(NDArray, numpy array) with equal values of `shape`; the NDArray is a view with the given layout."""
    draw = (lambda s: rng.uniform(0.5, 2.0, s)) if positive else (lambda s: rng.standard_normal(s))
    shape = tuple(shape)
    if layout == "compact":
        a = draw(shape).astype(np.float32)
        return nd.array(a, device=device), a
    if layout == "permuted":  # stored with the axes reversed, then permuted back
        base = draw(shape[::-1]).astype(np.float32)
        axes = tuple(reversed(range(len(shape))))
        return nd.array(base, device=device).permute(axes), base.transpose(axes)
    if layout == "sliced":  # every other element of a bigger buffer, starting at an offset
        base = draw(tuple(2 * n + 3 for n in shape)).astype(np.float32)
        idx = tuple(slice(1, 1 + 2 * n, 2) for n in shape)
        return nd.array(base, device=device)[idx], base[idx]
    if layout == "flipped":  # negative strides
        base = draw(tuple(n + 1 for n in shape)).astype(np.float32)
        idx = tuple(slice(n - 1, None, -1) if n else slice(0, 0) for n in shape)
        return nd.array(base, device=device)[idx], base[idx]
    if layout == "broadcast":  # the first axis repeated with stride 0
        base = draw((1,) + shape[1:]).astype(np.float32)
        return nd.array(base, device=device).broadcast_to(shape), np.broadcast_to(base, shape)
    raise AssertionError(layout)
