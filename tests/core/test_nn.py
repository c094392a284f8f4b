"""needle.nn layers against PyTorch (CPU, float32) with the same weights, plus init order, errors and gc hooks.

Every comparison backpropagates a fixed random projection of the output, so every output element's gradient
is exercised, and checks the output and the gradients of the inputs and of every parameter.
"""
import math

import numpy as np
import pytest

import needle as ndl
from needle import autograd, checkpoint, nn
from needle import backend_ndarray as nd

from conftest import peak_during, requires_torch

LAZY = [pytest.param(False, id="eager"), pytest.param(True, id="lazy")]


# ----- local helpers --------------------------------------------------------------------------------------------
def assert_close(actual, expected, tol=1e-5, msg=""):
    """float32 agreement: relative tol, and an absolute tol scaled by the expected values' magnitude."""
    expected = np.asarray(expected, dtype=np.float64)
    scale = max(1.0, float(np.abs(expected).max())) if expected.size else 1.0
    np.testing.assert_allclose(np.asarray(actual, dtype=np.float64), expected, rtol=tol, atol=tol * scale,
                               err_msg=msg)


def randn(rs, *shape):
    return rs.randn(*shape).astype(np.float32)


def tensor(a, device, requires_grad=True):
    return ndl.Tensor(a, device=device, requires_grad=requires_grad)


def randomize(module, rs, device):
    """Give every parameter random values (so norms' ones/zeros do not hide mistakes); return them as NumPy."""
    values = []
    for p in module.parameters():
        v = randn(rs, *p.shape) * 0.5
        p.data = ndl.Tensor(v, device=device)
        values.append(v)
    return values


def backward_projected(out, rs, device):
    """Backpropagate sum(out * P) for a random P; return P (NumPy) for the torch side."""
    proj = randn(rs, *out.shape)
    (out * tensor(proj, device, requires_grad=False)).sum().backward()
    return proj


def torch_params(torch, values):
    return [torch.tensor(v, requires_grad=True) for v in values]


def assert_param_grads(module, tparams, transforms=None, tol=1e-5):
    for i, (p, t) in enumerate(zip(module.parameters(), tparams)):
        expected = t.grad.numpy()
        if transforms is not None:
            expected = transforms[i](expected)
        assert p.grad is not None, f"parameter {i} got no gradient"
        assert_close(p.grad.numpy(), expected, tol, msg=f"gradient of parameter {i}")


# ----- torch references ------------------------------------------------------------------------------------------
def t_layernorm(torch, x, w, b, eps=1e-5):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps)


def t_attention(torch, q, k, v, causal):
    T, S = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        mask = torch.triu(torch.ones(T, S, dtype=torch.bool), S - T + 1)
        scores = scores.masked_fill(mask, -torch.finfo(torch.float32).max)
    probs = torch.softmax(scores, dim=-1)
    return probs @ v, probs


def t_attention_layer(torch, ps, q, k, v, heads, dim_head, causal):
    """ps in AttentionLayer.parameters() order: 3 x (norm weight, bias), then q, k, v, out projections."""
    wq, bq, wk, bk, wv, bv, pq, pk, pv, po = ps
    B, T, _ = q.shape
    S = k.shape[1]

    def split(x, n):
        return x.reshape(B, n, heads, dim_head).transpose(1, 2)

    qh = split(t_layernorm(torch, q, wq, bq) @ pq, T)
    kh = split(t_layernorm(torch, k, wk, bk) @ pk, S)
    vh = split(t_layernorm(torch, v, wv, bv) @ pv, S)
    result, _ = t_attention(torch, qh, kh, vh, causal)
    return result.transpose(1, 2).reshape(B, T, heads * dim_head) @ po


def t_transformer_layer(torch, ps, x, heads, dim_head, causal):
    norm_w, norm_b, w1, b1, w2, b2 = ps[10:]
    h = x + t_attention_layer(torch, ps[:10], x, x, x, heads, dim_head, causal)
    return h + torch.relu(t_layernorm(torch, h, norm_w, norm_b) @ w1 + b1) @ w2 + b2


# ----- Linear, activations, containers --------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(5, 4), (2, 3, 4), (4,)], ids=["2d", "3d", "1d"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_linear_matches_torch(device, shape, bias):
    torch = requires_torch()
    rs = np.random.RandomState(0)
    layer = nn.Linear(4, 3, bias=bias, device=device)
    values = randomize(layer, rs, device)
    x_np = randn(rs, *shape)
    x = tensor(x_np, device)
    out = layer(x)
    proj = backward_projected(out, rs, device)

    tx = torch.tensor(x_np, requires_grad=True)
    tp = torch_params(torch, values)
    t_out = tx @ tp[0] + (tp[1][0] if bias else 0)
    (t_out * torch.tensor(proj)).sum().backward()
    assert out.shape == tuple(t_out.shape)
    assert_close(out.numpy(), t_out.detach().numpy())
    assert_close(x.grad.numpy(), tx.grad.numpy())
    assert_param_grads(layer, tp)
    if bias:
        assert layer.bias.shape == (1, 3)


@pytest.mark.devices("cpu", "cpu_numpy")
def test_linear_is_one_op_that_reads_the_bias_in_place(device):
    """nn.Linear is one graph node (ops.linear) whose inputs are x, the weight and the bias; the bias is added
    through a stride-0 view (no broadcast copy): the op allocates its output and x W (its declared workspace)."""
    layer = nn.Linear(3, 2, device=device)
    x = ndl.Tensor(np.ones((4, 5, 3), dtype=np.float32), device=device, requires_grad=False)
    with autograd.lazy_mode(True):
        out = layer(x)
    assert type(out.op).__name__ == "Linear" and out.inputs == (x, layer.weight, layer.bias)
    if device is nd.cpu():
        peak, _ = peak_during(device, out.realize_cached_data)
        assert peak == 4 * (20 * 2 + out.op.workspace((4, 5, 3), (3, 2)))
    np.testing.assert_array_equal(out.numpy(), (x.numpy().reshape(20, 3) @ layer.weight.numpy()
                                                + layer.bias.numpy()).reshape(4, 5, 2))


@pytest.mark.smoke
def test_parameter_creation_order_reproduces_draws():
    np.random.seed(3)
    layer = nn.Linear(7, 5)
    np.random.seed(3)
    b_w = math.sqrt(2) * math.sqrt(3 / 7)
    w = (np.random.rand(7, 5).astype(np.float32) * (2 * b_w) - b_w)
    b_b = math.sqrt(2) * math.sqrt(3 / 5)
    b = (np.random.rand(5, 1).astype(np.float32) * (2 * b_b) - b_b).reshape(1, 5)
    np.testing.assert_allclose(layer.weight.numpy(), w, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(layer.bias.numpy(), b, rtol=1e-6, atol=1e-7)

    np.random.seed(4)
    conv = nn.Conv(3, 4, 3)
    np.random.seed(4)
    fan_in = 3 * 9
    bound = math.sqrt(2) * math.sqrt(3 / fan_in)
    w = np.random.rand(3, 3, 3, 4).astype(np.float32) * (2 * bound) - bound
    bias_bound = 1 / math.sqrt(fan_in)
    b = np.random.rand(4).astype(np.float32) * (2 * bias_bound) - bias_bound
    np.testing.assert_allclose(conv.weight.numpy(), w, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(conv.bias.numpy(), b, rtol=1e-6, atol=1e-7)

    np.random.seed(5)
    cell = nn.LSTMCell(3, 2)
    np.random.seed(5)
    draws = [np.random.rand(*s).astype(np.float32) for s in [(3, 8), (2, 8), (8,), (8,)]]
    bound = 1 / math.sqrt(2)
    for p, d in zip([cell.W_ih, cell.W_hh, cell.bias_ih, cell.bias_hh], draws):
        np.testing.assert_allclose(p.numpy(), d * (2 * bound) - bound, rtol=1e-6, atol=1e-7)

    np.random.seed(6)
    emb = nn.Embedding(5, 3)
    np.random.seed(6)
    np.testing.assert_allclose(emb.weight.numpy(), np.random.randn(5, 3).astype(np.float32))


@pytest.mark.smoke
def test_activations_flatten_identity_sequential_residual(device):
    rs = np.random.RandomState(1)
    x_np = randn(rs, 2, 3, 4)
    x = tensor(x_np, device)
    np.testing.assert_allclose(nn.ReLU()(x).numpy(), np.maximum(x_np, 0))
    np.testing.assert_allclose(nn.Tanh()(x).numpy(), np.tanh(x_np), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(nn.Sigmoid()(x).numpy(), 1 / (1 + np.exp(-x_np)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(nn.Flatten()(x).numpy(), x_np.reshape(2, 12))
    assert nn.Identity()(x) is x
    model = nn.Sequential(nn.Flatten(), nn.Residual(nn.Sequential(nn.ReLU(), nn.Tanh())))
    np.testing.assert_allclose(model(x).numpy(), np.tanh(np.maximum(x_np.reshape(2, 12), 0)) + x_np.reshape(2, 12),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.smoke
def test_module_parameters_train_eval_reach_nested_containers():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = {"first": nn.Linear(2, 3), "rest": [nn.Dropout(0.5), (nn.BatchNorm1d(3),)]}
            self.head = nn.Sequential(nn.Linear(3, 1))

    net = Net()
    first, bn, head = net.blocks["first"], net.blocks["rest"][1][0], net.head.modules[0]
    expected = [first.weight, first.bias, bn.weight, bn.bias, head.weight, head.bias]
    assert [id(p) for p in net.parameters()] == [id(p) for p in expected]
    assert all(isinstance(p, nn.Parameter) for p in net.parameters())
    assert not any(p is bn.running_mean or p is bn.running_var for p in net.parameters())
    net.eval()
    assert not net.training and not net.blocks["rest"][0].training and not bn.training and not head.training
    net.train()
    assert net.training and net.blocks["rest"][0].training and bn.training and head.training


# ----- norms -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 5)], ids=["2d", "3d"])
def test_layernorm_matches_torch(device, shape):
    torch = requires_torch()
    rs = np.random.RandomState(2)
    layer = nn.LayerNorm1d(5, device=device)
    assert np.array_equal(layer.weight.numpy(), np.ones(5)) and np.array_equal(layer.bias.numpy(), np.zeros(5))
    values = randomize(layer, rs, device)
    x_np = randn(rs, *shape) * 3 + 1
    x = tensor(x_np, device)
    out = layer(x)
    proj = backward_projected(out, rs, device)
    tx = torch.tensor(x_np, requires_grad=True)
    tp = torch_params(torch, values)
    t_out = t_layernorm(torch, tx, *tp)
    (t_out * torch.tensor(proj)).sum().backward()
    assert_close(out.numpy(), t_out.detach().numpy())
    assert_close(x.grad.numpy(), tx.grad.numpy())
    assert_param_grads(layer, tp)


def _batchnorm_case(torch, device, layer, x_np, to_nchw):
    """Two train steps then one eval step against torch's batch_norm; checks running stats as well."""
    rs = np.random.RandomState(3)
    values = randomize(layer, rs, device)
    tp = torch_params(torch, values)
    t_mean, t_var = torch.zeros(layer.dim), torch.ones(layer.dim)
    expected_var = np.ones(layer.dim)
    m = layer.momentum
    for step in range(3):
        train = step < 2
        layer.train() if train else layer.eval()
        xs = x_np + step
        x = tensor(xs, device)
        out = layer(x)
        proj = backward_projected(out, rs, device)
        tx = torch.tensor(xs, requires_grad=True)
        for t in tp:
            t.grad = None
        t_out = torch.nn.functional.batch_norm(tx, t_mean, t_var, tp[0], tp[1], training=train, momentum=m,
                                               eps=layer.eps)
        (t_out * torch.tensor(proj)).sum().backward()
        assert_close(out.numpy(), t_out.detach().numpy(), msg=f"step {step}")
        assert_close(x.grad.numpy(), tx.grad.numpy(), msg=f"step {step}")
        assert_param_grads(layer, tp)
        if train:
            # The course's running variance uses the biased batch variance (torch uses the unbiased one).
            flat = to_nchw(xs)
            expected_var = (1 - m) * expected_var + m * flat.astype(np.float64).var(axis=0)
            t_var = torch.tensor(expected_var, dtype=torch.float32)  # torch's eval step then uses our statistics
        assert_close(layer.running_mean.numpy(), t_mean.numpy(), msg=f"running mean, step {step}")
        assert_close(layer.running_var.numpy(), expected_var, msg=f"running var, step {step}")
        assert not isinstance(layer.running_mean, nn.Parameter)
        assert layer.running_mean.op is None and layer.running_var.op is None  # no graph grows across steps


def test_batchnorm1d_train_eval_matches_torch(device):
    torch = requires_torch()
    rs = np.random.RandomState(4)
    layer = nn.BatchNorm1d(4, momentum=0.2, device=device)
    _batchnorm_case(torch, device, layer, randn(rs, 6, 4) * 2 + 0.5, lambda x: x)


def test_batchnorm2d_train_eval_matches_torch(device):
    torch = requires_torch()
    rs = np.random.RandomState(5)
    layer = nn.BatchNorm2d(3, device=device)
    _batchnorm_case(torch, device, layer, randn(rs, 2, 3, 4, 5) * 2 + 0.5,
                    lambda x: x.transpose(0, 2, 3, 1).reshape(-1, 3))


# ----- convolution -----------------------------------------------------------------------------------------------
CONV_CASES = [(3, 4, 3, 1, 6), (2, 5, 5, 2, 9), (4, 2, 1, 1, 5), (3, 3, 3, 2, 8), (2, 3, 7, 4, 11), (1, 2, 2, 1, 5)]


@pytest.mark.parametrize("case", CONV_CASES, ids=[f"c{a}-{b}k{k}s{s}h{h}" for a, b, k, s, h in CONV_CASES])
def test_conv_matches_torch(device, case):
    torch = requires_torch()
    c_in, c_out, k, stride, size = case
    rs = np.random.RandomState(6)
    layer = nn.Conv(c_in, c_out, k, stride=stride, device=device)
    values = [layer.weight.numpy(), layer.bias.numpy()]
    x_np = randn(rs, 2, c_in, size, size + 1)
    x = tensor(x_np, device)
    out = layer(x)
    proj = backward_projected(out, rs, device)
    tx = torch.tensor(x_np, requires_grad=True)
    tw = torch.tensor(values[0].transpose(3, 2, 0, 1).copy(), requires_grad=True)
    tb = torch.tensor(values[1], requires_grad=True)
    t_out = torch.nn.functional.conv2d(tx, tw, tb, stride=stride, padding=k // 2)
    (t_out * torch.tensor(proj)).sum().backward()
    assert out.shape == tuple(t_out.shape)
    assert_close(out.numpy(), t_out.detach().numpy())
    assert_close(x.grad.numpy(), tx.grad.numpy())
    assert_close(layer.weight.grad.numpy(), tw.grad.numpy().transpose(2, 3, 1, 0))
    assert_close(layer.bias.grad.numpy(), tb.grad.numpy())


# ----- sequence models ---------------------------------------------------------------------------------------------
def _copy_to_torch_rnn(torch, t_model, cells):
    with torch.no_grad():
        for k, cell in enumerate(cells):
            getattr(t_model, f"weight_ih_l{k}").copy_(torch.tensor(cell.W_ih.numpy().T))
            getattr(t_model, f"weight_hh_l{k}").copy_(torch.tensor(cell.W_hh.numpy().T))
            if cell.bias_ih is not None:
                getattr(t_model, f"bias_ih_l{k}").copy_(torch.tensor(cell.bias_ih.numpy()))
                getattr(t_model, f"bias_hh_l{k}").copy_(torch.tensor(cell.bias_hh.numpy()))


def _assert_rnn_param_grads(t_model, cells):
    for k, cell in enumerate(cells):
        assert_close(cell.W_ih.grad.numpy(), getattr(t_model, f"weight_ih_l{k}").grad.numpy().T)
        assert_close(cell.W_hh.grad.numpy(), getattr(t_model, f"weight_hh_l{k}").grad.numpy().T)
        if cell.bias_ih is not None:
            assert_close(cell.bias_ih.grad.numpy(), getattr(t_model, f"bias_ih_l{k}").grad.numpy())
            assert_close(cell.bias_hh.grad.numpy(), getattr(t_model, f"bias_hh_l{k}").grad.numpy())


RNN_CASES = [(1, True, "tanh", True), (2, False, "tanh", True), (2, True, "relu", False), (3, True, "tanh", True)]


@pytest.mark.parametrize("case", RNN_CASES, ids=[f"L{n}-{'h0' if h else 'noh0'}-{a}-{'b' if b else 'nob'}"
                                                 for n, h, a, b in RNN_CASES])
def test_rnn_matches_torch(device, case):
    torch = requires_torch()
    layers, with_h0, act, bias = case
    np.random.seed(7)
    rs = np.random.RandomState(7)
    T, B, d_in, hid = 4, 3, 5, 6
    model = nn.RNN(d_in, hid, num_layers=layers, bias=bias, nonlinearity=act, device=device)
    t_model = torch.nn.RNN(d_in, hid, num_layers=layers, bias=bias, nonlinearity=act)
    _copy_to_torch_rnn(torch, t_model, model.rnn_cells)
    x_np, h_np = randn(rs, T, B, d_in), randn(rs, layers, B, hid)
    x = tensor(x_np, device)
    h0 = tensor(h_np, device) if with_h0 else None
    out, h_n = model(x, h0)
    proj_out, proj_h = randn(rs, T, B, hid), randn(rs, layers, B, hid)
    ((out * tensor(proj_out, device, False)).sum() + (h_n * tensor(proj_h, device, False)).sum()).backward()

    tx = torch.tensor(x_np, requires_grad=True)
    th = torch.tensor(h_np, requires_grad=True)
    t_out, t_hn = t_model(tx, th) if with_h0 else t_model(tx)
    ((t_out * torch.tensor(proj_out)).sum() + (t_hn * torch.tensor(proj_h)).sum()).backward()
    assert out.shape == (T, B, hid) and h_n.shape == (layers, B, hid)
    assert_close(out.numpy(), t_out.detach().numpy())
    assert_close(h_n.numpy(), t_hn.detach().numpy())
    assert_close(x.grad.numpy(), tx.grad.numpy())
    if with_h0:
        assert_close(h0.grad.numpy(), th.grad.numpy())
    _assert_rnn_param_grads(t_model, model.rnn_cells)


LSTM_CASES = [(1, True, True), (2, False, True), (2, True, False), (3, False, True)]


@pytest.mark.parametrize("case", LSTM_CASES, ids=[f"L{n}-{'h0' if h else 'noh0'}-{'b' if b else 'nob'}"
                                                  for n, h, b in LSTM_CASES])
def test_lstm_matches_torch(device, case):
    torch = requires_torch()
    layers, with_state, bias = case
    np.random.seed(8)
    rs = np.random.RandomState(8)
    T, B, d_in, hid = 4, 2, 3, 5
    model = nn.LSTM(d_in, hid, num_layers=layers, bias=bias, device=device)
    t_model = torch.nn.LSTM(d_in, hid, num_layers=layers, bias=bias)
    _copy_to_torch_rnn(torch, t_model, model.lstm_cells)
    x_np, h_np, c_np = randn(rs, T, B, d_in), randn(rs, layers, B, hid), randn(rs, layers, B, hid)
    x, h0, c0 = tensor(x_np, device), tensor(h_np, device), tensor(c_np, device)
    out, (h_n, c_n) = model(x, (h0, c0) if with_state else None)
    projs = [randn(rs, T, B, hid), randn(rs, layers, B, hid), randn(rs, layers, B, hid)]
    sum((v * tensor(p, device, False)).sum() for v, p in zip((out, h_n, c_n), projs)).backward()

    tx, th, tc = (torch.tensor(a, requires_grad=True) for a in (x_np, h_np, c_np))
    t_out, (t_h, t_c) = t_model(tx, (th, tc)) if with_state else t_model(tx)
    sum((v * torch.tensor(p)).sum() for v, p in zip((t_out, t_h, t_c), projs)).backward()
    for mine, theirs in [(out, t_out), (h_n, t_h), (c_n, t_c)]:
        assert_close(mine.numpy(), theirs.detach().numpy())
    assert_close(x.grad.numpy(), tx.grad.numpy())
    if with_state:
        assert_close(h0.grad.numpy(), th.grad.numpy())
        assert_close(c0.grad.numpy(), tc.grad.numpy())
    _assert_rnn_param_grads(t_model, model.lstm_cells)


def test_cells_read_parameters_at_call_time(device):
    np.random.seed(9)
    cell = nn.RNNCell(2, 3, bias=False, device=device)
    cell.W_ih = ndl.Tensor(np.ones((2, 3), dtype=np.float32), device=device)
    cell.W_hh = ndl.Tensor(np.zeros((3, 3), dtype=np.float32), device=device)
    x = ndl.Tensor(np.array([[0.1, 0.2]], dtype=np.float32), device=device)
    np.testing.assert_allclose(cell(x, ndl.init.ones(1, 3, device=device)).numpy(), np.tanh([[0.3, 0.3, 0.3]]),
                               rtol=1e-6)


def test_embedding_matches_torch(device):
    torch = requires_torch()
    np.random.seed(10)
    rs = np.random.RandomState(10)
    emb = nn.Embedding(7, 4, device=device)
    ids_np = np.array([[0, 3], [6, 3], [3, 1]], dtype=np.float32)  # repeated ids accumulate gradients
    out = emb(tensor(ids_np, device, requires_grad=False))
    proj = backward_projected(out, rs, device)
    tw = torch.tensor(emb.weight.numpy(), requires_grad=True)
    t_out = torch.nn.functional.embedding(torch.tensor(ids_np.astype(np.int64)), tw)
    (t_out * torch.tensor(proj)).sum().backward()
    assert out.shape == (3, 2, 4)
    np.testing.assert_array_equal(out.numpy(), t_out.detach().numpy())
    assert_close(emb.weight.grad.numpy(), tw.grad.numpy())


def test_embedding_index_out_of_range_raises_at_call(device):
    emb = nn.Embedding(5, 2, device=device)
    with pytest.raises(IndexError, match="Embedding"):
        emb(tensor(np.array([[1, 5]], dtype=np.float32), device, requires_grad=False))
    with pytest.raises(IndexError):
        emb(tensor(np.array([[-1]], dtype=np.float32), device, requires_grad=False))


# ----- attention and the transformer --------------------------------------------------------------------------------
MHA_CASES = [(True, 4, 4), (False, 4, 4), (True, 3, 5), (False, 3, 5)]


@pytest.mark.parametrize("case", MHA_CASES, ids=[f"{'causal' if c else 'full'}-T{t}S{s}" for c, t, s in MHA_CASES])
def test_multihead_attention_matches_torch(device, case):
    torch = requires_torch()
    causal, T, S = case
    rs = np.random.RandomState(11)
    mha = nn.MultiHeadAttention(causal=causal, device=device)
    arrays = [randn(rs, 2, 3, T, 4), randn(rs, 2, 3, S, 4), randn(rs, 2, 3, S, 5)]
    q, k, v = (tensor(a, device) for a in arrays)
    result, probs = mha(q, k, v)
    proj_r, proj_p = randn(rs, 2, 3, T, 5), randn(rs, 2, 3, T, S)
    ((result * tensor(proj_r, device, False)).sum() + (probs * tensor(proj_p, device, False)).sum()).backward()
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in arrays)
    t_result, t_probs = t_attention(torch, tq, tk, tv, causal)
    ((t_result * torch.tensor(proj_r)).sum() + (t_probs * torch.tensor(proj_p)).sum()).backward()
    assert_close(result.numpy(), t_result.detach().numpy())
    assert_close(probs.numpy(), t_probs.detach().numpy())
    if causal:
        assert np.all(probs.numpy()[..., np.triu(np.ones((T, S), dtype=bool), S - T + 1)] == 0)
    for mine, theirs in [(q, tq), (k, tk), (v, tv)]:
        assert_close(mine.grad.numpy(), theirs.grad.numpy())


def test_causal_mask_convention():
    mask = nn.MultiHeadAttention().create_causal_mask(2, 3, nd.cpu_numpy()).numpy()
    big = -np.finfo(np.float32).max
    np.testing.assert_array_equal(mask, np.array([[[[0, 0, big], [0, 0, 0]]]], dtype=np.float32))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("separate_kv", [False, True], ids=["self", "cross"])
def test_attention_layer_matches_torch(device, causal, separate_kv):
    torch = requires_torch()
    np.random.seed(12)
    rs = np.random.RandomState(12)
    kf, vf = (6, 7) if separate_kv else (None, None)
    layer = nn.AttentionLayer(8, 2, 3, k_features=kf, v_features=vf, out_features=5, causal=causal,
                              device=device)
    values = randomize(layer, rs, device)
    arrays = [randn(rs, 2, 4, 8)] + ([randn(rs, 2, 4, 6), randn(rs, 2, 4, 7)] if separate_kv else [])
    xs = [tensor(a, device) for a in arrays]
    out = layer(*xs)
    proj = backward_projected(out, rs, device)
    txs = [torch.tensor(a, requires_grad=True) for a in arrays]
    tq, tk, tv = txs if separate_kv else txs * 3
    tp = torch_params(torch, values)
    t_out = t_attention_layer(torch, tp, tq, tk, tv, 2, 3, causal)
    (t_out * torch.tensor(proj)).sum().backward()
    assert out.shape == (2, 4, 5)
    assert_close(out.numpy(), t_out.detach().numpy())
    for x, tx in zip(xs, txs):
        assert_close(x.grad.numpy(), tx.grad.numpy())
    assert_param_grads(layer, tp)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_transformer_layer_matches_torch(device, causal):
    torch = requires_torch()
    np.random.seed(13)
    rs = np.random.RandomState(13)
    layer = nn.TransformerLayer(6, 2, 4, 10, causal=causal, device=device)
    values = randomize(layer, rs, device)
    x_np = randn(rs, 2, 5, 6)
    x = tensor(x_np, device)
    out = layer(x)
    proj = backward_projected(out, rs, device)
    tx = torch.tensor(x_np, requires_grad=True)
    tp = torch_params(torch, values)
    t_out = t_transformer_layer(torch, tp, tx, 2, 4, causal)
    (t_out * torch.tensor(proj)).sum().backward()
    assert_close(out.numpy(), t_out.detach().numpy())
    assert_close(x.grad.numpy(), tx.grad.numpy())
    assert_param_grads(layer, tp)


@pytest.mark.parametrize("batch_first", [False, True], ids=["TBD", "BTD"])
def test_transformer_matches_torch(device, batch_first):
    torch = requires_torch()
    np.random.seed(14)
    rs = np.random.RandomState(14)
    model = nn.Transformer(6, 10, 2, num_head=2, dim_head=3, device=device, batch_first=batch_first,
                           sequence_len=9)
    values = randomize(model, rs, device)
    T, B = 5, 3
    x_np = randn(rs, B, T, 6) if batch_first else randn(rs, T, B, 6)
    x = tensor(x_np, device)
    out, h = model(x)
    proj = backward_projected(out, rs, device)

    tx = torch.tensor(x_np, requires_grad=True)
    tp = torch_params(torch, values)
    y = tx if batch_first else tx.transpose(0, 1)
    y = y + tp[0][:T][None]
    for i in range(2):
        y = t_transformer_layer(torch, tp[1 + 16 * i:1 + 16 * (i + 1)], y, 2, 3, True)
    t_out = y if batch_first else y.transpose(0, 1)
    (t_out * torch.tensor(proj)).sum().backward()
    assert out.shape == x_np.shape
    np.testing.assert_array_equal(h.numpy(), np.zeros(x_np.shape, dtype=np.float32))
    assert_close(out.numpy(), t_out.detach().numpy())
    assert_close(x.grad.numpy(), tx.grad.numpy())
    assert_param_grads(model, tp)
    assert np.all(model.positional_embedding.weight.grad.numpy()[T:] == 0)


def test_transformer_parameter_order_and_sequence_limit():
    np.random.seed(15)
    model = nn.Transformer(4, 6, 1, num_head=1, dim_head=2, sequence_len=3)
    np.random.seed(15)
    np.testing.assert_allclose(model.positional_embedding.weight.numpy(), np.random.randn(3, 4).astype(np.float32))
    q_bound = math.sqrt(2) * math.sqrt(3 / 4)
    expected_q = np.random.rand(4, 2).astype(np.float32) * (2 * q_bound) - q_bound
    np.testing.assert_allclose(model.layers[0].attention.q_projection.weight.numpy(), expected_q, rtol=1e-6)
    assert len(model.parameters()) == 1 + 16
    with pytest.raises(ValueError, match="sequence_len"):
        model(ndl.Tensor(np.zeros((4, 1, 4), dtype=np.float32)))


# ----- dropout and the loss -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.0, 0.3, 0.8])
def test_dropout_mask_convention(device, p):
    rs = np.random.RandomState(16)
    x_np = randn(rs, 4, 5)
    layer = nn.Dropout(p)
    np.random.seed(17)
    x = tensor(x_np, device)
    out = layer(x)
    after = np.random.rand()
    np.random.seed(17)
    mask = np.random.rand(4, 5) <= 1 - p
    assert np.random.rand() == after  # exactly one draw of x's shape
    expected = x_np * mask.astype(np.float32) / np.float32(1 - p)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6, atol=1e-7)
    if p == 0:
        np.testing.assert_array_equal(out.numpy(), x_np)
    out.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), mask / np.float32(1 - p), rtol=1e-6)
    if p == 0:
        assert out is x  # the identity after the draw: no mask of ones kept for backward
        return
    mask_node = out.inputs[0].inputs[1]  # (x * mask) / (1 - p)
    assert mask_node.is_leaf() and not mask_node.requires_grad


@pytest.mark.smoke
def test_dropout_eval_is_identity_without_draws():
    layer = nn.Dropout(0.5).eval()
    x = ndl.Tensor(np.ones((3, 3), dtype=np.float32))
    np.random.seed(18)
    assert layer(x) is x
    after = np.random.rand()
    np.random.seed(18)
    assert np.random.rand() == after


def test_softmax_loss_matches_one_hot_and_torch(device):
    torch = requires_torch()
    rs = np.random.RandomState(19)
    N, C = 6, 5
    z_np, y_np = randn(rs, N, C) * 3, rs.randint(0, C, size=N)
    z = tensor(z_np, device)
    loss = nn.SoftmaxLoss()(z, tensor(y_np, device, requires_grad=False))
    loss.backward()

    z2 = tensor(z_np, device)
    one_hot = ndl.init.one_hot(C, y_np, device=device)
    loss2 = (ndl.ops.logsumexp(z2, axes=(1,)) - (z2 * one_hot).sum(axes=(1,))).sum() / N
    loss2.backward()
    np.testing.assert_array_equal(loss.numpy(), loss2.numpy())
    np.testing.assert_allclose(z.grad.numpy(), z2.grad.numpy(), rtol=1e-6, atol=1e-7)

    tz = torch.tensor(z_np, requires_grad=True)
    t_loss = torch.nn.functional.cross_entropy(tz, torch.tensor(y_np))
    t_loss.backward()
    assert_close(loss.numpy(), t_loss.detach().numpy())
    assert_close(z.grad.numpy(), tz.grad.numpy())


def test_softmax_loss_builds_no_one_hot():
    """No (N, C) value other than the logits is in the loss graph, and the gradient is one fused (N, C) value."""
    from needle import autograd

    rs = np.random.RandomState(20)
    N, C = 7, 1000
    z = tensor(randn(rs, N, C), nd.cpu_numpy())
    loss = nn.SoftmaxLoss()(z, tensor(rs.randint(0, C, size=N), nd.cpu_numpy(), requires_grad=False))
    shapes = [tuple(n.shape) for n in autograd.find_topo_sort([loss]) if n is not z]
    assert (N, C) not in shapes
    assert any(isinstance(n.op, ndl.ops.SoftmaxCrossEntropy) for n in autograd.find_topo_sort([loss]))
    loss.backward()
    assert isinstance(z.grad.op, ndl.ops.SoftmaxCrossEntropyGrad)
    assert [tuple(n.shape) for n in autograd.find_topo_sort([z.grad])].count((N, C)) == 2  # z and its gradient


@pytest.mark.smoke
def test_softmax_loss_rejects_bad_labels_and_shapes():
    z = ndl.Tensor(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(IndexError, match="SoftmaxLoss"):
        nn.SoftmaxLoss()(z, ndl.Tensor(np.array([0, 3]), requires_grad=False))
    with pytest.raises(ValueError, match=r"SoftmaxLoss: expected logits \(N, C\) and labels \(N,\), got \(2, 3\)"):
        nn.SoftmaxLoss()(z, ndl.Tensor(np.array([0, 1, 2]), requires_grad=False))


# ----- bad input ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("module, shape, message", [
    (lambda: nn.Linear(4, 2), (3, 5), "Linear: expected input (..., 4), got (3, 5)"),
    (lambda: nn.LayerNorm1d(4), (3, 5), "LayerNorm1d: expected input (..., 4), got (3, 5)"),
    (lambda: nn.BatchNorm1d(4), (2, 3, 4), "BatchNorm1d: expected input (N, 4), got (2, 3, 4)"),
    (lambda: nn.BatchNorm2d(4), (2, 3, 5, 5), "BatchNorm2d: expected input (N, 4, H, W), got (2, 3, 5, 5)"),
    (lambda: nn.Conv(3, 2, 3), (1, 2, 5, 5), "Conv: expected input (N, 3, H, W), got (1, 2, 5, 5)"),
    (lambda: nn.RNN(3, 2), (4, 3), "RNN: expected input (T, B, 3), got (4, 3)"),
    (lambda: nn.LSTM(3, 2), (4, 1, 2), "LSTM: expected input (T, B, 3), got (4, 1, 2)"),
    (lambda: nn.RNNCell(3, 2), (1, 4), "RNNCell: expected input (B, 3), got (1, 4)"),
    (lambda: nn.AttentionLayer(4, 1, 2), (2, 3, 5), "AttentionLayer: expected q (B, T, 4)"),
    (lambda: nn.Transformer(4, 3, 1), (3, 2, 5), "Transformer: expected input (T, B, 4), got (3, 2, 5)"),
], ids=["linear", "layernorm", "batchnorm1d", "batchnorm2d", "conv", "rnn", "lstm", "rnncell", "attention",
        "transformer"])
def test_bad_input_shape_raises_value_error(module, shape, message):
    with pytest.raises(ValueError) as info:
        module()(ndl.Tensor(np.zeros(shape, dtype=np.float32)))
    assert message in str(info.value)


def test_rnn_bad_initial_state_raises_value_error():
    with pytest.raises(ValueError, match=r"RNN: expected h0 \(2, 3, 4\), got \(1, 3, 4\)"):
        nn.RNN(2, 4, num_layers=2)(ndl.Tensor(np.zeros((5, 3, 2), dtype=np.float32)),
                                   ndl.Tensor(np.zeros((1, 3, 4), dtype=np.float32)))


# ----- eager and lazy, and the checkpointing hooks -----------------------------------------------------------------
def _grads_of(make, x_np, gc, lazy, device):
    np.random.seed(21)
    module = make(device)
    if gc:
        module.enable_gc()
    x = tensor(x_np, device)
    with autograd.lazy_mode(lazy):
        out = module(x)
        out = out[0] if isinstance(out, tuple) else out
        (out * out).sum().backward()
    stats = checkpoint.last_backward_stats()
    return [out.numpy(), x.grad.numpy()] + [p.grad.numpy() for p in module.parameters()], stats


GC_MODULES = [  # (module, input shape, whether it has an interior to drop)
    (lambda d: nn.Linear(4, 3, device=d), (2, 3, 4), False),  # one fused op: nothing inside to drop
    (lambda d: nn.LayerNorm1d(4, device=d), (3, 4), False),  # one fused op: nothing inside to drop
    (lambda d: nn.TransformerLayer(4, 2, 2, 6, device=d), (2, 3, 4), True),
]


@pytest.mark.filterwarnings("ignore::needle.checkpoint.NothingToDropWarning")  # one-op layers: nothing to drop
@pytest.mark.parametrize("lazy", LAZY)
@pytest.mark.parametrize("case", GC_MODULES, ids=["linear", "layernorm", "transformer_layer"])
def test_gc_hooks_give_identical_gradients(case, lazy):
    make, shape, interior = case
    device = nd.cpu_numpy()
    x_np = randn(np.random.RandomState(22), *shape)
    plain, _ = _grads_of(make, x_np, gc=False, lazy=lazy, device=device)
    with_gc, stats = _grads_of(make, x_np, gc=True, lazy=lazy, device=device)
    assert (stats["recomputed_nodes"] > 0) == interior  # a module with an interior annotated it: it was dropped
    for i, (a, b) in enumerate(zip(plain, with_gc)):
        assert np.array_equal(a, b), f"array {i} differs with gc on"


LAZY_MODELS = [
    (lambda d: nn.Sequential(nn.Conv(2, 3, 3, device=d), nn.BatchNorm2d(3, device=d), nn.ReLU(), nn.Flatten(),
                             nn.Linear(27, 2, device=d)), (2, 2, 3, 3)),
    (lambda d: nn.LSTM(3, 4, num_layers=2, device=d), (3, 2, 3)),
    (lambda d: nn.RNN(3, 4, device=d), (3, 2, 3)),
    (lambda d: nn.Transformer(4, 5, 2, num_head=2, dim_head=2, device=d, dropout=0.2), (3, 2, 4)),
]


@pytest.mark.parametrize("case", LAZY_MODELS, ids=["convnet", "lstm", "rnn", "transformer"])
def test_eager_and_lazy_give_identical_results(device, case):
    make, shape = case
    x_np = randn(np.random.RandomState(23), *shape)
    eager, _ = _grads_of(make, x_np, gc=False, lazy=False, device=device)
    lazy, _ = _grads_of(make, x_np, gc=False, lazy=True, device=device)
    for i, (a, b) in enumerate(zip(eager, lazy)):
        assert np.array_equal(a, b), f"array {i} differs in lazy mode"


@pytest.mark.parametrize("kind", ["rnn", "lstm"])
@pytest.mark.parametrize("seq_len", [1, 3])
def test_recurrent_layers_without_initial_state_give_every_parameter_a_gradient(kind, seq_len):
    """h0=None is a zero state (as PyTorch): W_hh gets a gradient, exactly zero when seq_len == 1."""
    np.random.seed(0)
    model = nn.RNN(3, 4, num_layers=2) if kind == "rnn" else nn.LSTM(3, 4, num_layers=2)
    x = ndl.Tensor(np.random.randn(seq_len, 2, 3).astype(np.float32), requires_grad=False)
    out, _ = model(x)
    out.sum().backward()
    for p in model.parameters():
        assert p.grad is not None and p.grad.shape == p.shape
    cells = model.rnn_cells if kind == "rnn" else model.lstm_cells
    if seq_len == 1:
        assert not np.any(cells[0].W_hh.grad.numpy())
