"""The fused LM head, ops.linear_cross_entropy: the unfused loss's numbers, one chunk of logits at a time.

The oracle is the unfused head, nn.SoftmaxLoss()(hidden @ W + b, y): forward and gradients within 1e-5 in float32
on the NumPy reference device (tests/backend's test_linear_cross_entropy_compiled.py: on the compiled ones), within
1e-6 in float64 under NEEDLE_BACKEND=np (np_backend_checks.py, in a subprocess: the backend is read at import),
and central differences through conftest's checker. Memory is counted, not estimated: the allocator's peak inside
each compute is at most what the op declares to the Budget's ledger (`workspace`), and far below the
full logits. LanguageModel.loss is the model's SoftmaxLoss with the head fused, checkpointed exactly (rule 4)
and predicted by the Budget's ledger within 1%.
"""
import gc as python_gc

import numpy as np
import pytest

import needle as ndl
from needle import autograd, nn, ops
from needle import backend_ndarray as nd
from needle.ops import ops_fused
from needle.ops.ops_fused import LinearCrossEntropy, LinearCrossEntropyGrad, chunk_rows

from conftest import check_gradients, peak_during, random_out_grad, saves_violation
from linear_cross_entropy_cases import CASES, assert_close, fused_and_unfused, make_arrays
from models import LanguageModel

DEVICE = nd.cpu_numpy()  # the model's tests: the graph, on the reference (tests/backend: the kernels, compiled)
F32 = 4

@pytest.mark.parametrize("case", list(CASES))
def test_fused_matches_unfused_forward_and_gradients(device, case):
    """Loss and the gradients of hidden, weight and bias equal the unfused head's within 1e-5 (float32)."""
    (loss, grads), (ref_loss, ref_grads) = fused_and_unfused(device, *CASES[case])
    assert loss.shape == () and loss.dtype == np.float32
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert [g.shape for g in grads] == [g.shape for g in ref_grads]  # db has the bias's shape, (V,) or (1, V)
    assert_close(grads, ref_grads, rtol=1e-5)


@pytest.mark.parametrize("chunk, bias", [(3, (1, 7)), (None, (7,)), (2, None)])
def test_gradient_against_central_differences(device, chunk, bias):
    """conftest.check_gradients: the analytic gradient in a random direction against finite differences."""
    h, W, b, y = make_arrays(8, 4, 7, bias, seed=1)

    def fn(hidden, weight, *b_t):
        target = ndl.Tensor(y, device=hidden.device, requires_grad=False)
        return ops.linear_cross_entropy(hidden, weight, b_t[0] if b_t else None, target, chunk_size=chunk)

    check_gradients(fn, *[a for a in (h, W, b) if a is not None], device=device)


@pytest.mark.parametrize("bad, position", [(7, 2), (-1, 0), (2.5, 4), (np.nan, 1)])
def test_out_of_range_target_raises_index_error_naming_it(device, bad, position):
    """A target outside [0, V) or not an integer: IndexError naming its value and position, at the call (the
    targets' values exist) and inside compute (a lazily computed target: checked when it exists)."""
    h, W, b, y = make_arrays(6, 3, 7, (1, 7))
    y[position] = bad
    args = [ndl.Tensor(a, device=device) for a in (h, W, b)]
    expected = f"target {bad:g} at position {position}"
    with pytest.raises(IndexError, match=expected):
        ops.linear_cross_entropy(*args, ndl.Tensor(y, device=device, requires_grad=False), chunk_size=4)
    with autograd.lazy_mode(True):
        lazy_y = ndl.Tensor(y, device=device, requires_grad=False) * 1.0  # no values until computed
        loss = ops.linear_cross_entropy(*args, lazy_y, chunk_size=4)
    with pytest.raises(IndexError, match=expected):
        loss.realize_cached_data()
    grad_op = LinearCrossEntropyGrad(4, bias=True)
    raw = [a.realize_cached_data() for a in args]
    with pytest.raises(IndexError, match=expected):
        grad_op.compute(*raw, ndl.Tensor(y, device=device).realize_cached_data(),
                        ndl.Tensor(np.ones(()), device=device).realize_cached_data())


def test_shapes_that_do_not_fit_raise_value_error_naming_the_op_and_shapes():
    h, W, b, y = (ndl.Tensor(np.ones(s), device=DEVICE) for s in [(4, 3), (3, 5), (1, 5), (4,)])
    for args in [(h, ndl.Tensor(np.ones((2, 5))), b, y),  # H mismatch
                 (h, W, ndl.Tensor(np.ones((5, 1))), y),  # bias neither (V,) nor (1, V)
                 (h, W, b, ndl.Tensor(np.ones(3))),  # one target per token
                 (ndl.Tensor(np.ones((2, 2, 3))), W, b, y)]:  # hidden must be 2-D
        with pytest.raises(ValueError, match=r"linear_cross_entropy: .*got hidden \("):
            ops.linear_cross_entropy(*args)
    with pytest.raises(ValueError, match="LinearCrossEntropy: need hidden"):
        LinearCrossEntropy().compute(*[t.realize_cached_data() for t in (h, W, b)],
                                     ndl.Tensor(np.ones(3)).realize_cached_data())
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="chunk_size"):
            ops.linear_cross_entropy(h, W, b, y, chunk_size=bad)


def test_chunk_size_none_takes_the_rows_whose_logits_fit_in_4_mib(monkeypatch):
    """The rule: clamp(2**20 // V, 1, N) rows; and None computes exactly what that explicit chunk_size does."""
    assert ops_fused.LOGITS_CHUNK_ELEMENTS * F32 == 4 << 20
    assert chunk_rows(100_000, 50_257) == (1 << 20) // 50_257 == 20
    assert chunk_rows(5, 10) == 5 and chunk_rows(10, 1 << 21) == 1 and chunk_rows(10, 7, chunk_size=3) == 3
    monkeypatch.setattr(ops_fused, "LOGITS_CHUNK_ELEMENTS", 3 * 7)  # None now means 3 rows of a 7-word vocab
    assert chunk_rows(10, 7) == 3
    (loss, grads), _ = fused_and_unfused(DEVICE, 10, 4, 7, None, (1, 7))
    (loss3, grads3), _ = fused_and_unfused(DEVICE, 10, 4, 7, 3, (1, 7))
    assert np.array_equal(loss, loss3) and all(map(np.array_equal, grads, grads3))
    assert (LinearCrossEntropyGrad(None).workspace((10, 4), (4, 7), (1, 7), (10,), ()) ==
            LinearCrossEntropyGrad(3).workspace((10, 4), (4, 7), (1, 7), (10,), ()))


def test_op_contract_saves_shapes_and_no_second_derivative():
    """`saves` is truthful (conftest.saves_violation's probe), gradient returns one entry per input, shapes are inferred
    lazily without computing, and differentiating the gradient says what to use instead."""
    h, W, b, y = make_arrays(6, 3, 5, (5,))
    with autograd.lazy_mode(True):
        args = [ndl.Tensor(a, device=nd.cpu_numpy()) for a in (h, W, b)]
        loss = ops.linear_cross_entropy(*args, ndl.Tensor(y, device=nd.cpu_numpy()), chunk_size=4)
        assert loss.shape == () and loss.cached_data is None  # inferred, not computed
        grads = loss.op.gradient(ndl.Tensor(np.ones(()), device=nd.cpu_numpy()), loss)
        assert type(grads) is tuple and len(grads) == len(loss.inputs) and grads[-1] is None
        assert [g.shape for g in grads[:3]] == [(6, 3), (3, 5), (5,)] and grads[0].cached_data is None
    loss.realize_cached_data()
    assert saves_violation(loss, random_out_grad(loss, np.random.default_rng(0))) is None
    grad_node = grads[0].inputs[0]
    assert isinstance(grad_node.op, LinearCrossEntropyGrad) and grad_node.op.saves == "inputs"
    with pytest.raises(NotImplementedError, match="second derivatives .*softmax_cross_entropy"):
        grad_node.op.gradient(grad_node, grad_node)


@pytest.mark.devices("cpu", "cpu_numpy")
@pytest.mark.parametrize("chunk, bias", [(8, (1, 200)), (5, (200,)), (8, None), (64, (1, 200)), (None, None)])
def test_peak_memory_is_what_the_op_declares_and_far_below_the_logits(device, chunk, bias):
    """Exact bytes: the peak inside forward compute is at most one chunk of logits + the output + the declared
    workspace (which counts that chunk: exact but for the output's 4 bytes, allocated last), and inside the
    gradient's compute exactly the outputs (dh, dW, db) + the declared workspace. A chunked call peaks far below
    the full (N, V) logits."""
    N, H, V = 64, 16, 200
    h, W, b, y = make_arrays(N, H, V, bias)
    inputs = [nd.array(a, device=device) for a in (h, W, b, y) if a is not None]
    g = nd.array(np.array(1.0), device=device)
    shapes = [x.shape for x in inputs]
    c, logits_chunk, logits_full = chunk_rows(N, V, chunk), chunk_rows(N, V, chunk) * V * F32, N * V * F32

    forward = LinearCrossEntropy(chunk, bias is not None)
    peak, _ = peak_during(device, lambda: forward.compute(*inputs))
    declared = F32 * forward.workspace(*shapes)
    assert peak <= logits_chunk + F32 + declared
    # Exactly the workspace: the output (4 bytes) is allocated after the chunks' temporaries are gone, so the
    # ledger's output + workspace is 4 bytes over.
    assert peak == declared, (peak, declared)

    backward = LinearCrossEntropyGrad(chunk, bias is not None)
    outputs = F32 * (N * H + H * V + (V if bias is not None else 0))
    peak_grad, grads = peak_during(device, lambda: backward.compute(*inputs, g))
    del grads
    declared_grad = F32 * backward.workspace(*shapes, ())
    assert peak_grad <= logits_chunk + outputs + declared_grad
    assert peak_grad == outputs + declared_grad, (peak_grad, outputs, declared_grad)
    if c <= N // 8:
        # two chunk-sized blocks at once (the logits with their bias or their gradient), never the whole
        assert peak < logits_full / 2 and peak_grad - outputs < logits_full / 2, (peak, peak_grad, logits_full)


def _lm(seq_model, gc=None, V=30):
    np.random.seed(0)
    model = LanguageModel(8, V, 16, num_layers=2, seq_model=seq_model, seq_len=6, device=DEVICE, num_head=2,
                          dim_head=4)
    if gc is not None:
        model.enable_gc(**gc)
    return model


def _batch(T=6, B=4, V=30, seed=0):
    rs = np.random.RandomState(seed)
    X = ndl.Tensor(rs.randint(0, V, (T, B)).astype(np.float32), device=DEVICE, requires_grad=False)
    y = ndl.Tensor(rs.randint(0, V, T * B).astype(np.float32), device=DEVICE, requires_grad=False)
    return X, y


@pytest.mark.parametrize("seq_model", ["rnn", "lstm", "transformer"])
def test_language_model_loss_is_softmax_loss_of_its_logits(seq_model):
    """LanguageModel.loss(x, y) == SoftmaxLoss(model(x)[0], y) within 1e-5, with the same parameter gradients;
    model(x) still returns the course's logits and both return the same state h."""
    model = _lm(seq_model)
    X, y = _batch()
    logits, h_ref = model(X)
    assert logits.shape == (24, 30)
    ref = nn.SoftmaxLoss()(logits, y)
    ref.backward()
    ref_grads = [p.grad.numpy() for p in model.parameters()]
    loss, h = model.loss(X, y, chunk_size=7)
    loss.backward()
    np.testing.assert_allclose(loss.numpy(), ref.numpy(), rtol=1e-5)
    assert_close([p.grad.numpy() for p in model.parameters()], ref_grads, rtol=1e-5)
    for a, b in zip(h if isinstance(h, tuple) else [h], h_ref if isinstance(h_ref, tuple) else [h_ref]):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def _loss_and_grads(seq_model, gc, lazy):
    model = _lm(seq_model, gc)
    X, y = _batch()
    with autograd.lazy_mode(lazy):
        loss, _ = model.loss(X, y, chunk_size=5)
        loss.backward()
    return loss.numpy(), [p.grad.numpy() for p in model.parameters()]


@pytest.mark.parametrize("seq_model", ["lstm", "transformer"])
@pytest.mark.parametrize("gc", [dict(), dict(policy="sqrt"), dict(policy="selective")], ids=["all", "sqrt",
                                                                                             "selective"])
def test_language_model_loss_with_gc_is_bit_identical(seq_model, gc):
    """Rule 4: with checkpointing on, LanguageModel.loss and every parameter gradient are bit-identical to gc off,
    eager and lazy alike (4b)."""
    ref_loss, ref_grads = _loss_and_grads(seq_model, None, lazy=False)
    for lazy in (False, True):
        loss, grads = _loss_and_grads(seq_model, gc, lazy)
        assert np.array_equal(loss, ref_loss), (lazy, loss, ref_loss)
        assert all(np.array_equal(g, r) for g, r in zip(grads, ref_grads)), lazy


def _measured_peak(model, make_batch, chunk_size):
    """The allocator's peak over one lazy LanguageModel.loss step, minus the bytes held when it started (before the
    batch is made, as Budget counts it), and predict_peak's prediction for the step's drops."""
    from needle.checkpoint_budget import predict_peak

    model.parameters()
    python_gc.collect()
    nd.reset_peak_memory_stats(DEVICE)
    base = nd.memory_stats(DEVICE)["current_bytes"]
    X, y = make_batch()
    with autograd.lazy_mode(True):
        loss = model.loss(X, y, chunk_size=chunk_size)[0]  # (the transformer's h, zeros outside the graph, dies)
        predicted = predict_peak(loss, {id(n) for n in autograd.find_topo_sort([loss]) if n.drop})
        loss.backward()
    return predicted, nd.memory_stats(DEVICE)["peak_bytes"] - base


@pytest.mark.parametrize("seq_model, gc", [("transformer", None), ("transformer", dict()),
                                           ("transformer", dict(policy="sqrt")), ("rnn", None), ("lstm", None)],
                         ids=["transformer-off", "transformer-all", "transformer-sqrt", "rnn-off", "lstm-off"])
@pytest.mark.parametrize("chunk_size", [None, 8, 13])
def test_budget_ledger_predicts_the_fused_step_within_one_percent(seq_model, gc, chunk_size):
    """predict_peak for a lazy LanguageModel.loss step (the ledger reads the fused ops' workspace) is within 1%
    of the allocator's measured peak (V=200, so the head's chunks matter)."""
    predicted, measured = _measured_peak(_lm(seq_model, gc, V=200), lambda: _batch(T=6, B=16, V=200), chunk_size)
    assert abs(predicted / measured - 1) <= 0.01, (predicted, measured)


@pytest.mark.parametrize("seq_model", ["rnn", "lstm"])
def test_budget_ledger_recurrent_with_gc_within_one_percent(seq_model):
    """RNN/LSTM with gc "all": backward recomputes no gradient (a kept make_tuple's inputs stay), and the
    ledger gives every (re)computed value fresh buffers."""
    predicted, measured = _measured_peak(_lm(seq_model, dict(), V=200), lambda: _batch(T=6, B=16, V=200), 8)
    assert abs(predicted / measured - 1) <= 0.01, (predicted, measured)
