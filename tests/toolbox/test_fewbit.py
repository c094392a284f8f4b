"""fewbit.py: the fitted piecewise-constant derivatives of few-bit GELU and SiLU, and the kernels that pack an
input's codes (pack_codes) and scale a gradient by their levels (unpack_scale).

Rules checked here:
  1. the split is the optimum on its grid: a brute force over every split agrees with the dynamic program;
  2. each level is the density-weighted mean of f' over its interval (the best constant there);
  3. more bits never cost accuracy, and the error is what the table says it is;
  4. codes select the interval an input falls in; bad arguments name what was wrong;
  5. packed codes take ceil(n·bits / 8) bytes in the documented bit layout, the same bytes on every backend;
  6. unpack_scale is g times the level of each element's code, in every floating dtype;
  7. the kernels' bad arguments are clear errors naming the function;
  8. relu's derivative as a 1-bit mask is exact: the same forward and gradients as relu, to the bit, n/8 bytes,
     and its output no longer pinned exact by its own gradient (compress.py can compress it).
"""
import itertools
import math

import numpy as np
import pytest

import needle as ndl
from needle import autograd, checkpoint, nn, ops
from needle.toolbox import fewbit
from needle import backend_ndarray as nd
from needle.backend_ndarray import array_api
from needle.backend_ndarray.ndarray_backend_numpy import activation_derivative

from conftest import DEVICES

KINDS = ["gelu", "gelu_tanh", "silu"]


def grid(limit, points):
    x = np.linspace(-limit, limit, points)
    w = np.exp(-0.5 * x * x)
    return x, w / w.sum()


def split_error(w, d, edges):
    """The weighted squared error of f' around each interval's weighted mean, intervals [edges[i], edges[i+1])."""
    total = 0.0
    for a, b in zip(edges, edges[1:]):
        mean = np.sum(w[a:b] * d[a:b]) / np.sum(w[a:b])
        total += np.sum(w[a:b] * (d[a:b] - mean) ** 2)
    return total


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", [1, 2])
def test_rule_1_the_dynamic_program_finds_the_brute_force_optimum(kind, bits, monkeypatch):
    monkeypatch.setattr(fewbit, "GRID", 41)
    table = fewbit.derivative_table.__wrapped__(kind, bits)  # uncached: on the small grid
    x, w = grid(fewbit.LIMIT, 41)
    d = activation_derivative(kind, x)
    best = min(split_error(w, d, (0,) + cut + (41,)) for cut in itertools.combinations(range(1, 41), 2**bits - 1))
    assert table.expected_error == pytest.approx(best, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bits", fewbit.BITS)
def test_rule_2_each_level_is_the_weighted_mean_of_the_derivative_over_its_interval(kind, bits):
    table = fewbit.derivative_table(kind, bits)
    x, w = grid(fewbit.LIMIT, fewbit.GRID)
    d = activation_derivative(kind, x)
    codes = table.codes(x)
    assert len(table.levels) == 2**bits and len(table.boundaries) == 2**bits - 1
    assert list(table.boundaries) == sorted(table.boundaries)
    for code, level in enumerate(table.levels):
        inside = codes == code
        assert inside.any(), f"interval {code} is empty"
        assert level == pytest.approx(np.sum(w[inside] * d[inside]) / np.sum(w[inside]), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_rule_3_more_bits_approximate_better_and_the_error_is_the_tables(kind):
    tables = [fewbit.derivative_table(kind, bits) for bits in fewbit.BITS]
    errors = [t.expected_error for t in tables]
    assert all(a > b for a, b in zip(errors, errors[1:]))
    assert errors[0] < tables[0].variance  # one bit already beats the best constant
    x, w = grid(fewbit.LIMIT, fewbit.GRID)
    d = activation_derivative(kind, x)
    for t in tables:  # the quantized derivative's error, recomputed from the codes
        q = fewbit.quantized_derivative(kind, t.bits, x)
        assert np.sum(w * (d - q) ** 2) == pytest.approx(t.expected_error, rel=1e-9)
    # Monte Carlo under the stated distribution, far from the grid: the same error within sampling noise
    sample = np.random.default_rng(0).standard_normal(200_000)
    mc = np.mean((activation_derivative(kind, sample) - fewbit.quantized_derivative(kind, 3, sample)) ** 2)
    assert mc == pytest.approx(tables[2].expected_error, rel=0.05)


def test_rule_4_codes_pick_the_interval_and_bad_arguments_are_named():
    table = fewbit.derivative_table("silu", 2)
    b = table.boundaries
    x = np.array([-math.inf, b[0] - 1e-6, b[0], b[1], b[2] + 1.0, math.inf])
    assert table.codes(x).tolist() == [0, 0, 1, 2, 3, 3] and table.codes(x).dtype == np.uint8
    with pytest.raises(ValueError, match="derivative_table: bits must be one of"):
        fewbit.derivative_table("gelu", 5)
    with pytest.raises(ValueError, match="derivative_table: unknown activation 'tanh'"):
        fewbit.derivative_table("tanh", 2)


# ----- the kernels ------------------------------------------------------------------------------------------------
def packed(device, x, table):
    return array_api.pack_codes(nd.array(x, device=device), nd.array(np.float32(table.boundaries), device=device),
                                table.bits).numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", fewbit.BITS)
@pytest.mark.parametrize("n", [1, 7, 8, 13, 1000])
def test_rule_5_codes_are_packed_bits_per_element_in_the_documented_layout(device, bits, n):
    table = fewbit.derivative_table("gelu", bits)
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    got = packed(device, x, table)
    assert got.dtype == np.uint8 and got.shape == (-(-n * bits // 8),)
    stream = np.unpackbits(got, bitorder="little")  # bit j of the stream: bit j % 8 of byte j // 8
    codes = [sum(int(stream[i * bits + k]) << k for k in range(bits)) for i in range(n)]
    want = np.searchsorted(np.float32(table.boundaries), x, side="right")  # how many boundaries are <= x
    assert codes == want.tolist()
    assert not stream[n * bits:].any(), "the padding bits of the last byte are zero"


@pytest.mark.skipif(not nd.cpu().enabled(), reason="C++ backend not built (run `make`)")
@pytest.mark.parametrize("bits", [3, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rule_5_every_backend_packs_the_same_bytes(bits, dtype):
    rng = np.random.default_rng(bits)
    x = rng.standard_normal(4099).astype(np.float32)
    x[::97] = np.nan
    boundaries = np.sort(rng.standard_normal(2**bits - 1)).astype(np.float32)
    results = [array_api.pack_codes(nd.array(x, device=device).astype(dtype), nd.array(boundaries, device=device),
                                    bits).numpy() for device in (nd.cpu(), nd.cpu_numpy())]
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", fewbit.BITS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rule_6_unpack_scale_multiplies_by_each_codes_level(device, bits, dtype):
    table = fewbit.derivative_table("silu", bits)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 11)).astype(np.float32)
    g = nd.array(rng.standard_normal((5, 11)).astype(np.float32), device=device).astype(dtype)
    codes = nd.array(packed(device, x.reshape(-1), table), device=device, dtype="uint8")
    out = array_api.unpack_scale(codes, nd.array(np.float32(table.levels), device=device), g, bits)
    assert out.shape == (5, 11) and out.dtype == dtype
    want = g.numpy().astype(np.float32) * np.float32(table.levels)[table.codes(x)]
    np.testing.assert_array_equal(out.numpy(), want.astype(out.numpy().dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_rule_7_bad_kernel_arguments_name_the_function(device):
    a = nd.array(np.ones(10, np.float32), device=device)
    with pytest.raises(ValueError, match="pack_codes: bits must be in 1..8, got 9"):
        array_api.pack_codes(a, nd.array(np.zeros(3, np.float32), device=device), 9)
    with pytest.raises(ValueError, match="pack_codes: boundaries has 2 elements, expected 3"):
        array_api.pack_codes(a, nd.array(np.zeros(2, np.float32), device=device), 2)
    with pytest.raises(ValueError, match="unpack_scale: codes has 2 elements, expected 3"):
        array_api.unpack_scale(nd.array(np.zeros(2, np.uint8), device=device).astype("uint8"),
                               nd.array(np.zeros(4, np.float32), device=device), a, 2)


# ----- rule 8: relu's 1-bit mask ------------------------------------------------------------------------------
def test_rule_8_relus_table_is_its_exact_derivative():
    table = fewbit.derivative_table("relu", 1)
    x = np.array([-2.0, -1e-30, 0.0, 1e-40, 1e-30, 3.0])
    np.testing.assert_array_equal(fewbit.quantized_derivative("relu", 1, x), (x > 0).astype(float))
    assert table.expected_error == 0.0
    with pytest.raises(ValueError, match="relu's derivative is 0 or 1, one bit"):
        fewbit.derivative_table("relu", 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [False, True], ids=["relu", "linear+relu"])
def test_rule_8_a_relu_mask_gives_relus_numbers_to_the_bit(device, fused, rng):
    x_np = rng.standard_normal((6, 40)).astype(np.float32)
    x_np[0, :5] = 0.0  # relu'(0) = 0, as relu's gradient has it
    w_np = rng.standard_normal((40, 24)).astype(np.float32)
    g_np = rng.standard_normal((6, 24 if fused else 40)).astype(np.float32)

    def run(bits):
        x = ndl.Tensor(x_np, device=device, requires_grad=True)
        w = ndl.Tensor(w_np, device=device, requires_grad=True)
        y = ops.linear(x, w, activation="relu", activation_bits=bits) if fused else ops.relu(x, bits)
        (y * ndl.Tensor(g_np, device=device)).sum().backward()
        return y.numpy(), x.grad.numpy(), (w.grad.numpy() if fused else None), y
    exact, masked = run(None), run(1)
    for a, b in zip(exact[:3], masked[:3]):
        if a is not None:
            np.testing.assert_array_equal(a, b)
    node = masked[3].inputs[0]  # the tuple (relu(x), mask)
    assert node.cached_data[1].size == math.ceil(x_np.size * (24 if fused else 40) / 40 / 8)
    assert node.op.compressible_outputs == (0,)


def test_rule_8_compression_takes_a_masked_relus_output():
    """A ReLU model under compress(8): with the 1-bit mask, relu's output is compressed (its own gradient no longer
    reads it), so the step holds fewer bytes after forward, and the gradients stay close to the exact ones."""
    held, grads = {}, {}
    for bits in (None, 1):
        np.random.seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(bits=bits), nn.Linear(64, 64), nn.ReLU(bits=bits),
                              nn.Linear(64, 8))
        x = ndl.Tensor(np.random.RandomState(1).randn(128, 32).astype(np.float32), requires_grad=False)
        with autograd.lazy_mode(False):
            out = checkpoint.checkpoint(model, x, policy=checkpoint.compress(8))
            autograd.run_deferred([out])  # compression decides as backward starts: here, before measuring
            held[bits] = sum(b for _, reason, b in checkpoint.saved_residuals(out, exclude=model.parameters() + [x]))
            (out * out).sum().backward()
        grads[bits] = [p.grad.numpy() for p in model.parameters()]
    assert held[1] < 0.6 * held[None]
    for a, b in zip(grads[None], grads[1]):
        assert np.linalg.norm(a - b) <= 0.05 * np.linalg.norm(a)
