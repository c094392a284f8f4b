"""The block-wise quantization contract in plain Python, the devices that implement it and a bit-exact comparison:
shared by test_quantize.py, test_adam_step.py and test_adam8bit_step.py."""
import math

import numpy as np

from needle import backend_ndarray as nd
from needle.toolbox.optim.quantization import dynamic_map

from conftest import DEVICES as ALL_DEVICES

REF = nd.cpu_numpy()
SIGNED, UNSIGNED = dynamic_map(signed=True), dynamic_map(signed=False)


def _has_quantization(device):
    return getattr(device.mod, "quantize_blockwise", None) is not None


# Every device whose backend implements the two functions (the reference always; cpu once the C++ module has them;
# cuda where a GPU is).
DEVICES = [p for p in ALL_DEVICES if p.id != "cpu" or _has_quantization(nd.cpu())]


def contract_quantize(values, code, block_size):
    """src/README.md's words, element by element, in plain Python (np.float32 only for the float32 arithmetic)."""
    values = [np.float32(v) for v in np.asarray(values, dtype=np.float32).reshape(-1)]
    table = [float(c) for c in code]  # float32 values are exact as Python floats: comparisons are the same
    q, absmax = [], []
    with np.errstate(invalid="ignore"):  # inf / inf
        for start in range(0, len(values), block_size):
            block = values[start:start + block_size]
            m = np.float32(0.0)
            for v in block:
                m = np.float32(math.nan) if math.isnan(v) or math.isnan(m) else max(m, abs(v))
            absmax.append(m)
            for v in block:
                x = np.float32(0.0) if m == 0 else v / m  # float32 division
                lo = max([j for j in range(256) if table[j] <= float(x)], default=0)
                hi = min(lo + 1, 255)
                q.append(hi if code[hi] - x < x - code[lo] else lo)  # float32 subtractions; a tie goes to lo
    return np.array(q, dtype=np.uint8), np.array(absmax, dtype=np.float32)


def contract_dequantize(q, absmax, code, block_size):
    with np.errstate(invalid="ignore"):  # 0 * inf
        return np.array([code[k] * absmax[i // block_size] for i, k in enumerate(q.reshape(-1))], dtype=np.float32)


def assert_same_bits(ours, expected):
    """Equal bytes (NaN payloads and the sign of zero included)."""
    ours, expected = np.asarray(ours), np.asarray(expected)
    assert ours.dtype == expected.dtype and ours.shape == expected.shape, (ours.dtype, ours.shape, expected.shape)
    np.testing.assert_array_equal(ours.view(np.uint8), expected.view(np.uint8))


def scaled_blocks(rng, n, block_size, square=False):
    """n values whose blocks have magnitudes from 1e-8 to 1e3 (as a moment's do), each block (of more than one
    element) with a 0."""
    scales = 10.0 ** rng.uniform(-8, 3, size=math.ceil(n / block_size))
    values = rng.standard_normal(n) * np.repeat(scales, block_size)[:n]
    values = values**2 if square else values
    if block_size > 1:
        values[::block_size] = 0.0
    return values.astype(np.float32)
