"""Block-wise 8-bit quantization (Dettmers et al. 2021), the state format of 8-bit Adam.

The contract (src/README.md, `quantize_blockwise` / `dequantize_blockwise`) is written a second time as plain
Python, one element at a time (`quantize_cases.contract_quantize`), and the NumPy reference backend must give
exactly its bytes; every other backend (`cpu()` once its module has the functions, `cuda()` with a GPU) and the
NEEDLE_BACKEND=np face must give exactly the reference's bytes. Topics, in order:

1. the dynamic map (bitsandbytes' `create_dynamic_map`);
2. the reference against the plain-Python contract: sizes, block sizes, ties, NaN and inf, hypothesis;
3. the round trip: error bounded per block, zeros and the positive absmax element exact;
4. every device byte-identical to the reference; the NEEDLE_BACKEND=np face; `optim.quantization`'s helpers;
5. errors: wrong dtypes are TypeError, wrong sizes ValueError, naming the function and the array.
"""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from needle import backend_ndarray as nd
from needle import backend_numpy as np_face
from needle.toolbox.optim import quantization
from needle.toolbox.optim.quantization import dynamic_map

from quantize_cases import (DEVICES, REF, SIGNED, UNSIGNED, assert_same_bits, contract_dequantize, contract_quantize,
                            scaled_blocks)

REPO = os.path.join(os.path.dirname(__file__), "..", "..")
MAPS = [pytest.param(SIGNED, id="signed"), pytest.param(UNSIGNED, id="unsigned")]
HYPOTHESIS = settings(derandomize=True, max_examples=40, deadline=None, database=None,
                      suppress_health_check=[HealthCheck.too_slow])


# ----- helpers ------------------------------------------------------------------------------------------------------
def quantize_on(device, values, code, block_size):
    """(q, absmax) as numpy arrays, from the NDArray function on `device`."""
    q, absmax = nd.quantize_blockwise(nd.array(values, device=device),
                                      nd.array(code, device=device), block_size)
    assert q.dtype == "uint8" and absmax.dtype == "float32" and q.device == device and absmax.device == device
    assert q.shape == np.shape(values) and absmax.shape == (math.ceil(np.size(values) / block_size),)
    return q.numpy(), absmax.numpy()


def dequantize_on(device, q, absmax, code, block_size):
    out = nd.dequantize_blockwise(nd.array(q, device=device, dtype="uint8"), nd.array(absmax, device=device),
                                  nd.array(code, device=device), block_size)
    assert out.dtype == "float32" and out.shape == np.shape(q) and out.device == device
    return out.numpy()


def half_gap(code):
    """The largest error a value x in [code[0], 1] (or [-1, 1] for the signed map) can get, over absmax: half the
    largest gap between neighbouring code values, or the distance from -1 to the lowest value."""
    gaps = np.diff(code.astype(np.float64)) / 2
    return max(gaps.max(), code[0] + 1.0 if code[0] < 0 else 0.0)


# ===== 1. the dynamic map ===========================================================================================
@pytest.mark.parametrize("code", MAPS)
def test_map_has_256_strictly_ascending_float32_values_with_0_and_1(code):
    assert code.dtype == np.float32 and code.shape == (256,)
    assert np.all(np.diff(code) > 0)
    assert len(set(code.tolist())) == 256
    assert 0.0 in code and code[-1] == 1.0


def test_signed_map_is_symmetric_except_for_one():
    for v in SIGNED[SIGNED != 1.0]:
        assert -v in SIGNED, v
    assert -1.0 not in SIGNED
    assert SIGNED[0] == np.float32(-(1 - 0.9 / 128)) and SIGNED[-2] == np.float32(1 - 0.9 / 128)


def test_unsigned_map_is_non_negative():
    assert UNSIGNED.min() == 0.0 and UNSIGNED[-2] == np.float32(1 - 0.9 / 256)


@pytest.mark.parametrize("signed", [True, False])
def test_map_spends_twice_the_points_on_each_next_decade(signed):
    """Seven decades 1e-6 ... 1e0 of fractions in [0.1, 1]: 1, 2, ..., 64 points each (signed: per sign) or
    2, 4, ..., 128 (unsigned); plus 0 and 1. The smallest positive value is the first decade's first midpoint."""
    code = dynamic_map(signed).astype(np.float64)
    positive = code[(code > 0) & (code < 1)]
    edges = 10.0 ** np.arange(-7, 1)  # decade d holds (1e-7, 1e-6], ... values: fractions in [0.1, 1]
    counts = np.histogram(positive, bins=edges)[0]
    np.testing.assert_array_equal(counts, [2**d if signed else 2 ** (d + 1) for d in range(7)])
    assert positive.min() == pytest.approx(1e-6 * (0.1 + 0.9 / (2 if signed else 4)), rel=1e-6)
    assert np.all(dynamic_map(signed) == dynamic_map(signed))  # deterministic


# ===== 2. the reference against the contract, in plain Python =====================================================
@pytest.mark.parametrize("code", MAPS)
@pytest.mark.parametrize("n,block_size", [(0, 4), (1, 1), (7, 1), (10, 3), (40, 7), (64, 64), (70, 64), (5, 256),
                                          (300, 256)])
def test_reference_matches_the_contract(code, n, block_size):
    rng = np.random.default_rng(n * 1000 + block_size)
    values = scaled_blocks(rng, n, block_size, square=code is UNSIGNED)
    q, absmax = quantize_on(REF, values, code, block_size)
    expected_q, expected_absmax = contract_quantize(values, code, block_size)
    assert_same_bits(q, expected_q)
    np.testing.assert_array_equal(absmax, expected_absmax)  # (the contract leaves NaN's payload open)
    assert_same_bits(dequantize_on(REF, q, absmax, code, block_size), contract_dequantize(q, absmax, code, block_size))


@pytest.mark.parametrize("code", MAPS)
def test_ties_go_to_the_lower_index(code):
    """x exactly halfway between code[j] and code[j + 1] (both float32 subtractions equal) quantizes to j; one ulp
    above, to whichever the rule says."""
    pairs = [(j, np.float32((np.float64(code[j]) + np.float64(code[j + 1])) / 2)) for j in range(255)]
    ties = [(j, mid) for j, mid in pairs if code[j + 1] - mid == mid - code[j]]
    assert len(ties) > 100
    values = np.array([1.0] + [mid for _, mid in ties], dtype=np.float32)  # absmax 1: x is the value itself
    q, absmax = quantize_on(REF, values, code, values.size)
    assert absmax[0] == 1.0
    np.testing.assert_array_equal(q[1:], [j for j, _ in ties])
    above = np.concatenate([[1.0], np.nextafter(values[1:], np.float32(np.inf))]).astype(np.float32)
    assert_same_bits(quantize_on(REF, above, code, above.size)[0], contract_quantize(above, code, above.size)[0])


def test_nan_and_inf():
    """A NaN makes its block's absmax NaN, every x of the block NaN and so index 0 (dequantized: NaN). An inf makes
    absmax inf: finite values give x = ±0 (the index of 0) and ±inf gives inf / inf = NaN, index 0. A block of
    zeros has absmax 0 and x = 0. Other blocks are untouched."""
    zero = int(np.flatnonzero(SIGNED == 0)[0])
    values = np.array([1.0, np.nan, -2.0, 0.5,      # block 0: NaN
                       3.0, np.inf, -1.0, -np.inf,  # block 1: inf
                       0.0, -0.0, 0.0, 0.0,         # block 2: zeros (-0.0 is 0 too)
                       4.0, -2.0, 1.0, 0.0], dtype=np.float32)
    q, absmax = quantize_on(REF, values, SIGNED, 4)
    assert np.isnan(absmax[0]) and absmax[1] == np.inf and absmax[2] == 0.0 and absmax[3] == 4.0
    np.testing.assert_array_equal(q[:12], [0, 0, 0, 0, zero, 0, zero, 0, zero, zero, zero, zero])
    assert_same_bits(q, contract_quantize(values, SIGNED, 4)[0])
    out = dequantize_on(REF, q, absmax, SIGNED, 4)
    assert np.all(np.isnan(out[:4])) and np.all(out[8:12] == 0.0)
    assert out[12] == 4.0 and out[15] == 0.0 and abs(out[13] + 2.0) <= 4.0 * half_gap(SIGNED)
    assert_same_bits(out, contract_dequantize(q, absmax, SIGNED, 4))


def test_block_size_one_stores_each_value_in_its_absmax():
    values = np.array([3.0, -0.25, 0.0, 7.5, -np.inf], dtype=np.float32)
    q, absmax = quantize_on(REF, values, SIGNED, 1)
    np.testing.assert_array_equal(absmax, [3.0, 0.25, 0.0, 7.5, np.inf])
    np.testing.assert_array_equal(SIGNED[q[:4]], [1.0, SIGNED[0], 0.0, 1.0])  # -1 becomes the lowest value


@HYPOTHESIS
@given(values=hnp.arrays(np.float32, st.integers(0, 40), elements=st.floats(width=32)),
       block_size=st.integers(1, 50), signed=st.booleans())
def test_reference_matches_the_contract_on_random_arrays(values, block_size, signed):
    code = SIGNED if signed else UNSIGNED
    q, absmax = quantize_on(REF, values, code, block_size)
    expected_q, expected_absmax = contract_quantize(values, code, block_size)
    assert_same_bits(q, expected_q)
    np.testing.assert_array_equal(absmax, expected_absmax)  # (the contract leaves NaN's payload open)
    assert_same_bits(dequantize_on(REF, q, absmax, code, block_size), contract_dequantize(q, absmax, code, block_size))


# ===== 3. the round trip ============================================================================================
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("code", MAPS)
@pytest.mark.parametrize("block_size", [1, 5, 256])
def test_round_trip_error_is_bounded_per_block(device, code, block_size):
    """|x - dequantize(quantize(x))| <= absmax_b * (half the largest code gap), plus the rounding of x / absmax
    (2^-24) and of the product; zeros come back as zeros and each block's positive absmax element exactly."""
    rng = np.random.default_rng(block_size)
    n = 3 * 256 + 17
    values = scaled_blocks(rng, n, block_size, square=code is UNSIGNED)
    q, absmax = quantize_on(device, values, code, block_size)
    out = dequantize_on(device, q, absmax, code, block_size)
    per_element = np.repeat(absmax.astype(np.float64), block_size)[:n]
    error = np.abs(out.astype(np.float64) - values)
    assert np.all(error <= per_element * (half_gap(code) + 2.0**-22))
    np.testing.assert_array_equal(out[values == 0], 0.0)
    for b in range(absmax.size):
        block = values[b * block_size:(b + 1) * block_size]
        k = b * block_size + int(np.argmax(np.abs(block)))
        if values[k] > 0:
            assert out[k] == values[k] == absmax[b]


# ===== 4. devices, the np face, optim.quantization ==================================================================
def device_cases():
    rng = np.random.default_rng(7)
    yield scaled_blocks(rng, 5000, 256), 256
    yield scaled_blocks(rng, 1000, 64, square=True), 64
    yield scaled_blocks(rng, 257, 1), 1
    yield scaled_blocks(rng, 300, 4096), 4096  # one block, larger than a thread block
    yield np.array([np.nan, 1.0, -np.inf, 2.0, 0.0, -0.0, 5.0, np.inf, 3.0], dtype=np.float32), 2
    yield np.zeros(0, dtype=np.float32), 256
    mids = (SIGNED[:-1].astype(np.float64) + SIGNED[1:]) / 2  # ties and near-ties
    yield np.concatenate([[1.0], mids, np.nextafter(mids.astype(np.float32), np.float32(2))]).astype(np.float32), 600


@pytest.mark.parametrize("device", DEVICES)
def test_every_device_gives_the_reference_bytes(device):
    for values, block_size in device_cases():
        for code in (SIGNED, UNSIGNED):
            ref_q, ref_absmax = quantize_on(REF, values, code, block_size)
            q, absmax = quantize_on(device, values, code, block_size)
            assert_same_bits(q, ref_q)
            assert_same_bits(absmax, ref_absmax)
            assert_same_bits(dequantize_on(device, q, absmax, code, block_size),
                             dequantize_on(REF, q, absmax, code, block_size))


@pytest.mark.parametrize("device", DEVICES)
def test_views_are_quantized_in_row_major_order(device):
    """A non-compact array (a transpose) is quantized as its compact copy, and q keeps the array's shape."""
    values = scaled_blocks(np.random.default_rng(1), 12 * 20, 16).reshape(12, 20)
    code = nd.array(SIGNED, device=device)
    q, absmax = nd.quantize_blockwise(nd.array(values, device=device).permute((1, 0)), code, 16)
    expected_q, expected_absmax = contract_quantize(values.T, SIGNED, 16)
    assert q.shape == (20, 12)
    assert_same_bits(q.numpy().reshape(-1), expected_q)
    assert_same_bits(absmax.numpy(), expected_absmax)
    out = nd.dequantize_blockwise(q.permute((1, 0)), absmax, code, 16)  # q viewed back: dequantized as (12, 20)
    assert out.shape == (12, 20)
    assert_same_bits(out.numpy().reshape(-1),
                     contract_dequantize(q.permute((1, 0)).numpy(), expected_absmax, SIGNED, 16))


def test_np_face_equals_the_reference():
    for values, block_size in device_cases():
        values = values.reshape(-1, 1) if values.size % 2 else values.reshape(2, -1)  # shapes are kept
        for code in (SIGNED, UNSIGNED):
            q, absmax = np_face.quantize_blockwise(values, code, block_size)
            ref_q, ref_absmax = quantize_on(REF, values, code, block_size)
            assert_same_bits(q, ref_q)
            assert_same_bits(absmax, ref_absmax)
            assert_same_bits(np_face.dequantize_blockwise(q, absmax, code, block_size),
                             dequantize_on(REF, q, absmax, code, block_size))


def test_optim_quantization_under_the_np_backend():
    """quantization.quantize / dequantize with NEEDLE_BACKEND=np (read at import: a fresh interpreter)."""
    script = ("import numpy as np; from needle.toolbox.optim import quantization as Q\n"
              "x = np.linspace(-3, 2, 1000, dtype=np.float32).reshape(10, 100) ** 3\n"
              "q, m = Q.quantize(x, Q.dynamic_map())\n"
              "assert isinstance(q, np.ndarray) and q.shape == (10, 100) and q.dtype == np.uint8, q\n"
              "print(q.tobytes().hex(), m.tobytes().hex(), Q.dequantize(q, m, Q.dynamic_map()).tobytes().hex())\n")
    env = dict(os.environ, NEEDLE_BACKEND="np", PYTHONPATH=os.path.join(REPO, "python"))
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    q_hex, absmax_hex, out_hex = result.stdout.split()
    x = np.linspace(-3, 2, 1000, dtype=np.float32).reshape(10, 100) ** 3
    q, absmax = quantize_on(REF, x, SIGNED, 256)
    assert q_hex == q.tobytes().hex() and absmax_hex == absmax.tobytes().hex()
    assert out_hex == dequantize_on(REF, q, absmax, SIGNED, 256).tobytes().hex()


@pytest.mark.parametrize("device", DEVICES)
def test_quantization_helpers_take_the_code_from_numpy_or_on_the_device(device):
    code = quantization.device_code(SIGNED, device)
    assert isinstance(code, nd.NDArray) and code.device == device and code.dtype == "float32"
    assert quantization.device_code(code, device) is code  # already there: kept
    np.testing.assert_array_equal(code.numpy(), SIGNED)
    values = scaled_blocks(np.random.default_rng(2), 600, 256).reshape(20, 30)
    x = nd.array(values, device=device)
    q, absmax = quantization.quantize(x, SIGNED)  # block_size 256, bitsandbytes' default
    assert quantization.BLOCK_SIZE == 256 and absmax.shape == (3,) and q.shape == (20, 30)
    expected_q, expected_absmax = contract_quantize(values, SIGNED, 256)
    assert_same_bits(q.numpy().reshape(-1), expected_q)
    assert_same_bits(absmax.numpy(), expected_absmax)
    out = quantization.dequantize(q, absmax, SIGNED)
    assert out.shape == (20, 30) and out.device == device
    assert_same_bits(out.numpy().reshape(-1), contract_dequantize(expected_q, expected_absmax, SIGNED, 256))


# ===== 5. errors ====================================================================================================
def test_ndarray_functions_reject_wrong_dtypes_sizes_and_devices():
    x = nd.array(np.ones(10, dtype=np.float32), device=REF)
    code = nd.array(SIGNED, device=REF)
    q, absmax = nd.quantize_blockwise(x, code, 4)
    with pytest.raises(TypeError, match=r"quantize_blockwise: .*got a float16"):
        nd.quantize_blockwise(x.astype("float16"), code, 4)
    with pytest.raises(TypeError, match=r"quantize_blockwise: .*code int32"):
        nd.quantize_blockwise(x, code.astype("int32"), 4)
    with pytest.raises(TypeError, match=r"quantize_blockwise: a must be an NDArray, got ndarray"):
        nd.quantize_blockwise(np.ones(10, dtype=np.float32), code, 4)
    with pytest.raises(ValueError, match=r"quantize_blockwise: code has 255 elements, expected 256"):
        nd.quantize_blockwise(x, nd.array(SIGNED[:255], device=REF), 4)
    with pytest.raises(ValueError, match=r"quantize_blockwise: block_size must be at least 1, got 0"):
        nd.quantize_blockwise(x, code, 0)
    with pytest.raises(TypeError):
        nd.quantize_blockwise(x, code, 2.5)
    with pytest.raises(TypeError, match=r"dequantize_blockwise: .*got q float32"):
        nd.dequantize_blockwise(x, absmax, code, 4)
    with pytest.raises(TypeError, match=r"dequantize_blockwise: .*absmax uint8"):
        nd.dequantize_blockwise(q, q, code, 4)
    with pytest.raises(ValueError, match=r"dequantize_blockwise: absmax has 3 elements, expected 4"):
        nd.dequantize_blockwise(q, absmax, code, 3)
    if nd.cpu().enabled():
        with pytest.raises(ValueError, match=r"quantize_blockwise: a is on cpu_numpy\(\) but code on cpu\(\)"):
            nd.quantize_blockwise(x, nd.array(SIGNED, device=nd.cpu()), 4)


@pytest.mark.parametrize("device", DEVICES)
def test_backend_functions_reject_wrong_dtypes_and_sizes(device):
    """The backends check again (a bug in ndarray.py must not become a crash): dtypes, then sizes."""
    mod = device.mod
    n, code = 10, mod.Array(256)
    a, out, absmax = mod.Array(n), mod.Array(n, "uint8"), mod.Array(3)
    mod.from_numpy(SIGNED, code)
    mod.fill(a, 1.0)
    mod.quantize_blockwise(a, code, out, absmax, 4)
    # Any wording that names the function and the array (and, for a size, both numbers) will do.
    for args, error, words in [
        ((a, code, mod.Array(n), absmax, 4), TypeError, r"quantize_blockwise\b.*\bout\b"),
        ((a, mod.Array(256, "float16"), out, absmax, 4), TypeError, r"quantize_blockwise\b.*\bcode\b"),
        ((a, code, out, mod.Array(2), 4), ValueError, r"quantize_blockwise\b.*\babsmax\b.*\b2\b.*\b3\b"),
        ((a, code, mod.Array(9, "uint8"), absmax, 4), ValueError, r"quantize_blockwise\b.*\bout\b.*\b9\b.*\b10\b"),
        ((a, mod.Array(128), out, absmax, 4), ValueError, r"quantize_blockwise\b.*\bcode\b.*\b128\b.*\b256\b"),
        ((a, code, out, absmax, 0), ValueError, r"quantize_blockwise\b.*\bblock_size\b"),
    ]:
        with pytest.raises(error, match=words):
            mod.quantize_blockwise(*args)
    result = mod.Array(n)
    mod.dequantize_blockwise(out, code, absmax, result, 4)
    for args, error, words in [
        ((a, code, absmax, result, 4), TypeError, r"dequantize_blockwise\b.*\bq\b"),
        ((out, code, absmax, mod.Array(n, "bfloat16"), 4), TypeError, r"dequantize_blockwise\b.*\bout\b"),
        ((out, code, absmax, result, 5), ValueError, r"dequantize_blockwise\b.*\babsmax\b.*\b3\b.*\b2\b"),
        ((out, code, absmax, mod.Array(11), 4), ValueError, r"dequantize_blockwise\b.*\bout\b.*\b11\b.*\b10\b"),
        ((out, code, absmax, result, -1), ValueError, r"dequantize_blockwise\b.*\bblock_size\b"),
    ]:
        with pytest.raises(error, match=words):
            mod.dequantize_blockwise(*args)


def test_np_face_rejects_wrong_dtypes_and_sizes():
    x = np.ones((2, 5), dtype=np.float32)
    with pytest.raises(TypeError, match=r"quantize_blockwise: .*got a float64"):
        np_face.quantize_blockwise(x.astype(np.float64), SIGNED, 4)
    with pytest.raises(ValueError, match=r"quantize_blockwise: code has 10 elements, expected 256"):
        np_face.quantize_blockwise(x, SIGNED[:10], 4)
    q, absmax = np_face.quantize_blockwise(x, SIGNED, 4)
    with pytest.raises(ValueError, match=r"dequantize_blockwise: absmax has 3 elements, expected 5"):
        np_face.dequantize_blockwise(q, absmax, SIGNED, 2)
    with pytest.raises(TypeError, match=r"dequantize_blockwise: .*got q int8"):
        np_face.dequantize_blockwise(q.astype(np.int8), absmax, SIGNED, 4)
