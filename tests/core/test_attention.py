"""Fused attention, ops.scaled_dot_product_attention: the unfused numbers without the T_q x T_k matrix.

The oracle is the unfused nn.MultiHeadAttention (itself checked against PyTorch in test_nn.py): forward and the
gradients of q, k and v within 1e-5 in float32 on the NumPy reference device (tests/backend's
test_attention_compiled.py: on the compiled ones), within 1e-6 in float64 under NEEDLE_BACKEND=np
(np_backend_checks.py, in a subprocess: the backend is read at import), and central differences through conftest's
checker. Memory is counted, not estimated: the allocator's peak inside each compute is exactly what the ops declare
to the Budget's ledger (`workspace`, `compacts_inputs`), and linear in T. In nn, AttentionLayer and the layers
above it attend with the fused op when attention dropout is 0 (or when asked), leave NumPy's random stream exactly
where the unfused path leaves it, and stay bit-identical with checkpointing on and off (rule 4).
"""
import gc as python_gc

import ml_dtypes
import numpy as np
import pytest

import needle as ndl
from needle import autograd, checkpoint, nn, ops
from needle import backend_ndarray as nd
from needle.backend_ndarray import ndarray_backend_numpy as reference
from needle.ops.ops_attention import ScaledDotProductAttention, ScaledDotProductAttentionGrad

from attention_cases import CASES, assert_close, make_arrays, run_attention
from conftest import check_gradients, peak_during, random_out_grad, saves_violation

DEVICE = nd.cpu_numpy()  # the layers' tests: the graph, on the reference (tests/backend: the kernels, compiled)
F32 = 4

def _dense(q, k, v, scale, causal, z=None):
    """The definition in float64: (out, lse) of q (n, T_q, D), k, v."""
    s = q @ np.swapaxes(k, -1, -2) * scale
    T_q, T_k = q.shape[-2], k.shape[-2]
    if causal:
        s[..., np.triu(np.ones((T_q, T_k), dtype=bool), T_k - T_q + 1)] = -np.inf
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    lse = m + np.log(e.sum(-1, keepdims=True))
    p = np.exp(s - lse)
    return (p if z is None else p * z) @ v, lse[..., 0]


# ----- the numbers -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_fused_matches_unfused_forward_and_gradients(device, case):
    """out, dq, dk and dv equal nn.MultiHeadAttention's within 1e-5 (float32), for tiles that divide T and tiles
    that do not, T = 1, D = 1, causal with T_q < T_k (bottom-right aligned) and T_q > T_k without a mask."""
    B, H, T_q, T_k, D, D_v, causal = CASES[case]
    arrays = make_arrays(B, H, T_q, T_k, D, D_v)
    out, grads = run_attention(device, arrays, causal, fused=True)
    ref_out, ref_grads = run_attention(device, arrays, causal, fused=False)
    assert out.shape == (B, H, T_q, D_v) and out.dtype == np.float32
    assert_close([out] + grads, [ref_out] + ref_grads, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_outputs_are_out_and_the_float32_log_sum_exp_of_each_row(device, causal):
    """The op's two outputs against the float64 definition: out within 1e-5, lse (float32) within 1e-5."""
    q, k, v, _ = make_arrays(2, 2, 45, 70, 6, 5, seed=3)
    tensors = [ndl.Tensor(a, device=device) for a in (q, k, v)]
    out, lse = ScaledDotProductAttention(causal, 0.3)(*tensors).tuple()
    ref_out, ref_lse = _dense(*(a.astype(np.float64) for a in (q, k, v)), 0.3, causal)
    assert lse.dtype == "float32" and lse.shape == (2, 2, 45)
    assert_close([out.numpy(), lse.numpy()], [ref_out, ref_lse], rtol=1e-5)


@pytest.mark.parametrize("dtype, rtol", [("float16", 3e-3), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("case", ["T_not_a_tile_multiple_causal", "T_q_gt_T_k_full"])
def test_16bit_storage_float32_arithmetic(device, dtype, rtol, case):
    """float16 / bfloat16 q, k, v: out and the gradients in that dtype, within its rounding of the float64
    definition on the same (rounded) inputs; lse stays float32."""
    B, H, T_q, T_k, D, D_v, causal = CASES[case]
    arrays = [a.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16).astype(np.float32)
              for a in make_arrays(B, H, T_q, T_k, D, D_v)]
    out, grads = run_attention(device, arrays, causal, fused=True, dtype=dtype)
    assert out.dtype == nd.DTYPES[dtype] and all(g.dtype == nd.DTYPES[dtype] for g in grads)
    ref = [run_attention(nd.cpu_numpy(), [a.astype(np.float64) for a in arrays], causal, fused=False, dtype="float32")]
    assert_close([out] + grads, [ref[0][0]] + ref[0][1], rtol=rtol)
    _, lse = ScaledDotProductAttention(causal)(*(ndl.Tensor(a, device=device, dtype=dtype) for a in arrays[:3]))
    assert lse.dtype == "float32"


@pytest.mark.parametrize("causal, dropout_p", [(True, 0.0), (False, 0.0), (True, 0.3)],
                         ids=["causal", "full", "causal-dropout"])
def test_gradient_against_central_differences(device, causal, dropout_p):
    """conftest.check_gradients in a random direction (with dropout: one fixed mask, a hash of the seed)."""
    q, k, v, _ = make_arrays(1, 2, 9, 11, 3, 4, seed=5)

    def fn(q, k, v):
        return ops.scaled_dot_product_attention(q, k, v, causal=causal, scale=0.8, dropout_p=dropout_p, seed=3)

    check_gradients(fn, q, k, v, device=device)


def test_eager_and_lazy_are_bit_identical(device):
    """Rule 4b for the op: the same numbers whether the graph is computed as it is built or afterwards."""
    arrays = make_arrays(2, 2, 70, 70, 5, 5, seed=6)
    eager = run_attention(device, arrays, True, fused=True, dropout_p=0.2, seed=9)
    with autograd.lazy_mode(True):
        lazy = run_attention(device, arrays, True, fused=True, dropout_p=0.2, seed=9)
    assert all(np.array_equal(a, b) for a, b in zip([eager[0]] + eager[1], [lazy[0]] + lazy[1]))


# ----- dropout -----------------------------------------------------------------------------------------------
def test_dropout_mask_is_the_contracts_hash_and_the_same_on_every_device(device):
    """out = (softmax(s) z) v with z = keep / (1 - p), keep[row, col] = hash(seed, row * T_k + col) >= p 2^32 (the
    reference's dropout_keep): within 1e-5 of that definition; about 1 - p of the elements kept."""
    B, H, T_q, T_k, D, p, seed = 2, 2, 40, 75, 4, 0.3, 1234
    q, k, v, _ = make_arrays(B, H, T_q, T_k, D, D, seed=8)
    rows = np.arange(B * H * T_q).reshape(B, H, T_q)
    keep = reference.dropout_keep(seed, rows, np.arange(T_k), T_k, reference.dropout_threshold(p))
    assert abs(keep.mean() - (1 - p)) < 0.01
    ref_out, _ = _dense(*(a.astype(np.float64) for a in (q, k, v)), 1 / np.sqrt(D), True, keep / (1 - p))
    out = ops.scaled_dot_product_attention(*(ndl.Tensor(a, device=device) for a in (q, k, v)), causal=True,
                                           dropout_p=p, seed=seed)
    assert_close([out.numpy()], [ref_out], rtol=1e-5)


def test_seed_none_draws_from_numpys_rng_only_with_dropout():
    q, k, v, _ = (ndl.Tensor(a, device=DEVICE) for a in make_arrays(1, 1, 8, 8, 2, 2))
    np.random.seed(0)
    a = ops.scaled_dot_product_attention(q, k, v, dropout_p=0.5).numpy()
    np.random.seed(0)
    b = ops.scaled_dot_product_attention(q, k, v, dropout_p=0.5).numpy()
    assert np.array_equal(a, b)
    np.random.seed(0)
    ops.scaled_dot_product_attention(q, k, v)
    assert np.random.rand() == np.random.RandomState(0).rand()  # p = 0: nothing drawn


# ----- memory: exact bytes -----------------------------------------------------------------------------------
@pytest.mark.devices("cpu", "cpu_numpy")
@pytest.mark.parametrize("strided", [False, True], ids=["compact", "strided"])
def test_peak_inside_compute_is_exactly_outputs_plus_declared_workspace(device, strided):
    """Forward: out + lse, plus a compact copy of each strided input (compacts_inputs; workspace 0). Gradient:
    dq + dk + dv + the declared workspace (delta, one float32 per query row), plus the copies of strided inputs
    (dlse is the broadcast zero TupleGetItem gives an unused lse). Exact bytes, as the Budget's ledger counts."""
    B, H, T_q, T_k, D, D_v = 2, 3, 70, 90, 8, 6
    arrays = make_arrays(B, H, T_q, T_k, D, D_v)
    if strided:  # q as the heads of a projection: a transposed (B, T, H, D) array
        q = nd.array(arrays[0].transpose(0, 2, 1, 3).copy(), device=device).permute((0, 2, 1, 3))
    else:
        q = nd.array(arrays[0], device=device)
    k, v = (nd.array(a, device=device) for a in arrays[1:3])
    shapes = [x.shape for x in (q, k, v)]
    forward = ScaledDotProductAttention(causal=True)
    peak, (out, lse) = peak_during(device, lambda: forward.compute(q, k, v))
    outputs = F32 * (B * H * T_q * D_v + B * H * T_q)
    assert peak == outputs + F32 * (forward.workspace(*shapes) + strided * q.size), (peak, outputs)

    dout = nd.array(arrays[3], device=device)
    dlse = nd.full((1, 1, 1), 0.0, device=device).broadcast_to((B, H, T_q)) if strided else \
        nd.array(np.zeros((B, H, T_q)), device=device)
    backward = ScaledDotProductAttentionGrad(causal=True)
    peak, grads = peak_during(device, lambda: backward.compute(q, k, v, out, lse, dout, dlse))
    outputs = F32 * sum(x.size for x in (q, k, v))
    copies = strided * (q.size + dlse.size)
    assert peak == outputs + F32 * (backward.workspace(*shapes, out.shape, lse.shape, dout.shape, dlse.shape)
                                    + copies), (peak, outputs)


@pytest.mark.devices("cpu", "cpu_numpy")
def test_peak_of_forward_and_backward_is_linear_in_T(device):
    """The issue's goal at a size tests can afford: the peak of the fused forward + backward beyond the output and
    the three input gradients is under 20% of one float32 B·H·T·T tensor (the unfused path's is several)."""
    B, H, T, D = 1, 2, 512, 16
    arrays = make_arrays(B, H, T, T, D, D)
    bht2 = F32 * B * H * T * T
    peaks = {}
    for fused in (True, False):
        python_gc.collect()
        q, k, v = (ndl.Tensor(a, device=device) for a in arrays[:3])
        proj = ndl.Tensor(arrays[3], device=device, requires_grad=False)
        python_gc.collect()
        nd.reset_peak_memory_stats(device)
        base = nd.memory_stats(device)["current_bytes"]
        _run_graph = (lambda: ops.scaled_dot_product_attention(q, k, v, causal=True)) if fused else \
            (lambda: nn.MultiHeadAttention(causal=True, device=device).eval()(q, k, v)[0])
        (_run_graph() * proj).sum().backward()
        peaks[fused] = nd.memory_stats(device)["peak_bytes"] - base - F32 * 4 * B * H * T * D  # out, dq, dk, dv
    assert peaks[True] <= 0.2 * bht2, (peaks, bht2)
    assert peaks[False] >= 2 * bht2, (peaks, bht2)


def _lazy_step_peak(model, make_x):
    """predict_peak of a lazy step and the allocator's measured peak (above the bytes held before the batch)."""
    from needle.checkpoint_budget import predict_peak

    model.parameters()
    python_gc.collect()
    nd.reset_peak_memory_stats(DEVICE)
    base = nd.memory_stats(DEVICE)["current_bytes"]
    x = make_x()
    with autograd.lazy_mode(True):
        out = model(x)
        loss = (out * out).sum()
        predicted = predict_peak(loss, {id(n) for n in autograd.find_topo_sort([loss]) if n.drop})
        loss.backward()
    return predicted, nd.memory_stats(DEVICE)["peak_bytes"] - base


@pytest.mark.parametrize("gc", [None, dict(), dict(policy="sqrt"), dict(policy="selective")],
                         ids=["off", "all", "sqrt", "selective"])
def test_budget_ledger_predicts_a_fused_transformer_layer_within_one_percent(gc):
    """The ledger reads the fused ops' saves, workspace and compacts_inputs: its prediction for a lazy
    TransformerLayer step (fused attention, T not a tile multiple) is within 1% of the allocator's peak."""
    np.random.seed(0)
    layer = nn.TransformerLayer(16, 2, 8, 32, device=DEVICE)
    assert layer.attention.uses_fused_attention()
    if gc is not None:
        layer.enable_gc(**gc)
    rs = np.random.RandomState(0)
    predicted, measured = _lazy_step_peak(layer, lambda: ndl.Tensor(rs.randn(4, 70, 16).astype(np.float32),
                                                                    device=DEVICE, requires_grad=False))
    assert abs(predicted / measured - 1) <= 0.01, (predicted, measured)


def _activation_bytes(fused, T=64, dropout=0.1):
    """M_act of a Transformer step with gc "all": bytes held when backward starts, above those held before."""
    np.random.seed(0)
    model = nn.Transformer(16, 32, 2, num_head=2, dim_head=8, device=DEVICE, batch_first=True, sequence_len=T,
                           dropout=dropout, fused_attention=fused).enable_gc()
    params = model.parameters()
    rs = np.random.RandomState(0)
    python_gc.collect()
    base = nd.memory_stats(DEVICE)["current_bytes"]
    x = ndl.Tensor(rs.randn(4, T, 16).astype(np.float32), device=DEVICE)
    out, _ = model(x)
    loss = (out * out).sum()
    act = nd.memory_stats(DEVICE)["current_bytes"] - base
    loss.backward()
    assert all(p.grad is not None for p in params)
    return act


def test_gc_all_with_fused_attention_keeps_at_least_2x_fewer_activation_bytes():
    """gc "all" keeps only region boundaries and leaves; with attention dropout, unfused attention's leaves include
    a B·H·T·T dropout mask per layer, which the fused op regenerates from its seed instead of keeping."""
    fused, unfused = _activation_bytes(True), _activation_bytes(False)
    assert 2 * fused <= unfused, (fused, unfused)


def test_without_dropout_no_mask_is_kept_either_way():
    """At dropout 0 neither path keeps a dropout mask (Dropout(0) is the identity after its draw): with gc "all"
    the unfused path keeps only its T x T causal mask per layer beyond the fused path's boundaries; what fusing
    saves there is the recomputation and the peak, not M_act."""
    T = 64
    fused, unfused = _activation_bytes(True, T, dropout=0.0), _activation_bytes(False, T, dropout=0.0)
    assert unfused - fused == 2 * T * T * 4, (fused, unfused)  # 2 layers' float32 causal masks


# ----- nn: which path, the random stream, checkpointing ---------------------------------------------------------
def test_layers_choose_the_fused_path_when_dropout_is_0_or_inactive_or_when_asked():
    for dropout, fused, expected in [(0.0, None, True), (0.1, None, False), (0.1, True, True), (0.0, False, False)]:
        layer = nn.AttentionLayer(8, 2, 4, dropout=dropout, fused_attention=fused, device=DEVICE)
        assert layer.uses_fused_attention() is expected, (dropout, fused)
        block = nn.TransformerLayer(8, 2, 4, 16, dropout=dropout, fused_attention=fused, device=DEVICE)
        model = nn.Transformer(8, 16, 2, num_head=2, dim_head=4, dropout=dropout, fused_attention=fused,
                               device=DEVICE, sequence_len=8)
        assert block.attention.uses_fused_attention() is expected
        assert all(m.attention.uses_fused_attention() is expected for m in model.layers)
        out = layer(ndl.Tensor(np.ones((2, 5, 8), dtype=np.float32), device=DEVICE))
        ops_used = {type(n.op).__name__ for n in autograd.find_topo_sort([out]) if n.op is not None}
        assert ("ScaledDotProductAttention" in ops_used) is expected
        # In eval mode dropout is inactive: the default fuses whatever p is (nothing is drawn either way).
        assert layer.eval().uses_fused_attention() is (fused is not False)


def _rng_state():
    key, pos = np.random.get_state()[1:3]
    return key.copy(), pos


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_fused_path_leaves_numpys_random_stream_as_the_unfused_path(dropout, training):
    """The unfused path draws np.random.rand(B, H, T, S) for its dropout mask in training mode (even at p = 0); the
    fused path draws as many numbers, so every later draw (the course's golden values) is unchanged."""
    states = []
    for fused in (True, False):
        np.random.seed(0)
        model = nn.Transformer(8, 16, 2, num_head=2, dim_head=4, dropout=dropout, fused_attention=fused,
                               device=DEVICE, sequence_len=8)
        model.train() if training else model.eval()
        x = ndl.Tensor(np.random.RandomState(1).randn(5, 3, 8).astype(np.float32), device=DEVICE)
        np.random.seed(5)
        model(x)
        states.append(_rng_state())
    assert np.array_equal(states[0][0], states[1][0]) and states[0][1] == states[1][1]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fused_transformer_matches_unfused_in_training_mode(device, causal):
    """nn.Transformer in training mode at dropout 0: the fused and unfused attention give the same output and
    parameter gradients within 1e-5 (the layers' own dropout masks see the same random stream)."""
    results = []
    for fused in (True, False):
        np.random.seed(0)
        model = nn.Transformer(8, 16, 2, num_head=2, dim_head=4, causal=causal, fused_attention=fused,
                               device=device, sequence_len=80)
        x = ndl.Tensor(np.random.RandomState(1).randn(70, 2, 8).astype(np.float32), device=device)
        out, _ = model(x)
        (out * out).sum().backward()
        results.append([out.numpy(), x.grad.numpy()] + [p.grad.numpy() for p in model.parameters()])
    assert_close(results[0], results[1], rtol=1e-5, common_scale=True)


def _module_grads(make, gc, lazy, shape):
    np.random.seed(0)
    module = make()
    if gc is not None:
        module.enable_gc(**gc)
    x = ndl.Tensor(np.random.RandomState(1).randn(*shape).astype(np.float32), device=DEVICE)
    np.random.seed(2)
    with autograd.lazy_mode(lazy):
        out = module(x)
        out = out[0] if isinstance(out, tuple) else out
        loss = (out * out).sum()
        loss.backward()
    return [loss.numpy(), x.grad.numpy()] + [p.grad.numpy() for p in module.parameters()], \
        checkpoint.last_backward_stats()


FUSED_MODULES = {
    "AttentionLayer-p0": (lambda: nn.AttentionLayer(8, 2, 4, device=DEVICE), (2, 70, 8)),
    "AttentionLayer-p0.2-fused": (lambda: nn.AttentionLayer(8, 2, 4, dropout=0.2, fused_attention=True,
                                                            device=DEVICE), (2, 70, 8)),
    "TransformerLayer-p0.2-fused": (lambda: nn.TransformerLayer(8, 2, 4, 16, dropout=0.2, fused_attention=True,
                                                                device=DEVICE), (2, 5, 8)),
    "Transformer-p0": (lambda: nn.Transformer(8, 16, 2, num_head=2, dim_head=4, device=DEVICE, sequence_len=8),
                       (5, 2, 8)),
}


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("gc", [dict(), dict(segment_len=2), dict(policy="sqrt"), dict(policy="selective")],
                         ids=["all", "seg2", "sqrt", "selective"])
@pytest.mark.parametrize("name", list(FUSED_MODULES))
def test_rule4_fused_attention_layers_bit_identical_with_gc(name, gc, lazy):
    """Rule 4 (and rule 2): with the fused op inside (its dropout mask regenerated from the seed, not stored),
    loss and every gradient are bit-identical to gc off; nothing is recomputed twice."""
    make, shape = FUSED_MODULES[name]
    off, _ = _module_grads(make, None, False, shape)
    on, stats = _module_grads(make, gc, lazy, shape)
    assert len(off) == len(on) and all(np.array_equal(a, b) for a, b in zip(off, on))
    assert stats["max_recomputes_per_node"] <= 1


# ----- errors and the op contract ------------------------------------------------------------------------------
def test_bad_inputs_raise_errors_naming_the_op_and_the_shapes():
    def t(*shape, dtype="float32"):
        return ndl.Tensor(np.ones(shape, dtype=np.float32), device=DEVICE, dtype=dtype)

    q, k, v = t(2, 3, 5, 4), t(2, 3, 6, 4), t(2, 3, 6, 7)
    shape_cases = [(t(3, 5, 4), k, v), (q, t(2, 2, 6, 4), v), (q, t(2, 3, 6, 3), v), (q, k, t(2, 3, 5, 7)),
                   (t(2, 3, 0, 4), k, v), (q, t(2, 3, 0, 4), t(2, 3, 0, 7))]
    for args in shape_cases:
        with pytest.raises(ValueError, match=r"scaled_dot_product_attention: needs q \(B, H, T_q, D\).*got q \("):
            ops.scaled_dot_product_attention(*args)
    with pytest.raises(ValueError, match=r"T_q=6 > T_k=5.*needs T_q <= T_k"):
        ops.scaled_dot_product_attention(t(2, 3, 6, 4), t(2, 3, 5, 4), t(2, 3, 5, 7), causal=True)
    ops.scaled_dot_product_attention(t(2, 3, 6, 4), t(2, 3, 5, 4), t(2, 3, 5, 7))  # without a mask it is fine
    with pytest.raises(TypeError, match="one dtype"):
        ops.scaled_dot_product_attention(q, k, t(2, 3, 6, 7, dtype="float16"))
    with pytest.raises(TypeError, match="q must be a Tensor"):
        ops.scaled_dot_product_attention(np.ones((2, 3, 5, 4)), k, v)
    for bad in (float("nan"), float("inf"), "0.5", True):
        with pytest.raises(ValueError, match="scale"):
            ops.scaled_dot_product_attention(q, k, v, scale=bad)
    for bad in (1.0, -0.1, 1.5, True, None):
        with pytest.raises(ValueError, match="dropout_p"):
            ops.scaled_dot_product_attention(q, k, v, dropout_p=bad)


def test_backends_check_their_arguments(device):
    """The array functions and the backend modules refuse what the contract excludes, with errors naming the
    function: causal T_q > T_k, sizes, dtypes, dropout_p."""
    q, k, v = (nd.array(np.ones(s), device=device) for s in [(2, 6, 4), (2, 5, 4), (2, 5, 3)])
    with pytest.raises(ValueError, match="attention_forward: causal attention .*T_q=6 > T_k=5"):
        nd.attention_forward(q, k, v, 0.5, causal=True)
    with pytest.raises(ValueError, match="attention_forward: needs q"):
        nd.attention_forward(q, v, v, 0.5)
    with pytest.raises(TypeError, match="one dtype"):
        nd.attention_forward(q, k, v.astype("float16"), 0.5)
    with pytest.raises(TypeError, match="storage"):
        nd.attention_forward(*(a.astype("int8") for a in (q, k, v)), 0.5)
    out, lse = nd.attention_forward(q, k, v, 0.5)
    mod, h = device.mod, (lambda a: a.buffer)
    dims = (2, 6, 5, 4, 3)
    with pytest.raises(ValueError, match="attention_forward: dropout_p"):
        mod.attention_forward(h(q), h(k), h(v), h(out), h(lse), *dims, 0.5, False, 1.0, 0)
    with pytest.raises(ValueError, match="attention_forward: out has"):
        mod.attention_forward(h(q), h(k), h(v), h(lse), h(lse), *dims, 0.5, False, 0.0, 0)
    with pytest.raises(TypeError, match="attention_forward: lse must be float32"):
        mod.attention_forward(h(q), h(k), h(v), h(out), h(lse.astype("float16")), *dims, 0.5, False, 0.0, 0)
    with pytest.raises(ValueError, match="attention_backward: needs out and dout"):
        nd.attention_backward(q, k, v, out, lse, out, out, 0.5)


def test_op_contract_saves_shapes_and_no_second_derivative():
    """`saves` is truthful (conftest.saves_violation's probe), gradient returns one entry per input, shapes are inferred
    lazily without computing, and differentiating the gradient says what to use instead."""
    q, k, v, _ = make_arrays(1, 2, 5, 7, 3, 4)
    with autograd.lazy_mode(True):
        args = [ndl.Tensor(a, device=nd.cpu_numpy()) for a in (q, k, v)]
        out = ops.scaled_dot_product_attention(*args, causal=True)
        node = out.inputs[0]
        assert out.shape == (1, 2, 5, 4) and node.shape == ((1, 2, 5, 4), (1, 2, 5)) and node.cached_data is None
        grads = node.op.gradient(random_out_grad(node, np.random.default_rng(0)), node)
        assert type(grads) is tuple and [g.shape for g in grads] == [(1, 2, 5, 3), (1, 2, 7, 3), (1, 2, 7, 4)]
        assert grads[0].cached_data is None
    node.realize_cached_data()
    assert saves_violation(node, random_out_grad(node, np.random.default_rng(0))) is None
    grad_node = grads[0].inputs[0]
    assert isinstance(grad_node.op, ScaledDotProductAttentionGrad) and grad_node.op.saves == "inputs"
    with pytest.raises(NotImplementedError, match="second derivatives .*MultiHeadAttention"):
        grad_node.op.gradient(grad_node, grad_node)


def test_autocast_runs_attention_in_the_low_dtype_with_float32_row_statistics():
    """Under autocast the op is a matmul: q, k, v cast to the 16-bit dtype, lse float32, gradients back in float32
    for float32 leaves."""
    q, k, v, _ = (ndl.Tensor(a, device=DEVICE) for a in make_arrays(1, 2, 9, 9, 4, 4))
    with ndl.autocast("bfloat16"):
        out = ops.scaled_dot_product_attention(q, k, v, causal=True)
    assert out.dtype == "bfloat16" and out.inputs[0].inputs[0].dtype == "bfloat16"
    out.astype("float32").sum().backward()
    assert q.grad.dtype == "float32"
