"""The fused 8-bit Adam kernel, `adam8bit_step` (src/README.md): dequantize both moments, Adam's update in float32,
requantize, in one pass per block.

The contract is written again here as plain Python, element by element (`contract_step`); the NumPy reference must
give exactly its bytes, and every other backend (cpu, cuda with a GPU) and the NEEDLE_BACKEND=np face exactly the
reference's. Then: `optim.Adam8bit` is this kernel with Adam's hyper-parameters (bit for bit), its first step is
Adam's first step (to float32 rounding), and bad arguments are clear errors.
"""
import math

import numpy as np
import pytest

import needle as ndl
from needle import backend_ndarray as nd
from needle import backend_numpy as np_face
from needle import optim
from needle.backend_ndarray.ndarray_backend_numpy import adam8bit_blocks

from quantize_cases import (DEVICES, REF, SIGNED, UNSIGNED, assert_same_bits, contract_dequantize, contract_quantize,
                            scaled_blocks)

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)


def corrections(t, beta1=0.9, beta2=0.999):
    return 1 - beta1**t, 1 - beta2**t


def contract_step(theta, grad, m_state, v_state, block_size, t, lr, beta1, beta2, eps, weight_decay=0.0):
    """src/README.md's adam8bit_step in words: float32 scalars, one rounding per operation."""
    f = np.float32
    c1, c2 = corrections(t, beta1, beta2)
    m_old = contract_dequantize(m_state[0], m_state[1], SIGNED, block_size)
    r_old = contract_dequantize(v_state[0], v_state[1], UNSIGNED, block_size)
    out, m_new, r_new = [], [], []
    with np.errstate(all="ignore"):
        for th, g, m, r in zip(theta.reshape(-1), grad.reshape(-1), m_old, r_old):
            g = g + th * f(weight_decay) if weight_decay else g
            m = m * f(beta1) + g * f(1 - beta1)
            v = r * r * f(beta2) + g * g * f(1 - beta2)
            out.append(th - m / f(c1) * f(lr) / (np.sqrt(v / f(c2)) + f(eps)))
            m_new.append(m)
            r_new.append(np.sqrt(v))
    return (np.array(out, dtype=np.float32).reshape(theta.shape), *contract_quantize(m_new, SIGNED, block_size),
            *contract_quantize(r_new, UNSIGNED, block_size))


def zero_state(n, block_size):
    blocks = math.ceil(n / block_size)
    return (np.zeros(n, np.uint8), np.zeros(blocks, np.float32)), (np.zeros(n, np.uint8), np.zeros(blocks, np.float32))


def step_on(device, theta, grad, m_state, v_state, block_size, t, in_place=False, weight_decay=0.0, **hyper):
    """One adam8bit_step through the NDArray function on `device`: numpy (theta, q_m, absmax_m, q_v, absmax_v)."""
    hyper = {**HYPER, **hyper}
    arrays = [nd.array(a, device=device, dtype=str(a.dtype)) for a in (*m_state, *v_state)]
    theta = nd.array(theta, device=device)
    out = nd.adam8bit_step(theta, nd.array(grad, device=device), tuple(arrays[:2]),
                           tuple(arrays[2:]), nd.array(SIGNED, device=device), nd.array(UNSIGNED, device=device),
                           block_size, hyper["lr"], hyper["beta1"], hyper["beta2"], hyper["eps"],
                           *corrections(t, hyper["beta1"], hyper["beta2"]), weight_decay=weight_decay,
                           out=theta if in_place else None)
    assert out.dtype == "float32" and out.shape == theta.shape and out.device == device
    return (out.numpy(), *(a.numpy() for a in arrays))


def three_steps(rng, n, block_size):
    """(theta, grad, m_state, v_state, t) for steps 1..3 of a parameter, the state carried by the reference."""
    theta = rng.standard_normal(n).astype(np.float32)
    m_state, v_state = zero_state(n, block_size)
    for t in (1, 2, 3):
        grad = scaled_blocks(rng, n, block_size)
        yield theta, grad, m_state, v_state, t
        theta, *state = step_on(REF, theta, grad, m_state, v_state, block_size, t)
        m_state, v_state = tuple(state[:2]), tuple(state[2:])


CASES = [(1, 1), (7, 3), (40, 8), (64, 64), (300, 256), (1000, 128)]


@pytest.mark.parametrize("n,block_size", CASES)
def test_reference_matches_the_contract(n, block_size):
    for theta, grad, m_state, v_state, t in three_steps(np.random.default_rng(n), n, block_size):
        expected = contract_step(theta, grad, m_state, v_state, block_size, t, **HYPER)
        for ours, want in zip(step_on(REF, theta, grad, m_state, v_state, block_size, t), expected):
            assert_same_bits(ours, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,block_size", [(7, 3), (300, 256), (70000, 256)])
def test_weight_decay_is_the_contracts_on_every_device_in_place_or_not(device, n, block_size):
    """g + theta * wd inside the kernel (the course's coupled decay, as optim.Adam adds it): the contract's bytes,
    also when out is theta itself (the kernel reads theta for the decay and writes it)."""
    for theta, grad, m_state, v_state, t in three_steps(np.random.default_rng(n), n, block_size):
        theta = theta.copy()
        theta[::9] = -0.0
        expected = (step_on(REF, theta, grad, m_state, v_state, block_size, t, weight_decay=0.05) if n > 300 else
                    contract_step(theta, grad, m_state, v_state, block_size, t, **HYPER, weight_decay=0.05))
        for in_place in (False, True):
            ours = step_on(device, theta, grad, m_state, v_state, block_size, t, in_place, weight_decay=0.05)
            for a, b in zip(ours, expected):
                assert_same_bits(a, b)
        decayed = grad + theta * np.float32(0.05)  # the decay outside, as the chunk path adds it
        for a, b in zip(step_on(device, theta, decayed, m_state, v_state, block_size, t), expected):
            assert_same_bits(a, b)


def test_reference_matches_the_contract_with_nan_inf_and_other_hyper_parameters():
    n, block_size = 24, 8
    rng = np.random.default_rng(5)
    theta, grad = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    grad[3], grad[12] = np.nan, np.inf  # block 0's absmax turns NaN, block 1's inf; block 2 stays finite
    hyper = dict(lr=0.5, beta1=0.0, beta2=0.5, eps=1e-3)
    m_state, v_state = zero_state(n, block_size)
    expected = contract_step(theta, grad, m_state, v_state, block_size, 2, **hyper)
    ours = step_on(REF, theta, grad, m_state, v_state, block_size, 2, **hyper)
    for a, b in zip(ours, expected):
        assert_same_bits(a, b)
    assert np.isnan(ours[2][0]) and ours[2][1] == np.inf and np.isfinite(ours[2][2])  # absmax_m
    assert np.isfinite(ours[0][16:]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,block_size", CASES + [(70000, 256), (5000, 4096)])
def test_every_device_gives_the_reference_bytes(device, n, block_size):
    for theta, grad, m_state, v_state, t in three_steps(np.random.default_rng(n), n, block_size):
        expected = step_on(REF, theta, grad, m_state, v_state, block_size, t)
        for ours, want in zip(step_on(device, theta, grad, m_state, v_state, block_size, t), expected):
            assert_same_bits(ours, want)


def test_np_face_equals_the_reference():
    for theta, grad, m_state, v_state, t in three_steps(np.random.default_rng(0), 600, 256):
        expected = step_on(REF, theta, grad, m_state, v_state, 256, t)
        m_state, v_state = tuple(a.copy() for a in m_state), tuple(a.copy() for a in v_state)
        shape = (20, 30)  # shapes are kept; the state is updated in place
        m_state = (m_state[0].reshape(shape), m_state[1])
        out = np_face.adam8bit_step(theta.reshape(shape), grad.reshape(shape), m_state, v_state, SIGNED, UNSIGNED,
                                    256, HYPER["lr"], HYPER["beta1"], HYPER["beta2"], HYPER["eps"], *corrections(t))
        assert out.shape == shape
        for ours, want in zip((out, *m_state, *v_state), expected):
            assert_same_bits(ours.reshape(-1), want.reshape(-1))


def test_the_kernel_does_not_depend_on_the_decomposition_of_the_reference():
    """adam8bit_blocks (the reference) written with quantize/dequantize: its first step from zero state is
    dequantize(0) = 0, so m = (1 - b1) g exactly, whatever the bytes were."""
    rng = np.random.default_rng(2)
    grad = rng.standard_normal(512).astype(np.float32)
    junk = (rng.integers(0, 256, 512).astype(np.uint8), np.zeros(2, np.float32))  # absmax 0: every byte means 0
    out, q_m, absmax_m, _, _ = adam8bit_blocks(np.zeros(512, np.float32), grad, *junk, *junk, SIGNED, UNSIGNED, 256,
                                               1.0, 0.9, 0.999, 0.0, *corrections(1))
    assert_same_bits(absmax_m, np.abs(grad * np.float32(0.1)).reshape(2, 256).max(axis=1))
    np.testing.assert_allclose(out, -np.sign(grad), rtol=1e-6)  # Adam's first step is lr * sign(g)


# ----- optim.Adam8bit runs this kernel -------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_adam8bit_is_the_kernel_with_adams_hyper_parameters(device):
    """Three steps of optim.Adam8bit with weight decay, bit for bit the reference kernel chained by hand."""
    rng = np.random.default_rng(3)
    shape, block_size, wd = (40, 100), 256, 0.01
    w = ndl.nn.Parameter(rng.standard_normal(shape).astype(np.float32), device=device)
    opt = optim.Adam8bit([w], lr=2e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=wd, block_size=block_size,
                         min_8bit_size=0)
    theta = w.numpy().reshape(-1)
    m_state, v_state = zero_state(theta.size, block_size)
    for t in (1, 2, 3):
        g = rng.standard_normal(shape).astype(np.float32)
        w.grad = ndl.Tensor(g, device=device)
        opt.step()
        grad = g.reshape(-1) + theta * np.float32(wd)  # the course's coupled weight decay, as Adam adds it
        theta, *state = adam8bit_blocks(theta, grad, *m_state, *v_state, SIGNED, UNSIGNED, block_size, 2e-3, 0.8,
                                        0.99, 1e-6, *corrections(t, 0.8, 0.99))
        m_state, v_state = tuple(state[:2]), tuple(state[2:])
        assert_same_bits(w.numpy().reshape(-1), theta)
        assert_same_bits(opt.m[w][0].numpy().reshape(-1), m_state[0])
        assert_same_bits(opt.v[w][1].numpy(), v_state[1])


def test_adam8bits_first_step_is_adams_first_step():
    """From zero moments nothing has been quantized yet: the first update is Adam's (to float32 rounding)."""
    rng = np.random.default_rng(4)
    init, g = rng.standard_normal((64, 80)).astype(np.float32), rng.standard_normal((64, 80)).astype(np.float32)
    results = []
    for make in (lambda ps: optim.Adam(ps, lr=1e-2), lambda ps: optim.Adam8bit(ps, lr=1e-2, min_8bit_size=0)):
        w = ndl.nn.Parameter(init.copy())
        w.grad = ndl.Tensor(g)
        make([w]).step()
        results.append(w.numpy())
    np.testing.assert_allclose(results[1], results[0], rtol=1e-6, atol=1e-7)
    assert not np.array_equal(results[0], init)


# ----- errors -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_backend_function_rejects_wrong_dtypes_and_sizes(device):
    mod = device.mod
    n, bs = 10, 4
    f32, u8 = (lambda k: mod.Array(k)), (lambda k: mod.Array(k, "uint8"))
    code_m, code_v = f32(256), f32(256)
    mod.from_numpy(SIGNED, code_m)
    mod.from_numpy(UNSIGNED, code_v)
    good = [f32(n), f32(n), u8(n), f32(3), u8(n), f32(3), code_m, code_v, f32(n)]
    for a in good[:2] + good[3:4] + good[5:6]:
        mod.fill(a, 0.0)
    for a in (good[2], good[4]):
        mod.fill(a, 0)
    mod.adam8bit_step(*good, bs, 1e-3, 0.9, 0.999, 1e-8, 0.1, 0.001, 0.0, -1)
    for index, bad, error, words in [
        (1, mod.Array(n, "float16"), TypeError, r"adam8bit_step\b.*\bgrad\b"),
        (2, f32(n), TypeError, r"adam8bit_step\b.*\bq_m\b"),
        (5, u8(3), TypeError, r"adam8bit_step\b.*\babsmax_v\b"),
        (3, f32(2), ValueError, r"adam8bit_step\b.*\babsmax_m\b.*\b2\b.*\b3\b"),
        (4, u8(9), ValueError, r"adam8bit_step\b.*\bq_v\b.*\b9\b.*\b10\b"),
        (7, f32(255), ValueError, r"adam8bit_step\b.*\bcode_v\b.*\b255\b.*\b256\b"),
        (8, f32(11), ValueError, r"adam8bit_step\b.*\bout\b.*\b11\b.*\b10\b"),
    ]:
        args = list(good)
        args[index] = bad
        with pytest.raises(error, match=words):
            mod.adam8bit_step(*args, bs, 1e-3, 0.9, 0.999, 1e-8, 0.1, 0.001, 0.0, -1)
    with pytest.raises(ValueError, match=r"adam8bit_step\b.*\bblock_size\b"):
        mod.adam8bit_step(*good, 0, 1e-3, 0.9, 0.999, 1e-8, 0.1, 0.001, 0.0, -1)


def test_ndarray_function_rejects_views_of_state_shapes_and_devices():
    dev = nd.cpu_numpy()
    theta, grad = nd.array(np.ones((4, 8), np.float32), device=dev), nd.array(np.ones((4, 8), np.float32), device=dev)
    code_m, code_v = nd.array(SIGNED, device=dev), nd.array(UNSIGNED, device=dev)
    q = nd.array(np.zeros((8, 4), np.uint8), device=dev, dtype="uint8")
    absmax = nd.array(np.zeros(1, np.float32), device=dev)
    with pytest.raises(ValueError, match=r"adam8bit_step: q_m is updated in place and must be compact"):
        nd.adam8bit_step(theta, grad, (q.permute((1, 0)), absmax), (q, absmax), code_m, code_v, 32, 1e-3, 0.9, 0.999,
                         1e-8, 0.1, 0.001)
    with pytest.raises(ValueError, match=r"adam8bit_step: grad has shape \(32,\), theta \(4, 8\)"):
        nd.adam8bit_step(theta, grad.reshape((32,)), (q, absmax), (q, absmax), code_m, code_v, 32, 1e-3, 0.9, 0.999,
                         1e-8, 0.1, 0.001)
    with pytest.raises(TypeError, match=r"adam8bit_step: grad must be an NDArray, got ndarray"):
        nd.adam8bit_step(theta, np.ones((4, 8), np.float32), (q, absmax), (q, absmax), code_m, code_v, 32, 1e-3, 0.9,
                         0.999, 1e-8, 0.1, 0.001)
    if nd.cpu().enabled():
        with pytest.raises(ValueError, match=r"adam8bit_step: theta is on cpu_numpy\(\) but code_v on cpu\(\)"):
            nd.adam8bit_step(theta, grad, (q, absmax), (q, absmax), code_m, nd.array(UNSIGNED, device=nd.cpu()), 32,
                             1e-3, 0.9, 0.999, 1e-8, 0.1, 0.001, 0.0)


def test_np_face_rejects_wrong_dtypes_and_sizes():
    x = np.ones(10, np.float32)
    (q_m, absmax_m), (q_v, absmax_v) = zero_state(10, 4)
    with pytest.raises(TypeError, match=r"adam8bit_step: .*got theta float64"):
        np_face.adam8bit_step(x.astype(np.float64), x, (q_m, absmax_m), (q_v, absmax_v), SIGNED, UNSIGNED, 4, 1e-3,
                              0.9, 0.999, 1e-8, 0.1, 0.001)
    with pytest.raises(ValueError, match=r"adam8bit_step: absmax_v has 2 elements, expected 3"):
        np_face.adam8bit_step(x, x, (q_m, absmax_m), (q_v, absmax_v[:2]), SIGNED, UNSIGNED, 4, 1e-3, 0.9, 0.999,
                              1e-8, 0.1, 0.001)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("seed", [None, 7])
def test_a_bfloat16_theta_is_updated_in_place_as_the_float32_step_rounded_back(device, grad_dtype, seed):
    """A bfloat16 parameter without a master copy (pure bf16 training): one pass widens each element, updates it as
    the float32 kernel does and rounds it back, to nearest or as round_stochastic(new, seed) rounds it -- the bits
    of the chunked path it replaces, with no float32 copy of the parameter (issue 47's whole step)."""
    rng = np.random.default_rng(5)
    n, bs = 1000, 256
    theta16 = nd.array(rng.standard_normal(n).astype(np.float32), device=device).astype("bfloat16")
    grad = nd.array(scaled_blocks(rng, n, bs), device=device).astype(grad_dtype)
    (q_m, a_m), (q_v, a_v) = zero_state(n, bs)
    for t in (1, 2):
        theta32 = theta16.astype("float32").numpy()
        want, *want_state = step_on(REF, theta32, grad.astype("float32").numpy(), (q_m, a_m), (q_v, a_v), bs, t)
        state = [nd.array(a, device=device, dtype=str(a.dtype)) for a in (q_m, a_m, q_v, a_v)]
        out = nd.adam8bit_step(theta16, grad, tuple(state[:2]), tuple(state[2:]), nd.array(SIGNED, device=device),
                               nd.array(UNSIGNED, device=device), bs, **HYPER, correction1=corrections(t)[0],
                               correction2=corrections(t)[1], out=theta16, rounding_seed=seed)
        assert out is theta16 and out.dtype == "bfloat16"
        rounded = nd.array(want, device=device)
        rounded = rounded.astype("bfloat16") if seed is None else nd.round_stochastic(rounded, seed)
        assert_same_bits(theta16.numpy(), rounded.numpy())
        for ours, expected in zip(state, want_state):
            assert_same_bits(ours.numpy(), expected)
        q_m, a_m, q_v, a_v = want_state


@pytest.mark.parametrize("device", DEVICES)
def test_a_bfloat16_theta_needs_out_theta_and_float32_needs_no_seed(device):
    theta = nd.array(np.ones(8, np.float32), device=device)
    (q_m, a_m), (q_v, a_v) = zero_state(8, 4)
    state = [nd.array(a, device=device, dtype=str(a.dtype)) for a in (q_m, a_m, q_v, a_v)]
    codes = nd.array(SIGNED, device=device), nd.array(UNSIGNED, device=device)
    args = (tuple(state[:2]), tuple(state[2:]), *codes, 4, 1e-3, 0.9, 0.999, 1e-8, 0.1, 0.001)
    low = theta.astype("bfloat16")
    with pytest.raises(ValueError, match=r"adam8bit_step: a bfloat16 theta is updated in place"):
        nd.adam8bit_step(low, low, *args)
    with pytest.raises(ValueError, match=r"adam8bit_step: stochastic rounding .* needs a bfloat16 theta"):
        nd.adam8bit_step(theta, theta, *args, out=theta, rounding_seed=3)
