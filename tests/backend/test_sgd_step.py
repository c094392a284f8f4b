"""The fused SGD kernel, `sgd_step` (src/README.md): SGD's momentum and parameter update in one backend pass.

The contract is the element-wise composite `optim.SGD` computes a chunk at a time (g + theta * wd, u * beta + g *
(1 - beta), theta - u * lr), one rounding per operation: the kernel must give its bytes on every backend (cpu, cuda
with a GPU, the NumPy reference), written in place or not, and through the NEEDLE_BACKEND=np face, so `optim.SGD`
trains bit for bit as before. Then bad arguments are clear errors.
"""
import numpy as np
import pytest

import needle as ndl
from needle import backend_ndarray as nd
from needle import backend_numpy as np_face
from needle import optim

from quantize_cases import DEVICES, assert_same_bits
from test_adam_step import moments


def composite_step(device, theta, grad, u, lr, momentum, weight_decay):
    """optim.SGD's update as element-wise NDArray ops on `device` (its chunk loop over one chunk)."""
    theta, grad = nd.array(theta, device=device), nd.array(grad, device=device)
    if weight_decay:
        grad = grad + theta * weight_decay
    if momentum:
        grad = grad * (1 - momentum) if u is None else nd.array(u, device=device) * momentum + grad * (1 - momentum)
    return (theta - grad * lr).numpy(), grad.numpy() if momentum else None


def fused_step(device, theta, grad, u, lr, momentum, weight_decay, in_place):
    theta, grad, u = (None if a is None else nd.array(a, device=device) for a in (theta, grad, u))
    out = None
    if in_place:  # out = theta, u themselves (a new u buffer on the first step)
        out = theta, nd.array(np.full(theta.shape, np.nan, np.float32), device=device) if u is None else u
    new, new_u = nd.array_api.sgd_step(theta, grad, u, lr, momentum, weight_decay, out=out)
    assert new.dtype == "float32" and new.shape == theta.shape and (new_u is None) == (not momentum)
    return new.numpy(), None if new_u is None else new_u.numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1,), (7,), (33, 5), (4096,), (3, 1000)])
@pytest.mark.parametrize("first", [True, False], ids=["first", "later"])
@pytest.mark.parametrize("momentum", [0.0, 0.9, 1.0])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_sgd_step_has_the_composite_bytes(device, shape, first, momentum, weight_decay):
    rng = np.random.default_rng(sum(shape))
    theta = rng.standard_normal(shape).astype(np.float32)
    theta.reshape(-1)[1::13] = -0.0  # -0 + -0 * 0 would be +0: the decay is skipped when it is 0
    grad, u, _ = moments(rng, shape)
    u = None if first else u
    for lr in (1e-3, 0.7):
        expected = composite_step(nd.cpu_numpy(), theta, grad, u, lr, momentum, weight_decay)
        for in_place in (False, True):
            ours = fused_step(device, theta, grad, u, lr, momentum, weight_decay, in_place)
            assert_same_bits(ours[0], expected[0])
            if momentum:
                assert_same_bits(ours[1], expected[1])
        if device is not nd.cpu_numpy():  # the device's own element-wise ops agree too
            assert_same_bits(composite_step(device, theta, grad, u, lr, momentum, weight_decay)[0], expected[0])


def test_sgd_step_numpy_face_is_the_reference():
    rng = np.random.default_rng(5)
    theta = rng.standard_normal((6, 9)).astype(np.float32)
    grad, u, _ = moments(rng, (6, 9))
    for state, momentum, wd in ((None, 0.0, 0.0), (None, 0.9, 0.01), (u, 0.9, 0.0), (u, 0.5, 0.1)):
        ours = np_face.sgd_step(theta, grad, state, 0.05, momentum, wd)
        ref = fused_step(nd.cpu_numpy(), theta, grad, state, 0.05, momentum, wd, False)
        assert_same_bits(np.asarray(ours[0]), ref[0])
        assert (ours[1] is None) == (ref[1] is None)
        if momentum:
            assert_same_bits(np.asarray(ours[1]), ref[1])
        in_place = (theta.copy(), np.zeros_like(theta))
        np_face.sgd_step(in_place[0], grad, state, 0.05, momentum, wd, out=in_place)
        assert_same_bits(in_place[0], ref[0])
        assert_same_bits(in_place[1], ref[1] if momentum else np.zeros_like(theta))  # u untouched without momentum


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_optim_sgd_trains_as_the_chunks_did(device, momentum, monkeypatch):
    """Three SGD steps with weight decay: the fused path and the chunk loop give the same parameters."""

    def train(fused):
        monkeypatch.setattr(optim.SGD, "fused_in_place", lambda self, p: fused)
        rng = np.random.default_rng(0)
        w = ndl.Tensor(rng.standard_normal((5, 4)).astype(np.float32), device=device)
        x = ndl.Tensor(rng.standard_normal((3, 5)).astype(np.float32), device=device, requires_grad=False)
        opt = optim.SGD([w], lr=0.01, momentum=momentum, weight_decay=0.1)
        for _ in range(3):
            opt.reset_grad()
            ((x @ w) ** 2).sum().backward()
            opt.step()
        u = opt.u.get(w)
        return w.numpy(), None if u is None else np.asarray(u.numpy() if hasattr(u, "numpy") else u)

    for ours, want in zip(train(True), train(False)):
        if want is not None:
            assert_same_bits(ours, want)


@pytest.mark.parametrize("device", DEVICES)
def test_sgd_step_errors_name_the_array(device):
    theta = nd.array(np.zeros((4, 3), np.float32), device=device)
    with pytest.raises(ValueError, match=r"sgd_step: grad has shape \(3, 4\), theta \(4, 3\)"):
        nd.array_api.sgd_step(theta, nd.array(np.zeros((3, 4), np.float32), device=device), None, 0.1, 0.9)
    with pytest.raises(TypeError, match="sgd_step: expects float32 theta.*grad float16"):
        nd.array_api.sgd_step(theta, nd.array(np.zeros((4, 3), np.float16), device=device, dtype="float16"), None,
                              0.1, 0.9)
    with pytest.raises(ValueError, match="sgd_step: out_u must be a compact array"):
        nd.array_api.sgd_step(theta, theta, None, 0.1, 0.9, out=(theta, nd.array(np.zeros(12, np.float32),
                                                                                  device=device)))
