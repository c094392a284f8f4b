"""Block-wise 8-bit quantization of optimizer state (Dettmers et al. 2021, "8-bit Optimizers via Block-wise
Quantization"), as 8-bit Adam stores its two moments.

A tensor is cut into blocks of `block_size` consecutive elements (bitsandbytes uses 256). Each block keeps one
float32, its largest magnitude `absmax`, and each element one byte: the index of the value of a 256-entry `code`
nearest to element / absmax. Dequantizing is code[q] * absmax. Normalizing per block means one outlier only costs
the precision of its own block, and the dynamic code (below) spends its 256 values on seven decades of
magnitude, so both the large and the tiny entries of a moment keep about two significant digits.

    code = dynamic_map(signed=True)               # the first moment is signed, the second one is not
    q, absmax = quantize(m, code)                 # uint8 array of m's shape, float32 (ceil(m.size / 256),)
    m_again = dequantize(q, absmax, code)         # float32, |m - m_again| <= absmax * (largest code gap) / 2

The arithmetic is the backend's (`quantize_blockwise` / `dequantize_blockwise`, src/README.md), so every
device gives the same bytes.
"""
import numpy as np

from ...backend_selection import array_api, device_of

__all__ = ["BLOCK_SIZE", "dequantize", "device_code", "dynamic_map", "quantize"]

BLOCK_SIZE = 256  # bitsandbytes' block size for 8-bit optimizer state
DECADES = 7  # powers of ten the dynamic map spans: 1e-6, 1e-5, ..., 1e0


def dynamic_map(signed=True):
    """bitsandbytes' dynamic (tree) quantization map: 256 strictly ascending float32 values in [-1, 1]
    (signed) or [0, 1] (unsigned), for `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`.

    A value is a power of ten (the "exponent", 10^-6 ... 10^0) times a linear fraction in [0.1, 1]: the smaller
    the exponent, the fewer fraction points it gets. Decade d = 0..6 covers [0.1, 1] * 10^(d-6) with the
    midpoints of 2^d equal intervals of [0.1, 1] (signed) or of 2^(d+1) intervals (unsigned, which has no sign
    bit to pay for). So:

    - signed: 1 + 2 + 4 + ... + 64 = 127 positive values, their 127 negatives, 0 and 1: 256 values.
      Symmetric (-code is code) except for +1, which has no negative partner: the map runs from
      -0.99296875 (= -(1 - 0.9/128)) to 1. Smallest magnitude 5.5e-7 (= 1e-6 * (0.1 + 0.9/2)).
    - unsigned: 2 + 4 + ... + 128 = 254 positive values, 0 and 1: 256 values from 0 to 1; the smallest
      positive one is 3.25e-7 (= 1e-6 * (0.1 + 0.9/4)).

    Every value is distinct (each decade ends below where the next begins), so the map is strictly ascending
    and holds 0 and 1 exactly: zeros and a block's positive absmax element (x = 1) come back exactly. A negative
    absmax element (x = -1) comes back as -0.99296875 * absmax, half a top-decade step away. The values are
    computed in float64 and rounded once to float32; bitsandbytes computes them in float32 steps, so about a third
    of its table differs from this one by 1 or 2 units in the last place.
    """
    values = [0.0, 1.0]
    for d in range(DECADES):
        intervals = 2**d if signed else 2 ** (d + 1)
        fractions = 0.1 + 0.9 * (np.arange(intervals) + 0.5) / intervals  # midpoints of equal steps of [0.1, 1]
        decade = fractions * 10.0 ** (d - (DECADES - 1))
        values.extend(decade)
        if signed:
            values.extend(-decade)
    code = np.sort(np.array(values, dtype=np.float64)).astype(np.float32)
    assert code.size == 256, code.size  # 2 + 2 * 127 signed, 2 + 254 unsigned
    return code


def device_code(code, device):
    """`code` as a float32 array of the backend on `device`; an array of the backend already there is returned
    as it is. Callers that quantize every step keep the result (Adam8bit does, per device), so the 1 KiB table
    is not copied to the device for every parameter."""
    if not isinstance(code, np.ndarray) and device_of(code) == device:
        return code
    return array_api.array(np.asarray(code, dtype=np.float32), dtype="float32", device=device)


def quantize(array, code, block_size=BLOCK_SIZE):
    """float32 `array` (an array of the backend: NDArray, or numpy under NEEDLE_BACKEND=np) -> (q, absmax): uint8
    indices into `code` of the array's shape, and float32 absmax of shape (ceil(array.size / block_size),).
    `code` is a NumPy map such as `dynamic_map()` (or that map already on the array's device)."""
    return array_api.quantize_blockwise(array, device_code(code, device_of(array)), block_size)


def dequantize(q, absmax, code, block_size=BLOCK_SIZE):
    """The inverse of `quantize`: float32 code[q] * absmax of the block, of q's shape."""
    return array_api.dequantize_blockwise(q, absmax, device_code(code, device_of(q)), block_size)
