"""Attention and the (pre-norm, decoder-style) Transformer.

Checkpointing: MultiHeadAttention, AttentionLayer and TransformerLayer each annotate their own interior; the
Transformer annotates only its glue (adding positions) and leaves each layer to annotate itself, so every
layer's output stays a boundary and backward recomputes one layer at a time.

Fused attention: AttentionLayer (and so TransformerLayer and Transformer) computes its heads' attention with
ops.scaled_dot_product_attention, which never materializes the B·H·T·S scores, probabilities or dropout mask,
whenever attention dropout is 0 or inactive (eval mode; `fused_attention=None`, the default) or when asked
(`fused_attention=True`: dropout then uses a counter-based mask regenerated in backward, and a TransformerLayer's
residual and MLP dropouts do too, so it keeps no mask); `fused_attention=False` keeps MultiHeadAttention's unfused
path. MultiHeadAttention itself always returns (result, probs), as the course's
tests expect.
"""
import math

import numpy as np

from .. import init, ops
from ..autograd import Tensor
from ..ops.ops_activation import check_bits, check_relu_bits
from ..ops.ops_linear import ACTIVATIONS
from .nn_basic import Dropout, LayerNorm1d, Linear, ReLU, draw_like_rand
from .nn_module import Module
from .nn_sequence import Embedding

__all__ = ["AttentionLayer", "MultiHeadAttention", "Transformer", "TransformerLayer"]


class MultiHeadAttention(Module):
    """softmax(q k^T / sqrt(D) + causal mask) v on (B, H, T, D) inputs; returns (result, probs).

    probs are the attention probabilities after dropout (the dropout mask is a leaf, so recomputation under
    checkpointing reuses it). `fused(q, k, v)` is the same attention through ops.scaled_dot_product_attention:
    the result only.
    """

    def __init__(self, *, dropout=0.0, causal=False, device=None, dtype="float32"):
        super().__init__()
        self.device = device
        self.dtype = dtype
        self.causal = causal
        self.dropout = Dropout(dropout)

    def create_causal_mask(self, i, j, device):
        """(1, 1, i, j) constant: -max float32 where key position > query position (keys aligned at the end)."""
        mask = -np.finfo(np.float32).max * np.triu(np.ones((1, 1, i, j), dtype=np.float32), j - i + 1)
        return Tensor(mask, device=device, dtype=self.dtype, requires_grad=False)

    def matmul(self, a, b_transpose):
        """a (..., i, d) times b_transpose (..., j, d), transposed: (..., i, j), a batched MatMul."""
        return ops.matmul(a, ops.transpose(b_transpose))

    def softmax(self, logit):
        """Softmax over the last axis, max-shifted: exp(logsoftmax(z)), logsoftmax = z - m - log sum exp(z - m)."""
        return ops.exp(ops.logsoftmax(logit))

    def forward(self, q, k, v):
        q_shape, k_shape, v_shape = tuple(q.shape), tuple(k.shape), tuple(v.shape)
        if (len(q_shape) != 4 or len(k_shape) != 4 or len(v_shape) != 4 or q_shape[-1] != k_shape[-1]
                or k_shape[:3] != v_shape[:3] or q_shape[:2] != k_shape[:2]):
            raise ValueError(f"MultiHeadAttention: expected q (B, H, T, D), k (B, H, S, D), v (B, H, S, Dv), "
                             f"got {q_shape}, {k_shape}, {v_shape}")
        B, H, T, D = q_shape
        S = k_shape[2]
        scores = self.matmul(q, k) / math.sqrt(D)
        if self.causal:
            mask = self.create_causal_mask(T, S, q.device)
            scores = scores + ops.broadcast_to(mask, (B, H, T, S))
        probs = self.dropout(self.softmax(scores))
        result = ops.matmul(probs, v)
        self.checkpoint([result, probs], [q, k, v])
        return result, probs

    def fused(self, q, k, v):
        """forward's result (not its probs) from ops.scaled_dot_product_attention: no (B, H, T, S) array is kept.

        NumPy's RNG is left exactly as forward leaves it: in training mode forward's Dropout draws
        np.random.rand(B, H, T, S) (even at p = 0), so this draws as many numbers (in chunks, none kept) and takes
        the dropout seed from the first of them. With p > 0 the kept elements differ from forward's mask (a hash
        of that seed picks them, see ops.scaled_dot_product_attention); their fraction and scale are the same.
        """
        p, seed = 0.0, 0
        if self.dropout.training and len(q.shape) == len(k.shape) == 4:  # (other shapes: the op says what is wrong)
            seed = draw_like_rand(math.prod(q.shape[:3]) * k.shape[2])
            p = self.dropout.p
        return ops.scaled_dot_product_attention(q, k, v, causal=self.causal, dropout_p=p, seed=seed)


class AttentionLayer(Module):
    """Pre-norm multi-head attention on (B, T, features): LayerNorm, project to heads, attend, project out.

    fused_attention: None (default) attends with the fused op (MultiHeadAttention.fused) when attention dropout is
    0 or inactive (eval mode) and with MultiHeadAttention's unfused forward otherwise; True always fuses (dropout by
    a regenerated mask), False never does.
    """

    def __init__(self, q_features, num_head, dim_head, *, k_features=None, v_features=None, out_features=None,
                 dropout=0.0, causal=True, device=None, dtype="float32", fused_attention=None):
        super().__init__()
        self.fused_attention = fused_attention
        k_features = q_features if k_features is None else k_features
        v_features = q_features if v_features is None else v_features
        out_features = q_features if out_features is None else out_features
        self.q_features, self.k_features, self.v_features = q_features, k_features, v_features
        self.out_features = out_features
        self.num_head = num_head
        self.dim_head = dim_head
        self.prenorm_q = LayerNorm1d(q_features, device=device, dtype=dtype)
        self.prenorm_k = LayerNorm1d(k_features, device=device, dtype=dtype)
        self.prenorm_v = LayerNorm1d(v_features, device=device, dtype=dtype)
        inner = num_head * dim_head
        self.q_projection = Linear(q_features, inner, bias=False, device=device, dtype=dtype)
        self.k_projection = Linear(k_features, inner, bias=False, device=device, dtype=dtype)
        self.v_projection = Linear(v_features, inner, bias=False, device=device, dtype=dtype)
        self.attn = MultiHeadAttention(dropout=dropout, causal=causal, device=device, dtype=dtype)
        self.out_projection = Linear(inner, out_features, bias=False, device=device, dtype=dtype)

    def _heads(self, x, batch, length):
        """(B, T, H * Dh) -> (B, H, T, Dh)."""
        return ops.transpose(ops.reshape(x, (batch, length, self.num_head, self.dim_head)), (1, 2))

    def forward(self, q, k=None, v=None):
        """q (B, T, q_features); k, v (B, S, k/v_features), defaulting to q -> (B, T, out_features)."""
        inputs = [q] + [x for x in (k, v) if x is not None and x is not q]
        k = q if k is None else k
        v = q if v is None else v
        q_shape, k_shape, v_shape = tuple(q.shape), tuple(k.shape), tuple(v.shape)
        if (len(q_shape) != 3 or len(k_shape) != 3 or len(v_shape) != 3 or q_shape[2] != self.q_features
                or k_shape[2] != self.k_features or v_shape[2] != self.v_features or k_shape[:2] != v_shape[:2]
                or k_shape[0] != q_shape[0]):
            raise ValueError(f"AttentionLayer: expected q (B, T, {self.q_features}), k (B, S, {self.k_features}), "
                             f"v (B, S, {self.v_features}), got {q_shape}, {k_shape}, {v_shape}")
        B, T, _ = q_shape
        S = k_shape[1]
        q_heads = self._heads(self.q_projection(self.prenorm_q(q)), B, T)
        k_heads = self._heads(self.k_projection(self.prenorm_k(k)), B, S)
        v_heads = self._heads(self.v_projection(self.prenorm_v(v)), B, S)
        if self.uses_fused_attention():
            result = self.attn.fused(q_heads, k_heads, v_heads)
        else:
            result, _ = self.attn(q_heads, k_heads, v_heads)
        merged = ops.reshape(ops.transpose(result, (1, 2)), (B, T, self.num_head * self.dim_head))
        out = self.out_projection(merged)
        return self.checkpoint(out, inputs)

    def uses_fused_attention(self):
        """Whether forward attends with the fused op now (see the class docstring)."""
        if self.fused_attention is None:
            return self.attn.dropout.p == 0 or not self.attn.dropout.training
        return bool(self.fused_attention)


class TransformerLayer(Module):
    """x + Dropout(Attention(x)), then x + Dropout(Linear2(Dropout(f(Linear1(LayerNorm(x)))))).

    activation f: "relu" (the course's), "gelu" (exact), "gelu_tanh" or "silu", applied inside linear1's op
    (ops.linear's activation); activation_bits (1..4; relu: 1): backward keeps that many bits per element of the
    pre-activation instead of the pre-activation (few-bit derivatives: ops/ops_activation.py; relu's 1 bit is its
    mask, exact).

    fused_attention=True (the opt-in with dropout): the residual and MLP dropouts regenerate their masks from a
    seed as the fused attention does (Dropout(regenerate=True)), so the layer keeps no mask at all.
    """

    def __init__(self, q_features, num_head, dim_head, hidden_size, *, dropout=0.0, causal=True, device=None,
                 dtype="float32", fused_attention=None, activation="relu", activation_bits=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"TransformerLayer: activation must be one of {', '.join(ACTIVATIONS)}, got "
                             f"{activation!r}")
        (check_relu_bits if activation == "relu" else check_bits)("TransformerLayer", activation_bits)
        self.activation, self.activation_bits = activation, activation_bits
        self.attention = AttentionLayer(q_features, num_head, dim_head, dropout=dropout, causal=causal,
                                        device=device, dtype=dtype, fused_attention=fused_attention)
        self.layernorm = LayerNorm1d(q_features, device=device, dtype=dtype)
        self.linear1 = Linear(q_features, hidden_size, device=device, dtype=dtype)
        self.linear2 = Linear(hidden_size, q_features, device=device, dtype=dtype)
        if activation == "relu":
            self.relu = ReLU()  # (applied inside linear1's op; kept in the module tree as the course has it)
        self.dropout = Dropout(dropout)
        self.fused_attention = fused_attention

    @property
    def fused_attention(self):
        """The attention's choice (AttentionLayer.fused_attention); True also regenerates the dropout masks."""
        return self.attention.fused_attention

    @fused_attention.setter
    def fused_attention(self, value):
        self.attention.fused_attention = value
        self.dropout.regenerate = value is True

    def forward(self, x):
        """x (B, T, q_features) -> (B, T, q_features)."""
        h = x + self.dropout(self.attention(x))
        # the activation runs inside linear1's op (ops.linear's): one node (relu keeps no pre-activation)
        hidden = self.linear1(self.layernorm(h), activation=self.activation, activation_bits=self.activation_bits)
        out = h + self.dropout(self.linear2(self.dropout(hidden)))
        return self.checkpoint(out, [x])


class Transformer(Module):
    """A learned positional embedding, then `num_layers` TransformerLayers (no final norm).

    forward(x, h=None): x (T, B, D), or (B, T, D) with batch_first -> (output of x's layout, zeros_like(output)).
    fused_attention: each TransformerLayer's (None: fused when dropout is 0; True: fused, and every dropout mask
    regenerated from a seed). activation, activation_bits: each TransformerLayer's MLP activation.
    """

    def __init__(self, embedding_size, hidden_size, num_layers, *, num_head=8, dim_head=32, dropout=0.0,
                 causal=True, device=None, dtype="float32", batch_first=False, sequence_len=2048,
                 fused_attention=None, activation="relu", activation_bits=None):
        super().__init__()
        self.device = device
        self.dtype = dtype
        self.embedding_size = embedding_size
        self.batch_first = batch_first
        self.sequence_len = sequence_len
        self.positional_embedding = Embedding(sequence_len, embedding_size, device=device, dtype=dtype)
        self.layers = [TransformerLayer(embedding_size, num_head, dim_head, hidden_size, dropout=dropout,
                                        causal=causal, device=device, dtype=dtype, fused_attention=fused_attention,
                                        activation=activation, activation_bits=activation_bits)
                       for _ in range(num_layers)]

    def forward(self, x, h=None):
        shape = tuple(x.shape)
        if len(shape) != 3 or shape[2] != self.embedding_size:
            layout = "B, T" if self.batch_first else "T, B"
            raise ValueError(f"Transformer: expected input ({layout}, {self.embedding_size}), got {shape}")
        B, T = (shape[0], shape[1]) if self.batch_first else (shape[1], shape[0])
        if T > self.sequence_len:
            raise ValueError(f"Transformer: sequence length {T} exceeds sequence_len={self.sequence_len}")
        # One position row per step, gathered once and broadcast over the batch.
        # Ids stay float32 whatever the model's dtype: bfloat16 holds integers exactly only up to 256.
        positions = Tensor(np.arange(T).reshape(T, 1), device=x.device, dtype="float32", requires_grad=False)
        pos = ops.reshape(self.positional_embedding(positions), (1, T, self.embedding_size))
        seq = x if self.batch_first else ops.transpose(x, (0, 1))
        y = self.checkpoint(seq + ops.broadcast_to(pos, (B, T, self.embedding_size)), [x])
        stacked = y
        for layer in self.layers:
            y = layer(y)
        # The layers are a stack: their outputs are its boundaries, which its policy may drop too (Chen's depth)
        y = self.checkpoint(y, [stacked], stack=True)
        if not self.batch_first:
            y = ops.transpose(y, (0, 1))
        # The course returns a zero state beside the output; a broadcast view of one zero costs 4 bytes, not a
        # batch-sized buffer outside the graph (which no checkpointing plan could see).
        zero = init.zeros(*(1,) * len(shape), device=x.device, dtype=x.dtype)
        return y, ops.broadcast_to(zero, shape)
