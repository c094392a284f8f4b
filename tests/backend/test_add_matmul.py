"""add_matmul: out += a @ b in place, the product's float32 sums added to out and rounded once, with no temporary
the allocator counts (the fused LM head sums dW = sum over chunks of h^T dz this way). Differential against NumPy in
float64 on every backend, for the packed kernel and the small-matrix paths, transposed operands read in place, and
16-bit arrays; bad arguments are clear errors."""
import numpy as np
import pytest

from needle import backend_ndarray as nd

from quantize_cases import DEVICES

SHAPES = [(3, 4, 5), (64, 104, 300), (1, 7, 9), (70, 33, 1)]  # small, packed, a single row, a single column


def operands(rng, m, n, p):
    return (rng.standard_normal((m, n)).astype(np.float32), rng.standard_normal((n, p)).astype(np.float32),
            rng.standard_normal((m, p)).astype(np.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("trans", [(False, False), (True, False), (False, True)], ids=["ab", "aTb", "abT"])
def test_add_matmul_adds_the_product_in_place(device, shape, trans):
    rng = np.random.default_rng(0)
    a, b, c = operands(rng, *shape)
    # a transposed operand is given as the transpose of a whole compact matrix (read in place by the backend)
    x = nd.array(a.T.copy(), device=device).permute((1, 0)) if trans[0] else nd.array(a, device=device)
    y = nd.array(b.T.copy(), device=device).permute((1, 0)) if trans[1] else nd.array(b, device=device)
    out = nd.array(c, device=device)
    before = nd.memory_stats(device)["current_bytes"]
    nd.reset_peak_memory_stats(device)
    assert nd.add_matmul(out, x, y) is out
    assert nd.memory_stats(device)["peak_bytes"] == before  # nothing allocated, not even for a moment
    want = c.astype(np.float64) + a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_add_matmul_twice_sums_two_products_and_rounds_a_bfloat16_out_once_per_call(device):
    rng = np.random.default_rng(1)
    a, b, c = operands(rng, 16, 40, 24)
    a16, b16 = (nd.array(v, device=device).astype("bfloat16") for v in (a, b))
    out = nd.array(c, device=device).astype("bfloat16")
    nd.add_matmul(out, a16, b16)
    exact = a16.astype("float32").numpy().astype(np.float64) @ b16.astype("float32").numpy().astype(np.float64)
    once = (out.astype("float32").numpy())
    start = nd.array(c, device=device).astype("bfloat16").astype("float32").numpy()
    np.testing.assert_allclose(once, start + exact, rtol=2e-2, atol=2e-2)  # one bfloat16 rounding of the sum
    f32 = nd.array(c, device=device)
    nd.add_matmul(nd.add_matmul(f32, nd.array(a, device=device), nd.array(b, device=device)),
                  nd.array(a, device=device), nd.array(b, device=device))
    np.testing.assert_allclose(f32.numpy(), c + 2 * (a.astype(np.float64) @ b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_add_matmul_errors_name_what_is_wrong(device):
    a = nd.array(np.ones((2, 3), np.float32), device=device)
    b = nd.array(np.ones((3, 4), np.float32), device=device)
    with pytest.raises(ValueError, match=r"add_matmul: out \(2, 5\) \+= \(2, 3\) @ \(3, 4\)"):
        nd.add_matmul(nd.array(np.zeros((2, 5), np.float32), device=device), a, b)
    with pytest.raises(ValueError, match=r"add_matmul: out must be compact"):
        nd.add_matmul(nd.array(np.zeros((4, 2), np.float32), device=device).permute((1, 0)), a, b)
    with pytest.raises(TypeError, match=r"add_matmul: out and operands of one dtype"):
        nd.add_matmul(nd.array(np.zeros((2, 4), np.float32), device=device), a.astype("bfloat16"),
                      b.astype("bfloat16"))
