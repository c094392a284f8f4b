"""Sequence layers: Elman RNN and LSTM (cells and multi-layer stacks over (T, B, features)), and Embedding.

The cells read their parameters from attributes at call time (user code may replace them with plain Tensors).
Each cell annotates its own interior for checkpointing (inputs: X and the incoming state); RNN and LSTM annotate
their cells over every step and layer as one stack, whose boundaries (each step's state) their policy may drop too:
backpropagation through time in O(sqrt T) memory with "sqrt" (Chen et al.; Gruslys et al. 2016).
"""
import math

from .. import init, ops
from .nn_module import Module, Parameter

__all__ = ["Embedding", "LSTM", "LSTMCell", "RNN", "RNNCell"]


def _uniform(*shape, bound, device, dtype):
    return Parameter(init.rand(*shape, low=-bound, high=bound, device=device, dtype=dtype))


def _affine(X, h, W_ih, W_hh, bias_ih, bias_hh, batch, width):
    """X W_ih + h W_hh + bias_ih + bias_hh; a missing (None) bias term is left out."""
    out = ops.matmul(X, W_ih) + ops.matmul(h, W_hh)
    for bias in (bias_ih, bias_hh):
        if bias is not None:
            out = out + ops.broadcast_to(ops.reshape(bias, (1, width)), (batch, width))
    return out


def _zeros_like_state(X, batch, hidden):
    return init.zeros(batch, hidden, device=X.device, dtype=X.dtype)


def _check_state(module, name, state, expected):
    if state is not None and tuple(state.shape) != expected:
        raise ValueError(f"{module}: expected {name} {expected}, got {tuple(state.shape)}")


class RNNCell(Module):
    """h' = tanh(X W_ih + bias_ih + h W_hh + bias_hh) (or relu); every parameter U(+-1 / sqrt(hidden_size))."""

    def __init__(self, input_size, hidden_size, bias=True, nonlinearity="tanh", device=None, dtype="float32"):
        super().__init__()
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"RNNCell: nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.nonlinearity = nonlinearity
        bound = 1.0 / math.sqrt(hidden_size)
        self.W_ih = _uniform(input_size, hidden_size, bound=bound, device=device, dtype=dtype)
        self.W_hh = _uniform(hidden_size, hidden_size, bound=bound, device=device, dtype=dtype)
        self.bias_ih = _uniform(hidden_size, bound=bound, device=device, dtype=dtype) if bias else None
        self.bias_hh = _uniform(hidden_size, bound=bound, device=device, dtype=dtype) if bias else None

    def forward(self, X, h=None):
        """X (B, input_size), h (B, hidden_size) or None (zeros) -> h' (B, hidden_size)."""
        shape = X.shape
        if len(shape) != 2 or shape[1] != self.input_size:
            raise ValueError(f"RNNCell: expected input (B, {self.input_size}), got {tuple(shape)}")
        batch = shape[0]
        _check_state("RNNCell", "h", h, (batch, self.hidden_size))
        if h is None:  # zeros, as PyTorch: W_hh still gets its (zero) gradient
            h = _zeros_like_state(X, batch, self.hidden_size)
        pre = _affine(X, h, self.W_ih, self.W_hh, self.bias_ih, self.bias_hh, batch, self.hidden_size)
        out = ops.tanh(pre) if self.nonlinearity == "tanh" else ops.relu(pre)
        return self.checkpoint(out, [X, h])


class RNN(Module):
    """A stack of `num_layers` RNNCells run over time: X (T, B, in), h0 (L, B, hidden) -> (output, h_n)."""

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, nonlinearity="tanh", device=None,
                 dtype="float32"):
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.rnn_cells = [RNNCell(input_size if i == 0 else hidden_size, hidden_size, bias=bias,
                                  nonlinearity=nonlinearity, device=device, dtype=dtype) for i in range(num_layers)]

    def forward(self, X, h0=None):
        """output (T, B, hidden): the last layer's state at every step; h_n (L, B, hidden): every layer's last."""
        T, batch = _check_sequence("RNN", X, self.input_size)
        _check_state("RNN", "h0", h0, (self.num_layers, batch, self.hidden_size))
        xs = _unstack(X, T)
        states = _unstack(h0, self.num_layers) if h0 is not None else [None] * self.num_layers
        last = []
        for cell, h in zip(self.rnn_cells, states):
            outputs = []
            for x in xs:
                h = cell(x, h)
                outputs.append(h)
            xs = outputs
            last.append(h)
        outputs = [ops.stack(xs, 0), ops.stack(last, 0)]
        self.checkpoint(outputs, [X] + ([] if h0 is None else [h0]), stack=True)
        return tuple(outputs)


class LSTMCell(Module):
    """Gates i, f, g, o (in that order) from X W_ih + bias_ih + h W_hh + bias_hh;  c' = f c + i g, h' = o tanh(c')."""

    def __init__(self, input_size, hidden_size, bias=True, device=None, dtype="float32"):
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        bound = 1.0 / math.sqrt(hidden_size)
        self.W_ih = _uniform(input_size, 4 * hidden_size, bound=bound, device=device, dtype=dtype)
        self.W_hh = _uniform(hidden_size, 4 * hidden_size, bound=bound, device=device, dtype=dtype)
        self.bias_ih = _uniform(4 * hidden_size, bound=bound, device=device, dtype=dtype) if bias else None
        self.bias_hh = _uniform(4 * hidden_size, bound=bound, device=device, dtype=dtype) if bias else None

    def forward(self, X, h=None):
        """X (B, input_size), h = (h0, c0) each (B, hidden_size) or None (zeros) -> (h', c')."""
        shape = X.shape
        if len(shape) != 2 or shape[1] != self.input_size:
            raise ValueError(f"LSTMCell: expected input (B, {self.input_size}), got {tuple(shape)}")
        batch, hidden = shape[0], self.hidden_size
        h0, c0 = (None, None) if h is None else h
        _check_state("LSTMCell", "h0", h0, (batch, hidden))
        _check_state("LSTMCell", "c0", c0, (batch, hidden))
        h0 = _zeros_like_state(X, batch, hidden) if h0 is None else h0  # zeros, as PyTorch (W_hh gets a gradient)
        c0 = _zeros_like_state(X, batch, hidden) if c0 is None else c0
        gates = _affine(X, h0, self.W_ih, self.W_hh, self.bias_ih, self.bias_hh, batch, 4 * hidden)
        parts = ops.split(ops.reshape(gates, (batch, 4, hidden)), 1)
        i, f, g, o = (ops.tuple_get_item(parts, k) for k in range(4))
        i, f, g, o = ops.sigmoid(i), ops.sigmoid(f), ops.tanh(g), ops.sigmoid(o)
        c = f * c0 + i * g
        h_out = o * ops.tanh(c)
        self.checkpoint([h_out, c], [X, h0, c0])
        return h_out, c


class LSTM(Module):
    """A stack of `num_layers` LSTMCells over time: X (T, B, in), h = (h0, c0) each (L, B, hidden) or None.

    Returns (output (T, B, hidden), (h_n, c_n)), as RNN.
    """

    def __init__(self, input_size, hidden_size, num_layers=1, bias=True, device=None, dtype="float32"):
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.lstm_cells = [LSTMCell(input_size if i == 0 else hidden_size, hidden_size, bias=bias, device=device,
                                    dtype=dtype) for i in range(num_layers)]

    def forward(self, X, h=None):
        T, batch = _check_sequence("LSTM", X, self.input_size)
        h0, c0 = (None, None) if h is None else h
        expected = (self.num_layers, batch, self.hidden_size)
        _check_state("LSTM", "h0", h0, expected)
        _check_state("LSTM", "c0", c0, expected)
        xs = _unstack(X, T)
        hs = _unstack(h0, self.num_layers) if h0 is not None else [None] * self.num_layers
        cs = _unstack(c0, self.num_layers) if c0 is not None else [None] * self.num_layers
        last_h, last_c = [], []
        for cell, h_l, c_l in zip(self.lstm_cells, hs, cs):
            outputs = []
            for x in xs:
                h_l, c_l = cell(x, None if h_l is None and c_l is None else (h_l, c_l))
                outputs.append(h_l)
            xs = outputs
            last_h.append(h_l)
            last_c.append(c_l)
        out, h_n, c_n = ops.stack(xs, 0), ops.stack(last_h, 0), ops.stack(last_c, 0)
        self.checkpoint([out, h_n, c_n], [X] + [t for t in (h0, c0) if t is not None], stack=True)
        return out, (h_n, c_n)


def _check_sequence(module, X, input_size):
    shape = X.shape
    if len(shape) != 3 or shape[2] != input_size:
        raise ValueError(f"{module}: expected input (T, B, {input_size}), got {tuple(shape)}")
    return shape[0], shape[1]


def _unstack(tensor, n):
    """The n slices of `tensor` along axis 0 (n given, so lazy mode needs no value to count them)."""
    parts = ops.split(tensor, 0)
    return [ops.tuple_get_item(parts, i) for i in range(n)]


class Embedding(Module):
    """A lookup table: integer-valued ids of any shape S -> vectors of shape S + (embedding_dim,).

    Rows are gathered (GatherRows), so no (tokens x num_embeddings) one-hot is built; an id outside
    [0, num_embeddings) raises IndexError (at the call in eager mode, at realization in lazy mode).
    """

    def __init__(self, num_embeddings, embedding_dim, device=None, dtype="float32"):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = Parameter(init.randn(num_embeddings, embedding_dim, device=device, dtype=dtype))

    def forward(self, x):
        shape = tuple(x.shape)
        ids = ops.reshape(x.detach() if x.requires_grad else x, (math.prod(shape),))
        try:
            rows = ops.gather_rows(self.weight, ids)
        except IndexError as err:
            raise IndexError(f"Embedding({self.num_embeddings}, {self.embedding_dim}): {err}") from err
        out = ops.reshape(rows, shape + (self.embedding_dim,))
        return self.checkpoint(out, [x])
