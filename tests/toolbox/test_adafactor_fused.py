"""Adafactor's fused passes (src/README.md: adafactor_moments, adafactor_sumsq, adafactor_step) against its chunk
loop: a float32 parameter takes three backend calls over the whole array, which must give the chunk loop's bytes
(parameters and every state array) on every backend: row means, the chunks' column sums, RMS(u)'s chunk sums and
the element-wise update each rounded as the loop rounds them. Shapes: several chunks, rows longer than a chunk,
a batch of matrices, a single column, vectors shorter and longer than a chunk (the full V)."""
import numpy as np
import pytest

import needle as ndl
from needle import backend_ndarray as nd
from needle.toolbox.optim import adafactor

from conftest import DEVICES
from quantize_cases import assert_same_bits

SHAPES = [(300, 256), (3, 40000), (2, 3, 70, 300), (5000, 1), (1, 7), (100,), (70000,), (1,)]
OPTIONS = [dict(relative_step=False, lr=1e-2, scale_parameter=False),
           dict(beta1=0.9, weight_decay=0.01),
           dict(relative_step=False, lr=1e-3, beta1=0.9),
           dict(weight_decay=0.01, beta1=0.0, warmup_init=True)]


def train(device, shape, options, fused, monkeypatch, steps=3):
    """Parameter and state bytes after `steps` updates (new gradients each step), fused or chunk by chunk."""
    monkeypatch.setattr(adafactor, "_KERNELS", fused)
    calls = []
    kernel = nd.array_api.adafactor_step
    monkeypatch.setattr(nd.array_api, "adafactor_step", lambda *args: calls.append(1) or kernel(*args))
    rs = np.random.RandomState(sum(shape))
    w = ndl.nn.Parameter(ndl.Tensor(rs.randn(*shape).astype(np.float32), device=device))
    opt = adafactor.Adafactor([w], **options)
    for step in range(steps):
        g = rs.randn(*shape).astype(np.float32) * (10.0 ** -step)
        g.reshape(-1)[:: 7] = 0.0  # zeros: u = 0 (and g^2 = eps1)
        w.grad = ndl.Tensor(g, device=device)
        opt.step()
    assert len(calls) == (steps if fused else 0)
    state = {slot: getattr(opt, slot)[w].numpy() for slot in opt.slots_of(w) if w in getattr(opt, slot)}
    return w.numpy(), state


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_fused_adafactor_gives_the_chunk_loops_bytes(device, shape, options, monkeypatch):
    ours, our_state = train(device, shape, options, True, monkeypatch)
    expected, state = train(device, shape, options, False, monkeypatch)
    assert_same_bits(ours, expected)
    assert sorted(our_state) == sorted(state)
    for slot in state:
        assert_same_bits(our_state[slot], state[slot])


@pytest.mark.parametrize("device", DEVICES)
def test_fused_adafactor_errors(device):
    grad = nd.array(np.ones((4, 6), np.float32), device=device)
    with pytest.raises(ValueError, match="adafactor_moments"):
        nd.array_api.adafactor_moments(grad, 5, 6, 1, 1e-30)  # 24 elements are no whole number of (5, 6) matrices
    with pytest.raises(TypeError, match="adafactor_sumsq"):
        nd.array_api.adafactor_sumsq(grad.astype("float16"), None, grad, True, 24, 1, 8, 0.5, 1e-30)
