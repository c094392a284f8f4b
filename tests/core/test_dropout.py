"""Counter-based dropout, `ops.dropout(x, p, seed)` and `nn.Dropout(p, regenerate=True)`: the mask is a hash of
(seed, index), regenerated in backward instead of kept.

The contract (src/README.md, dropout) is written again here in plain Python integers; the NumPy reference must
give exactly its mask, every backend and the NEEDLE_BACKEND=np face exactly the reference's bytes. Then: the
gradient is the same mask on out_grad (and a numerical check), the rate is p, nn.Dropout(regenerate=True) leaves
NumPy's stream where the course's mask draw leaves it and keeps no mask, and a TransformerLayer with
fused_attention=True keeps no mask at all and is bit-identical with checkpointing on and off.
"""
import re

import numpy as np
import pytest

import needle as ndl
from needle import autograd, nn, ops
from needle import backend_ndarray as nd
from needle import backend_numpy as np_face

from conftest import check_gradients


def lowbias32(h):
    h ^= h >> 16
    h = (h * 0x7FEB352D) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x846CA68B) & 0xFFFFFFFF
    return h ^ (h >> 16)


def contract_keep(n, p, seed):
    """src/README.md's rule, element by element: kept when the hash of (seed, i) clears p * 2^32."""
    threshold = min(int(p * 2**32), 2**32 - 1)
    key_seed = (seed * 0x9E3779B9) & 0xFFFFFFFF
    return np.array([lowbias32((i & 0xFFFFFFFF) ^ lowbias32((i >> 32) ^ key_seed)) >= threshold for i in range(n)])


def run(device, x, p, seed, dtype="float32"):
    t = ndl.Tensor(x, device=device, dtype=dtype)
    y = ops.dropout(t, p, seed)
    (y * ndl.Tensor(np.arange(x.size, dtype=np.float32).reshape(x.shape), device=device, dtype=dtype)).sum().backward()
    return y.numpy(), t.grad.numpy()


def test_reference_mask_is_the_contract():
    x = np.ones(600, np.float32)
    for p, seed in ((0.1, 0), (0.5, 7), (0.9, 2**32 - 1)):
        y, _ = run(nd.cpu_numpy(), x, p, seed)
        np.testing.assert_array_equal(y != 0, contract_keep(600, p, seed))
        np.testing.assert_array_equal(y[y != 0], np.float32(1) / np.float32(1 - p))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1,), (7, 33), (2, 3, 1000)])
def test_every_backend_gives_the_reference_bytes(device, dtype, shape):
    x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
    x.reshape(-1)[::5] = -0.0
    for p, seed in ((0.25, 3), (0.6, 12345)):
        for ours, ref in zip(run(device, x, p, seed, dtype), run(nd.cpu_numpy(), x, p, seed, dtype)):
            assert ours.dtype == ref.dtype and ours.shape == ref.shape
            np.testing.assert_array_equal(ours.view(np.uint8), ref.view(np.uint8))


def test_gradient_is_the_same_mask_and_the_rate_is_p():
    x = np.random.default_rng(0).standard_normal((200, 500)).astype(np.float32)
    y, grad = run(nd.cpu_numpy(), x, 0.3, 99)
    kept = y != 0
    assert abs(1 - kept.mean() - 0.3) < 0.005
    weights = np.arange(x.size, dtype=np.float32).reshape(x.shape)
    np.testing.assert_array_equal(grad, np.where(kept, weights / np.float32(0.7), 0).astype(np.float32))
    y2, _ = run(nd.cpu_numpy(), x, 0.3, 99)
    np.testing.assert_array_equal(y, y2)  # the same seed, the same mask
    assert not np.array_equal(run(nd.cpu_numpy(), x, 0.3, 100)[0] != 0, kept)  # another seed, another mask


def test_numerical_gradient():
    check_gradients(lambda x: ops.dropout(x, 0.4, 5), np.random.default_rng(1).standard_normal((4, 6)))


def test_numpy_face_is_the_reference():
    x = np.random.default_rng(3).standard_normal((5, 40)).astype(np.float32)
    ours = np_face.dropout(x, 0.35, 77)
    np.testing.assert_array_equal(ours.view(np.uint8), run(nd.cpu_numpy(), x, 0.35, 77)[0].view(np.uint8))


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_p_outside_0_1_is_an_error(p):
    with pytest.raises(ValueError, match=r"dropout: p must be in \[0, 1\)"):
        ops.dropout(ndl.Tensor(np.ones(3, np.float32)), p, 0)
    with pytest.raises(ValueError, match=r"dropout: p must be in \[0, 1\)"):
        nd.dropout(nd.array(np.ones(3, np.float32), device=nd.cpu_numpy()), p, 0)


def test_nn_dropout_regenerate_keeps_numpys_stream_and_no_mask():
    x = ndl.Tensor(np.ones((8, 50), np.float32))
    np.random.seed(4)
    nn.Dropout(0.2)(x)
    after_course = np.random.rand(3)
    np.random.seed(4)
    y = nn.Dropout(0.2, regenerate=True)(x)
    np.testing.assert_array_equal(np.random.rand(3), after_course)
    assert abs((y.numpy() == 0).mean() - 0.2) < 0.1
    assert not [n for n in autograd.find_topo_sort([y]) if n.is_leaf() and n is not x]  # no mask leaf
    dropout = nn.Dropout(0.2, regenerate=True)
    dropout.eval()
    assert dropout(x) is x


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_fused_transformer_layer_keeps_no_mask_and_gc_is_bit_identical(lazy):
    def grads(gc, fused):
        np.random.seed(0)
        layer = nn.TransformerLayer(8, 2, 4, 16, dropout=0.3, fused_attention=fused)
        if gc:
            layer.enable_gc()
        x = ndl.Tensor(np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32))
        np.random.seed(1)
        with autograd.lazy_mode(lazy):
            out = layer(x)
            leaves = [n for n in autograd.find_topo_sort([out]) if n.is_leaf() and not n.requires_grad]
            out.sum().backward()
        return [p.grad.numpy() for p in layer.parameters()] + [x.grad.numpy()], leaves, np.random.rand()

    plain, leaves, after_fused = grads(False, True)
    with_gc, _, _ = grads(True, True)
    for a, b in zip(plain, with_gc):
        np.testing.assert_array_equal(a, b)
    assert not any(tuple(n.shape) == (2, 5, 8) for n in leaves)  # no dropout mask of (B, T, E)
    _, unfused_leaves, after_unfused = grads(False, False)
    assert after_fused == after_unfused  # NumPy's stream as the unfused layer leaves it
    assert any(tuple(n.shape) == (2, 5, 8) for n in unfused_leaves)  # which keeps its masks


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan"), "0.5", True])
def test_module_rejects_a_rate_that_is_not_a_probability(p):
    # Dropout(-0.1) scaled every activation by 1/1.1 and Dropout(1.5) zeroed everything, silently (issue 26, item 3)
    with pytest.raises(ValueError, match=re.escape(f"Dropout: p must be a probability in [0, 1], got {p!r}")):
        nn.Dropout(p)
    module = nn.Dropout(0.5)
    with pytest.raises(ValueError, match="Dropout: p must be a probability"):
        module.p = p
    assert module.p == 0.5


def test_module_accepts_the_ends_of_the_range():
    np.random.seed(0)
    x = ndl.Tensor(np.ones((4, 5), dtype="float32"))
    assert np.all(nn.Dropout(1)(x).numpy() == 0)
    np.testing.assert_array_equal(nn.Dropout(0)(x).numpy(), x.numpy())
