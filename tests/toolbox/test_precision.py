"""Mixed precision: Tensors in float32, float16, bfloat16 and the integer dtypes, autocast, GradScaler, and the
optimizers' master weights and stochastic rounding.

The rule under test (src/README.md, "Dtypes"): arithmetic is float32 whatever the storage, so a 16-bit op is
round16(float32 op); NDArray's side of it (every op, the conversions, round_stochastic, the integer dtypes):
tests/backend/test_dtypes.py, whose helpers (dtype_cases.py) these tests share. Topics, in order:

5. Tensors: dtype=, astype (differentiable), init, the course's idioms;
6. autocast (and checkpointing under it);
7. GradScaler;
8. optimizers: master weights and stochastic rounding;
9. float32 is still the default everywhere.
"""

import ml_dtypes
import numpy as np
import pytest

import needle as ndl
from needle import autograd, init, nn, ops, optim
from needle import backend_ndarray as nd

from conftest import DEVICES
from dtype_cases import CPU, FLOATS, INTS, NP, REF, TOLERANCE, check_op, int_rule, oracle, rounded


@pytest.fixture(autouse=True)
def _no_autocast_leaks():
    """Every test starts and ends outside autocast (a failing test must not leave it on for the next)."""
    autograd.set_autocast(None)
    yield
    autograd.set_autocast(None)



# ===== 5. Tensors ==================================================================================================
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_tensor_dtype_construction(device, dtype, rng):
    """ndl.Tensor(x, dtype=...) stores x (any NumPy dtype) converted by the contract's rules; t.dtype and
    t.numpy().dtype say so; Tensor(t) keeps the dtype; Tensor(t, dtype=other) converts."""
    x = rng.standard_normal((3, 4)) * 10
    t = ndl.Tensor(x, dtype=dtype, device=device)
    assert t.dtype == dtype and t.numpy().dtype == NP[dtype] and t.device == device
    if dtype in FLOATS:
        np.testing.assert_array_equal(t.numpy(), x.astype(np.float32).astype(NP[dtype]))
    else:
        np.testing.assert_array_equal(t.numpy(), int_rule(x.astype(np.float32), dtype))
    assert ndl.Tensor(t).dtype == dtype
    assert ndl.Tensor(t, dtype="float32").dtype == "float32"
    assert ndl.Tensor(t.numpy(), device=device).dtype == "float32"  # from NumPy without dtype=: float32


@pytest.mark.parametrize("src,dst", [("float32", "bfloat16"), ("float32", "float16"), ("bfloat16", "float32"),
                                     ("float16", "bfloat16")])
def test_tensor_astype_is_differentiable(src, dst, rng):
    """t.astype(dst) rounds like NDArray.astype, and the gradient comes back in t's dtype: d(sum(3 * t.astype))
    is 3 everywhere; a chain through another dtype gives the input dtype's gradient; astype to t's own dtype is t."""
    x = rounded(rng.standard_normal((4, 3)), src)
    t = ndl.Tensor(x, dtype=src, device=CPU)
    c = t.astype(dst)
    assert c.dtype == dst
    np.testing.assert_array_equal(c.numpy(), x.astype(NP[dst]))
    (c * 3.0).sum().backward()
    assert t.grad.dtype == src
    np.testing.assert_array_equal(t.grad.numpy().astype(np.float32), np.full((4, 3), 3.0, np.float32))
    assert t.astype(src) is t
    u = ndl.Tensor(x, dtype=src, device=CPU)
    w = ndl.Tensor(rounded(rng.standard_normal((3, 2)), dst), dtype=dst, device=CPU)
    out = (u.astype(dst) @ w).sum()
    out.backward()
    assert u.grad.dtype == src and w.grad.dtype == dst
    expected = np.broadcast_to(w.numpy().astype(np.float32).sum(axis=1), (4, 3))
    coarser = "bfloat16" if "bfloat16" in (src, dst) else "float16"
    np.testing.assert_allclose(u.grad.numpy().astype(np.float32), expected, **TOLERANCE[coarser])


def test_mixed_dtype_tensor_op_gradients_come_back_in_each_inputs_dtype(rng):
    """bf16 * f32 computes in float32; the bf16 input's gradient is bfloat16: each contribution (b from the
    product, 1 from the sum) is cast to bfloat16 and they are added in bfloat16; the f32 input's is float32."""
    a = ndl.Tensor(rounded(rng.standard_normal((3, 3)), "bfloat16"), dtype="bfloat16", device=CPU)
    b = ndl.Tensor(rng.standard_normal((3, 3)).astype(np.float32), device=CPU)
    out = (a * b + a).sum()
    assert (a * b).dtype == "float32" and out.dtype == "float32"
    out.backward()
    assert a.grad.dtype == "bfloat16" and b.grad.dtype == "float32"
    np.testing.assert_array_equal(a.grad.numpy(), oracle(rounded(b.numpy(), "bfloat16") + 1, "bfloat16"))
    np.testing.assert_array_equal(b.grad.numpy(), a.numpy().astype(np.float32))
    h = ndl.Tensor(rounded(rng.standard_normal((3, 3)), "float16"), dtype="float16", device=CPU)
    s = (h * 0.5 + a @ h).sum()  # bf16 @ f16 -> float32
    s.backward()
    assert h.grad.dtype == "float16" and a.grad.dtype == "bfloat16"


@pytest.mark.parametrize("dtype", FLOATS)
def test_init_functions_take_a_dtype(dtype):
    """init.rand/randn/zeros/ones(..., dtype=) give that dtype; rand/randn draw the float32 numbers of the same
    seed and round them (so seeded models match across dtypes); nn layers built with dtype= hold it."""
    for name in ("rand", "randn"):
        np.random.seed(0)
        t = getattr(init, name)(3, 4, dtype=dtype, device=CPU)
        np.random.seed(0)
        f = getattr(init, name)(3, 4, device=CPU)
        assert t.dtype == dtype and f.dtype == "float32"
        np.testing.assert_array_equal(t.numpy(), f.numpy().astype(NP[dtype]))
    assert init.zeros(2, 3, dtype=dtype, device=CPU).dtype == dtype
    ones = init.ones(2, 3, dtype=dtype, device=CPU)
    assert ones.dtype == dtype and (ones.numpy().astype(np.float32) == 1).all()
    assert init.zeros_like(ones).dtype == dtype and init.ones_like(ones).dtype == dtype
    lin = nn.Linear(4, 3, device=CPU, dtype=dtype)
    assert all(p.dtype == dtype for p in lin.parameters())


def test_course_idiom_cached_data_astype_numpy_types():
    """`t.cached_data.astype(np.uint8)` (and other NumPy type objects) works: NDArray.astype takes NumPy dtypes."""
    t = ndl.Tensor(np.array([[0.0, 1.9, 255.5, 300.0, -4.0]]), device=CPU)
    u = t.cached_data.astype(np.uint8)
    assert u.dtype == "uint8"
    np.testing.assert_array_equal(u.numpy(), [[0, 1, 255, 255, 0]])
    assert t.cached_data.astype(np.float16).dtype == "float16"
    assert t.cached_data.astype(ml_dtypes.bfloat16).dtype == "bfloat16"
    assert t.cached_data.astype(np.dtype("int32")).dtype == "int32"


def test_module_astype_keeps_parameter_identity():
    """Module.astype("bfloat16") converts every floating parameter and buffer in place (same objects) and
    returns the module; astype back restores float32 storage (rounded values)."""
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(4, 5, device=CPU), nn.BatchNorm1d(5, device=CPU), nn.Linear(5, 2, device=CPU))
    params = model.parameters()
    before = [p.numpy().copy() for p in params]
    assert model.astype("bfloat16") is model
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    for p, b in zip(params, before):
        assert p.dtype == "bfloat16"
        np.testing.assert_array_equal(p.numpy(), b.astype(NP["bfloat16"]))
    assert all(t.dtype == "bfloat16" for _, t in model.named_buffers())
    model.astype("float32")
    assert all(p.dtype == "float32" for p in params)


@pytest.mark.parametrize("dtype,length", [("bfloat16", 300), ("float16", 2100)])
def test_16bit_transformer_gathers_the_right_positional_embeddings(dtype, length):
    """A Transformer built in (or converted to) a 16-bit dtype adds position t's embedding row to step t for every
    t < sequence_len: with no layers and a zero input, the output is exactly the embedding table."""
    np.random.seed(0)
    model = nn.Transformer(4, 8, 0, num_head=1, dim_head=4, device=CPU, sequence_len=length + 64,
                           batch_first=True)
    model.astype(dtype)
    x = ndl.Tensor(np.zeros((1, length, 4)), dtype=dtype, device=CPU, requires_grad=False)
    out, _ = model(x)
    np.testing.assert_array_equal(out.numpy()[0], model.positional_embedding.weight.numpy()[:length])


# ===== 6. autocast =================================================================================================
def _mlp(seed=0):
    np.random.seed(seed)
    return nn.Sequential(nn.Linear(8, 16, device=CPU), nn.LayerNorm1d(16, device=CPU), nn.ReLU(),
                         nn.Linear(16, 4, device=CPU))


def _data(seed=1, n=12):
    rs = np.random.RandomState(seed)
    x = ndl.Tensor(rs.randn(n, 8).astype(np.float32), device=CPU, requires_grad=False)
    y = ndl.Tensor(rs.randint(0, 4, size=n).astype(np.float32), device=CPU, requires_grad=False)
    return x, y


def _mlp_loss_and_grads(dtype, gc=False, lazy=False):
    model = _mlp()
    if gc:
        model.enable_gc()
    x, y = _data()
    with ndl.autocast(dtype or "bfloat16", enabled=dtype is not None), autograd.lazy_mode(lazy):
        logits = model(x)
        loss = nn.SoftmaxLoss()(logits, y)
        loss.backward()
    return logits.dtype, loss, [p.grad for p in model.parameters()], model


def test_autocast_op_dtypes():
    """Inside autocast("bfloat16"/"float16"): a matmul (and element-wise arithmetic) of float32 tensors gives the
    low dtype; summation, logsumexp, logsoftmax and the softmax loss give float32; outside, float32 again;
    autocast rejects float32 and nests/turns off with enabled=False."""
    rs = np.random.RandomState(0)
    a = ndl.Tensor(rs.randn(3, 4).astype(np.float32), device=CPU)
    b = ndl.Tensor(rs.randn(4, 5).astype(np.float32), device=CPU)
    y = ndl.Tensor(np.array([0.0, 4.0, 2.0]), device=CPU, requires_grad=False)
    for low in ("bfloat16", "float16"):
        with ndl.autocast(low):
            assert ndl.amp.is_autocast_enabled()
            m = a @ b
            assert m.dtype == low
            assert (a * a + 1.0).dtype == low and ndl.exp(a).dtype == low and ndl.relu(a).dtype == low
            assert ndl.summation(m).dtype == "float32"
            assert ndl.logsumexp(m, axes=(1,)).dtype == "float32"
            assert ndl.logsoftmax(m).dtype == "float32"
            assert nn.SoftmaxLoss()(m, y).dtype == "float32"
            labels = y.astype("int32")  # integer labels: storage, never cast by autocast
            assert labels.dtype == "int32"
            assert nn.SoftmaxLoss()(m, labels).numpy() == nn.SoftmaxLoss()(m, y).numpy()
            with ndl.autocast(low, enabled=False):
                assert (a @ b).dtype == "float32" and not ndl.amp.is_autocast_enabled()
            assert (a @ b).dtype == low
            np.testing.assert_allclose(m.numpy().astype(np.float32), a.numpy() @ b.numpy(), rtol=2**-7 * 4,
                                       atol=2e-2)
        assert not ndl.amp.is_autocast_enabled() and (a @ b).dtype == "float32"
    with pytest.raises(ValueError):
        ndl.autocast("float32")


def test_autocast_is_entered_and_left_through_autograd_set_autocast(monkeypatch):
    """amp.autocast changes the active context only through autograd.set_autocast (which returns the previous
    one), restoring it on exit, nested blocks included; autograd.active_autocast reads it."""
    entered = []
    real = autograd.set_autocast

    def recording(context):
        entered.append(context)
        return real(context)

    monkeypatch.setattr(autograd, "set_autocast", recording)
    monkeypatch.setattr(ndl.amp, "set_autocast", recording)
    outer, off = ndl.autocast("bfloat16"), ndl.autocast("float16", enabled=False)
    with outer:
        assert autograd.active_autocast() is outer
        with off:
            assert autograd.active_autocast() is None
        assert autograd.active_autocast() is outer
    assert autograd.active_autocast() is None
    assert entered == [outer, None, outer, None]
    assert real(outer) is None and real(None) is outer  # the setter returns the previous context


def test_tensor_tuple_ops_apply_autocast_too():
    """TensorTupleOp casts its inputs under autocast as TensorOp does (attention needs no code of its own): a
    tuple op declaring autocast="low" sees 16-bit inputs, one declaring nothing its inputs' dtype."""
    seen = []

    class Pair(autograd.TensorTupleOp):
        def compute(self, a, b):
            seen.append((str(a.dtype), str(b.dtype)))
            return a, b

    class LowPair(Pair):
        autocast = "low"

    rs = np.random.RandomState(0)
    a, b = (ndl.Tensor(rs.randn(2, 3).astype(np.float32), device=CPU) for _ in range(2))
    with ndl.autocast("bfloat16"):
        LowPair()(a, b).realize_cached_data()
        Pair()(a, b).realize_cached_data()
    LowPair()(a, b).realize_cached_data()
    assert seen == [("bfloat16", "bfloat16"), ("float32", "float32"), ("float32", "float32")]


@pytest.mark.parametrize("low,rtol", [("bfloat16", 4e-2), ("float16", 5e-3)])
def test_autocast_mlp_matches_float32(low, rtol):
    """An MLP with LayerNorm under autocast: low-dtype logits, float32 loss, float32 parameter gradients (the
    parameters stay float32), all within the 16-bit format's tolerance of the float32 run."""
    dt32, loss32, grads32, model32 = _mlp_loss_and_grads(None)
    dt16, loss16, grads16, model16 = _mlp_loss_and_grads(low)
    assert dt32 == "float32" and dt16 == low
    assert loss16.dtype == "float32"
    assert all(p.dtype == "float32" for p in model16.parameters())
    assert abs(float(loss16.numpy()) - float(loss32.numpy())) <= rtol * abs(float(loss32.numpy()))
    for g16, g32 in zip(grads16, grads32):
        assert g16.dtype == "float32"
        scale = np.abs(g32.numpy()).max()
        np.testing.assert_allclose(g16.numpy(), g32.numpy(), atol=rtol * scale * 2)


def _transformer_run(low, gc=False, dropout=0.0, backward_inside=True, lazy=False):
    np.random.seed(0)
    model = nn.Transformer(8, 16, 2, num_head=2, dim_head=4, device=CPU, sequence_len=8, dropout=dropout)
    if gc:
        model.enable_gc()
    rs = np.random.RandomState(1)
    x = ndl.Tensor(rs.randn(5, 2, 8).astype(np.float32), device=CPU, requires_grad=False)
    np.random.seed(2)  # dropout masks: the same draws with gc on and off
    with ndl.autocast(low or "bfloat16", enabled=low is not None), autograd.lazy_mode(lazy):
        out, _ = model(x)
        loss = (out * out).sum() / 80.0
        if backward_inside:
            loss.backward()
    if not backward_inside:
        with autograd.lazy_mode(lazy):
            loss.backward()
    return loss, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("low,rtol", [("bfloat16", 5e-2), ("float16", 5e-3)])
def test_autocast_transformer_matches_float32(low, rtol):
    """nn.Transformer under autocast: float32 loss and parameter gradients, close to the float32 run's (gradients
    compared on the scale of the largest gradient: some are exactly 0 in float32, e.g. the key LayerNorm's bias,
    to which softmax is invariant, and only rounding noise in 16 bits)."""
    loss32, grads32 = _transformer_run(None)
    loss16, grads16 = _transformer_run(low)
    assert loss16.dtype == "float32"
    assert abs(float(loss16.numpy()) - float(loss32.numpy())) <= rtol * abs(float(loss32.numpy()))
    scale = max(np.abs(g.numpy()).max() for g in grads32)
    for g16, g32 in zip(grads16, grads32):
        assert g16.dtype == "float32"
        np.testing.assert_allclose(g16.numpy(), g32.numpy(), atol=rtol * scale)


@pytest.mark.filterwarnings("ignore::needle.checkpoint.NothingToDropWarning")  # one-op layers: nothing to drop
@pytest.mark.parametrize("low", [None, "bfloat16", "float16"], ids=["float32", "bf16", "fp16"])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_checkpointing_under_autocast_is_exact(low, lazy):
    """enable_gc() recomputes the dropped activations (and their casts) bit for bit: the loss and every gradient
    equal gc off exactly, in float32 and in mixed bf16/fp16 (MLP with LayerNorm, eager and lazy)."""
    _, loss_off, grads_off, _ = _mlp_loss_and_grads(low)
    _, loss_on, grads_on, _ = _mlp_loss_and_grads(low, gc=True, lazy=lazy)
    assert np.array_equal(loss_off.numpy(), loss_on.numpy())
    for a, b in zip(grads_off, grads_on):
        assert a.dtype == b.dtype == "float32"
        assert np.array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("low", [None, "bfloat16", "float16"], ids=["float32", "bf16", "fp16"])
@pytest.mark.parametrize("backward_inside", [True, False], ids=["backward-in-block", "backward-after-block"])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_checkpointing_transformer_under_autocast_is_exact(low, backward_inside, lazy):
    """The same for nn.Transformer (attention, LayerNorm, MLP blocks, dropout 0.1) with gc on: loss and gradients
    bit-identical to gc off, whether backward runs inside the autocast block or after it, eager or lazy."""
    kwargs = dict(dropout=0.1, backward_inside=backward_inside, lazy=lazy)
    loss_off, grads_off = _transformer_run(low, **kwargs)
    loss_on, grads_on = _transformer_run(low, gc=True, **kwargs)
    assert np.array_equal(loss_off.numpy(), loss_on.numpy())
    for a, b in zip(grads_off, grads_on):
        assert np.array_equal(a.numpy(), b.numpy())


def test_autocast_block_reused_for_two_steps_sees_updated_weights():
    """The 16-bit copy of a parameter is cached per autocast block: a second block (the next training step, after
    the optimizer changed the weights) uses the new weights, even with the same autocast object."""
    model = _mlp()
    x, y = _data()
    ac = ndl.autocast("bfloat16")
    opt = optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(2):
        with ac:
            loss = nn.SoftmaxLoss()(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.numpy()))
        with ndl.autocast("bfloat16"):
            fresh = float(nn.SoftmaxLoss()(model(x), y).numpy())
    with ac:
        again = float(nn.SoftmaxLoss()(model(x), y).numpy())
    assert again == fresh and again != losses[0]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_training_loop_inside_one_autocast_block_reads_the_current_weights(lazy):
    """The block's 16-bit copy of a parameter is remade once the parameter was written (its version moved on), so
    each step of a training loop inside one autocast block computes with the current weights, as a fresh block
    does: a released copy would have to be recomputed from changed weights (rule 4c refuses), and the copy of a
    one-element parameter, kept (rule 1), would hold the old value."""
    rs = np.random.RandomState(0)
    w = ndl.Tensor(rs.randn(8, 4).astype(np.float32), device=CPU)
    scale = ndl.Tensor(np.array([1.5], np.float32), device=CPU)  # one element: its 16-bit copy is kept
    x, y = _data()
    opt = optim.SGD([w, scale], lr=0.5)

    def loss_fn():
        return nn.SoftmaxLoss()((x @ w) * ops.broadcast_to(ops.reshape(scale, (1, 1)), (12, 4)), y)

    with ndl.autocast("bfloat16"), autograd.lazy_mode(lazy):
        for _ in range(3):
            loss = loss_fn()
            with ndl.autocast("bfloat16"):  # a fresh block: fresh copies of the current weights
                fresh = loss_fn()
            assert np.array_equal(loss.numpy(), fresh.numpy())
            loss.backward()
            opt.step()
    assert scale.version == 3


# ===== 7. GradScaler ===============================================================================================
def _regression(seed=0):
    np.random.seed(seed)
    rs = np.random.RandomState(seed)
    x = ndl.Tensor(rs.randn(32, 6).astype(np.float32), device=CPU, requires_grad=False)
    w_true = rs.randn(6, 1).astype(np.float32)
    y = ndl.Tensor(x.numpy() @ w_true, device=CPU, requires_grad=False)
    model = nn.Linear(6, 1, device=CPU)
    return model, x, y


def _mse(model, x, y):
    d = model(x) - y
    return (d * d).sum() / 32.0


def test_grad_scaler_skips_a_step_with_inf_and_halves_the_scale():
    """A float16 backward whose scaled loss overflows (scale 2**40) gives inf gradients: step() returns False,
    the parameters are unchanged, update() halves the scale. An inf put into a gradient by hand: the same."""
    model, x, y = _regression()
    opt = optim.SGD(model.parameters(), lr=0.01)
    scaler = ndl.amp.GradScaler(init_scale=2.0**40)
    before = [p.numpy().copy() for p in model.parameters()]
    with ndl.autocast("float16"):
        loss = _mse(model, x, y)
    scaler.scale(loss).backward()
    assert not np.isfinite(model.weight.grad.numpy()).all()
    assert scaler.step(opt) is False
    for p, b in zip(model.parameters(), before):
        np.testing.assert_array_equal(p.numpy(), b)
    scaler.update()
    assert scaler.get_scale() == 2.0**39
    # by hand: a NaN/inf in one gradient of an otherwise clean backward
    scaler = ndl.amp.GradScaler(init_scale=8.0)
    with ndl.autocast("float16"):
        loss = _mse(model, x, y)
    scaler.scale(loss).backward()
    g = model.bias.grad.numpy().copy()
    g[0, 0] = np.inf
    model.bias.grad = ndl.Tensor(g, device=CPU, requires_grad=False)
    assert scaler.step(opt) is False
    for p, b in zip(model.parameters(), before):
        np.testing.assert_array_equal(p.numpy(), b)
    scaler.update()
    assert scaler.get_scale() == 4.0


def test_grad_scaler_unscales_and_grows_after_growth_interval():
    """Clean steps: the gradients the optimizer sees are the unscaled ones (equal to an unscaled backward's); after
    `growth_interval` clean steps in a row the scale doubles, and a skip resets the count."""
    model, x, y = _regression()
    loss = _mse(model, x, y)
    loss.backward()
    plain = [p.grad.numpy().copy() for p in model.parameters()]
    scaler = ndl.amp.GradScaler(init_scale=1024.0, growth_interval=3)
    opt = optim.SGD(model.parameters(), lr=0.0)  # lr 0: the parameters (and so the gradients) stay put
    scales = []
    for step in range(7):
        opt.reset_grad()
        scaler.scale(_mse(model, x, y)).backward()
        if step == 4:  # one bad step in the middle
            model.bias.grad = ndl.Tensor(np.full((1, 1), np.nan, np.float32), device=CPU, requires_grad=False)
        taken = scaler.step(opt)
        assert taken == (step != 4)
        if taken:
            for p, g in zip(model.parameters(), plain):
                np.testing.assert_allclose(p.grad.numpy(), g, rtol=1e-6, atol=1e-7)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == [1024.0, 1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 1024.0]
    assert scaler.state_dict()["scale"] == 1024.0 and scaler.state_dict()["clean_steps"] == 2


def test_grad_scaler_training_recovers_from_overflow():
    """float16 autocast training of a tiny regression with a scale that starts far too large (2**40): the first
    steps are skipped and back off, then training proceeds and the loss falls well below its start."""
    model, x, y = _regression()
    opt = optim.Adam(model.parameters(), lr=0.05)
    scaler = ndl.amp.GradScaler(init_scale=2.0**40, growth_interval=5)
    losses, taken = [], []
    for _ in range(60):
        opt.reset_grad()
        with ndl.autocast("float16"):
            loss = _mse(model, x, y)
        scaler.scale(loss).backward()
        taken.append(scaler.step(opt))
        scaler.update()
        losses.append(float(loss.numpy()))
    assert not taken[0] and sum(taken) >= 30
    assert scaler.get_scale() < 2.0**40
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.1 * losses[0]
    assert min(losses[-5:]) <= min(losses[:10])


def test_grad_scaler_validates_and_can_be_disabled():
    """Bad hyper-parameters raise ValueError; enabled=False passes losses through and always steps."""
    for kwargs in (dict(growth_factor=1.0), dict(backoff_factor=1.0), dict(growth_interval=0), dict(init_scale=0)):
        with pytest.raises(ValueError):
            ndl.amp.GradScaler(**kwargs)
    model, x, y = _regression()
    scaler = ndl.amp.GradScaler(enabled=False)
    loss = _mse(model, x, y)
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0
    loss.backward()
    before = model.weight.numpy().copy()
    assert scaler.step(optim.SGD(model.parameters(), lr=0.1)) is True
    assert not np.array_equal(model.weight.numpy(), before)


# ===== 8. optimizers: master weights and stochastic rounding =======================================================
def _tiny_update_run(opt_name, dtype="bfloat16", steps=50, **kwargs):
    """A (64, 1) 16-bit parameter of value 1.0 whose gradient is a constant 1e-4: each update (SGD with lr=1, or
    Adam with lr=1e-4) is 1e-4, below half a step at 1.0 (bfloat16: 2**-8 = 3.9e-3, float16: 2**-11 = 4.9e-4).
    Returns (the parameter, the optimizer)."""
    np.random.seed(0)
    lin = nn.Linear(64, 1, bias=False, device=CPU)
    lin.weight.cached_data = nd.array(np.ones((64, 1), np.float32), device=CPU)
    lin.astype(dtype)
    p = lin.weight
    if opt_name == "sgd":
        opt = optim.SGD([p], lr=1.0, **kwargs)
    else:
        opt = optim.Adam([p], lr=1e-4, **kwargs)
    for _ in range(steps):
        p.grad = ndl.Tensor(np.full((64, 1), 1e-4, np.float32), dtype=dtype, device=CPU, requires_grad=False)
        opt.step()
    return p, opt


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_master_weights_accumulate_updates_smaller_than_a_16bit_step(opt_name, dtype):
    """Default master_weights: the optimizer keeps a float32 master copy of each 16-bit parameter; 50 updates of
    1e-4 move it by 5e-3 and the 16-bit parameter follows (rounded). With master_weights=False (round to nearest)
    every update is lost (each is under half a step): the parameter never moves, and Adam's state is 16-bit.
    (Not checked for pure-float16 Adam: g**2 * (1 - beta2) = 1e-11 underflows float16's second moment to 0, so
    its steps grow instead: the range problem that makes master weights the default.)"""
    p, opt = _tiny_update_run(opt_name, dtype)
    assert p.dtype == dtype
    master = opt.master[p]
    assert master.dtype == "float32"
    np.testing.assert_allclose(master.numpy(), 1.0 - 50 * 1e-4, rtol=1e-4)
    np.testing.assert_array_equal(p.numpy(), master.numpy().astype(NP[dtype]))
    assert opt.state_bytes() >= 64 * 4
    if dtype == "float16" and opt_name == "adam":
        return
    q, pure = _tiny_update_run(opt_name, dtype, master_weights=False)
    assert not pure.master and q.dtype == dtype
    np.testing.assert_array_equal(q.numpy().astype(np.float32), np.ones((64, 1), np.float32))
    if opt_name == "adam":  # pure 16-bit state
        assert pure.m[q].dtype == dtype and pure.v[q].dtype == dtype


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_stochastic_rounding_keeps_tiny_updates_on_average(opt_name):
    """master_weights=False, stochastic_rounding=True: no master copy, the bf16 parameter rounds up or down at
    random, and the mean over its 64 elements after 50 updates of 1e-4 is near 1 - 5e-3 (round to nearest: 1.0)."""
    p, opt = _tiny_update_run(opt_name, master_weights=False, stochastic_rounding=True)
    assert p.dtype == "bfloat16" and not opt.master
    mean = float(p.numpy().astype(np.float64).mean())
    assert abs(mean - (1.0 - 5e-3)) < 1.5e-3, mean
    assert len(np.unique(p.numpy().astype(np.float32))) > 1  # the elements went different ways


def test_stochastic_rounding_argument_checks():
    """stochastic_rounding=True raises ValueError with float16 (or float32) parameters and with
    master_weights=True."""
    half = nn.Linear(3, 2, device=CPU).astype("float16")
    with pytest.raises(ValueError, match="bfloat16"):
        optim.SGD(half.parameters(), master_weights=False, stochastic_rounding=True)
    with pytest.raises(ValueError, match="bfloat16"):
        optim.Adam(nn.Linear(3, 2, device=CPU).parameters(), master_weights=False, stochastic_rounding=True)
    bf = nn.Linear(3, 2, device=CPU).astype("bfloat16")
    for cls in (optim.SGD, optim.Adam):
        with pytest.raises(ValueError, match="master_weights"):
            cls(bf.parameters(), master_weights=True, stochastic_rounding=True)


@pytest.mark.parametrize("cls", [optim.SGD, optim.Adam])
def test_stochastic_rounding_with_default_master_weights_is_consistent(cls):
    """stochastic_rounding=True without master_weights= either raises ValueError (as master_weights=True does) or
    means pure bf16 training (no float32 master copies)."""
    bf = nn.Linear(3, 2, device=CPU).astype("bfloat16")
    try:
        opt = cls(bf.parameters(), lr=0.1, stochastic_rounding=True)
    except ValueError:
        return
    for p in bf.parameters():
        p.grad = ndl.Tensor(np.ones(p.shape), dtype="bfloat16", device=CPU, requires_grad=False)
    opt.step()
    assert not opt.master, f"{len(opt.master)} float32 master copies kept besides stochastic rounding"


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_16bit_training_with_master_weights_tracks_float32(opt_name):
    """A bf16 model (module.astype) trained with master weights follows the float32 model's losses closely and
    keeps its parameters bfloat16 (gradients bfloat16, updates float32)."""
    losses = {}
    for dtype in ("float32", "bfloat16"):
        model, x, y = _regression()
        model.astype(dtype)
        opt = (optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if opt_name == "sgd"
               else optim.Adam(model.parameters(), lr=0.05))
        losses[dtype] = []
        for _ in range(30):
            opt.reset_grad()
            loss = _mse(model, x, y)
            loss.backward()
            assert all(p.grad.dtype == dtype for p in model.parameters())
            opt.step()
            losses[dtype].append(float(loss.numpy()))
        assert all(p.dtype == dtype for p in model.parameters())
    assert losses["bfloat16"][-1] < 0.2 * losses["bfloat16"][0]
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=0.1, atol=1e-2)


# ===== 9. float32 stays the default ================================================================================
def test_float32_is_the_default_everywhere():
    """Without dtype=: NDArrays, Tensors (also from float64/int64 NumPy arrays), init, nn layers, op results,
    gradients and optimizer states are float32; autocast is off; the optimizer keeps no master copies."""
    assert nd.array([1, 2, 3], device=REF).dtype == "float32"
    assert nd.empty((2,), device=CPU).dtype == "float32" and nd.full((2,), 1, device=CPU).dtype == "float32"
    assert ndl.Tensor(np.arange(3, dtype=np.int64), device=CPU).dtype == "float32"
    assert ndl.Tensor(np.ones(3, dtype=np.float64), device=CPU).dtype == "float32"
    assert init.randn(2, 2, device=CPU).dtype == "float32" and init.zeros(2, device=CPU).dtype == "float32"
    assert not ndl.amp.is_autocast_enabled()
    model, x, y = _regression()
    loss = _mse(model, x, y)
    assert loss.dtype == "float32" and model(x).dtype == "float32"
    loss.backward()
    assert all(p.dtype == "float32" and p.grad.dtype == "float32" for p in model.parameters())
    opt = optim.Adam(model.parameters(), lr=0.01)
    opt.step()
    assert not opt.master and all(m.dtype == "float32" for m in opt.m.values())
    assert all(p.dtype == "float32" for p in model.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_float32_results_unchanged_by_the_dtype_machinery(device, rng):
    """float32 arithmetic is still exact float32: a + b, a * s, a @ b on the reference equal NumPy's float32
    results bit for bit, and the compiled backends agree within float32 tolerance."""
    a = rng.standard_normal((5, 6)).astype(np.float32)
    b = rng.standard_normal((5, 6)).astype(np.float32)
    check_op(device, "float32", lambda x, y: x + y, np.add, [a, b])
    check_op(device, "float32", lambda x: x * 0.3, lambda x: x * np.float32(0.3), [a])
    check_op(device, "float32", lambda x, y: x @ y.permute((1, 0)), lambda x, y: x @ y.T, [a, b],
             exact_reference=False)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_backward_inside_an_autocast_block_equals_backward_after_it(dtype):
    # The gradient ops ran under autocast too: layer norm's gradient raised "needs floating arrays of one dtype"
    # and other gradients were computed in other dtypes than after the block.
    grads = []
    for inside in (True, False):
        np.random.seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        x = ndl.Tensor(np.random.randn(5, 8).astype(np.float32), requires_grad=False)
        with ndl.autocast(dtype):
            loss = (model(x) * model(x)).sum()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        grads.append([p.grad.numpy() for p in model.parameters()])
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)
