"""The fused Adam kernel, `adam_step` (src/README.md): Adam's moment and parameter update in one backend pass.

The contract is the element-wise composite `optim.Adam` computed before the kernel existed (m * b1 + g * (1 - b1),
..., theta - m / c1 * lr / (v / c2) ** 0.5 + eps)), one rounding per operation: the kernel must give its bytes on
every backend (cpu, cuda with a GPU, the NumPy reference) and through the NEEDLE_BACKEND=np face, so `optim.Adam`
trains bit for bit as before. Then bad arguments are clear errors.
"""
import numpy as np
import pytest

import needle as ndl
from needle import backend_ndarray as nd
from needle import backend_numpy as np_face
from needle import optim

from quantize_cases import DEVICES, assert_same_bits

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)


def corrections(t, beta1=0.9, beta2=0.999):
    return 1 - beta1**t, 1 - beta2**t


def composite_step(device, theta, grad, m, v, t, lr, beta1, beta2, eps, weight_decay=0.0):
    """optim.Adam's update as element-wise NDArray ops on `device` (what ran before the fused kernel)."""
    c1, c2 = corrections(t, beta1, beta2)
    theta, grad = nd.array(theta, device=device), nd.array(grad, device=device)
    if weight_decay:  # the course's coupled weight decay, as Optimizer._chunks adds it
        grad = grad + theta * weight_decay
    if m is None:
        m, v = grad * (1 - beta1), (grad * grad) * (1 - beta2)
    else:
        m = nd.array(m, device=device) * beta1 + grad * (1 - beta1)
        v = nd.array(v, device=device) * beta2 + (grad * grad) * (1 - beta2)
    out = theta - (m / c1) * lr / ((v / c2) ** 0.5 + eps)
    return out.numpy(), m.numpy(), v.numpy()


def fused_step(device, theta, grad, m, v, t, lr, beta1, beta2, eps, weight_decay=0.0, in_place=False):
    arrays = [None if a is None else nd.array(a, device=device) for a in (theta, grad, m, v)]
    out = None
    if in_place:  # out = theta, m, v themselves (new m, v buffers on the first step)
        out = (arrays[0],) + tuple(nd.array(np.full(theta.shape, np.nan, np.float32), device=device)
                                   if a is None else a for a in arrays[2:])
    out = nd.adam_step(*arrays, lr, beta1, beta2, eps, *corrections(t, beta1, beta2), weight_decay=weight_decay,
                       out=out)
    for a in out:
        assert a.dtype == "float32" and a.shape == theta.shape and a.device == device
    return tuple(a.numpy() for a in out)


def moments(rng, shape):
    """Adam moments of many magnitudes, v >= 0, with exact zeros and negative zeros among the gradients."""
    grad = (rng.standard_normal(shape) * 10.0 ** rng.integers(-8, 3, shape)).astype(np.float32)
    grad.reshape(-1)[::7] = 0.0
    grad.reshape(-1)[3::11] = -0.0
    m = (rng.standard_normal(shape) * 1e-2).astype(np.float32)
    v = (rng.random(shape) * 1e-4).astype(np.float32)
    return grad, m, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1,), (7,), (33, 5), (4096,), (3, 1000)])
@pytest.mark.parametrize("first", [True, False], ids=["first", "later"])
def test_adam_step_has_the_composite_bytes(device, shape, first):
    rng = np.random.default_rng(sum(shape))
    theta = rng.standard_normal(shape).astype(np.float32)
    grad, m, v = moments(rng, shape)
    if first:
        m = v = None
    for t, hyper in ((1 if first else 5, HYPER), (3, dict(lr=0.05, beta1=0.5, beta2=0.9, eps=1e-3)),
                     (2, dict(HYPER, weight_decay=0.01)), (4, dict(lr=0.05, beta1=0.5, beta2=0.9, eps=1e-3,
                                                                   weight_decay=3.0))):
        expected = composite_step(nd.cpu_numpy(), theta, grad, m, v, t, **hyper)
        for in_place in (False, True):
            for ours, want in zip(fused_step(device, theta, grad, m, v, t, **hyper, in_place=in_place), expected):
                assert_same_bits(ours, want)
        if device is not nd.cpu_numpy():  # the device's own element-wise ops agree too
            for ours, want in zip(expected, composite_step(device, theta, grad, m, v, t, **hyper)):
                assert_same_bits(ours, want)


def test_adam_step_numpy_face_is_the_reference():
    rng = np.random.default_rng(5)
    theta = rng.standard_normal((6, 9)).astype(np.float32)
    grad, m, v = moments(rng, (6, 9))
    for state in ((None, None), (m, v)):
        for wd in (0.0, 0.01):
            ours = np_face.adam_step(theta, grad, *state, **HYPER, correction1=corrections(2)[0],
                                     correction2=corrections(2)[1], weight_decay=wd)
            ref = fused_step(nd.cpu_numpy(), theta, grad, *state, t=2, **HYPER, weight_decay=wd)
            for a, b in zip(ours, ref):
                assert_same_bits(np.asarray(a).reshape(b.shape), b)


@pytest.mark.parametrize("device", DEVICES)
def test_optim_adam_trains_as_the_composite_did(device, monkeypatch):
    """Three Adam steps with weight decay: the fused path and the element-wise path give the same parameters."""

    def train(fused):
        monkeypatch.setattr("needle.optim.adam._is_float32", lambda a: fused and str(a.dtype) == "float32")
        rng = np.random.default_rng(0)
        w = ndl.Tensor(rng.standard_normal((5, 4)).astype(np.float32), device=device)
        x = ndl.Tensor(rng.standard_normal((3, 5)).astype(np.float32), device=device, requires_grad=False)
        opt = optim.Adam([w], lr=0.01, weight_decay=0.1)
        for _ in range(3):
            opt.reset_grad()
            ((x @ w) ** 2).sum().backward()
            opt.step()
        return w.numpy(), opt.m[w].numpy(), opt.v[w].numpy()

    for ours, want in zip(train(True), train(False)):
        assert_same_bits(ours, want)


@pytest.mark.parametrize("device", DEVICES)
def test_adam_step_errors_name_the_array(device):
    theta = nd.array(np.zeros((4, 3), np.float32), device=device)
    with pytest.raises(ValueError, match=r"adam_step: grad has shape \(3, 4\), theta \(4, 3\)"):
        nd.adam_step(theta, nd.array(np.zeros((3, 4), np.float32), device=device), None, None, 0.1, 0.9, 0.99, 1e-8,
                     0.1, 0.01)
    with pytest.raises(TypeError, match="adam_step: expects float32 theta.*grad float16"):
        nd.adam_step(theta, nd.array(np.zeros((4, 3), np.float16), device=device, dtype="float16"), None, None, 0.1,
                     0.9, 0.99, 1e-8, 0.1, 0.01)
    with pytest.raises(ValueError, match="adam_step: v has shape"):
        nd.adam_step(theta, theta, theta, nd.array(np.zeros(12, np.float32), device=device), 0.1, 0.9, 0.99, 1e-8,
                     0.1, 0.01)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("seed", [None, 11])
@pytest.mark.parametrize("state_dtype", ["bfloat16", "float32"])
def test_a_bfloat16_parameter_and_state_are_updated_in_place_as_the_float32_step_rounded(device, grad_dtype, seed,
                                                                                       state_dtype):
    """Pure bfloat16 training: theta bfloat16 (its state bfloat16, or float32 as Adam8bit keeps an embedding's), one
    pass widens them, updates in float32 as the float32 kernel does and rounds back (state to nearest; theta to
    nearest or as round_stochastic(new, seed) rounds it): the bits of the chunked path it replaces, without its
    float32 copies (issue 47's whole step)."""
    rng = np.random.default_rng(9)
    shape = (33, 31)
    theta = nd.array(rng.standard_normal(shape).astype(np.float32), device=device).astype("bfloat16")
    grad = nd.array(rng.standard_normal(shape).astype(np.float32), device=device).astype(grad_dtype)
    m = v = None
    for t in (1, 2):
        widened = [None if a is None else a.astype("float32") for a in (theta, grad, m, v)]
        want = nd.adam_step(*widened, **HYPER, correction1=corrections(t)[0], correction2=corrections(t)[1])
        if m is None:
            m, v = (nd.empty(shape, dtype=state_dtype, device=device) for _ in range(2))
            old = None, None
        else:
            old = m, v
        out = nd.adam_step(theta, grad, *old, **HYPER, correction1=corrections(t)[0], correction2=corrections(t)[1],
                           out=(theta, m, v), rounding_seed=seed)
        assert out[0] is theta and theta.dtype == "bfloat16" and m.dtype == v.dtype == state_dtype
        rounded = want[0].astype("bfloat16") if seed is None else nd.round_stochastic(want[0], seed)
        assert_same_bits(theta.numpy(), rounded.numpy())
        assert_same_bits(m.numpy(), want[1].astype(state_dtype).numpy())
        assert_same_bits(v.numpy(), want[2].astype(state_dtype).numpy())


@pytest.mark.parametrize("device", DEVICES)
def test_optim_adam_on_bfloat16_takes_one_pass_and_keeps_the_chunked_bits(device, monkeypatch):
    """optim.Adam on a pure bfloat16 parameter with stochastic rounding: the fused in-place pass gives the bits the
    chunked update (what it was before) gives."""
    def train(fused):
        np.random.seed(0)
        w = ndl.Tensor(np.random.randn(70, 9).astype(np.float32), device=device, dtype="bfloat16", requires_grad=True)
        opt = optim.Adam([w], lr=0.01, stochastic_rounding=True, master_weights=False)
        if not fused:
            monkeypatch.setattr(opt, "fused_in_place", lambda p: False)
        for _ in range(3):
            opt.reset_grad()
            (w * w).sum().backward()
            opt.step()
        monkeypatch.undo()
        return w.numpy()

    assert_same_bits(train(True), train(False))
