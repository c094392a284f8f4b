"""The language model's head with its vocabulary split between the ranks, fused with the loss.

Rank r holds columns [r V/N, (r+1) V/N) of the head's weight (H, V) and bias, so its logits are z_i restricted
to its vocabulary. The mean cross-entropy needs, per token row i, logsumexp over the whole vocabulary and the
target's logit, which lives on one rank. Each rank computes, chunk by chunk of rows as ops.linear_cross_entropy
does (never the whole logits, not even its own slice), its per-row maximum m_r, its sum s_r = Σ exp(z - m_r)
and the target logit when the target is in its range (else 0); then two all-reduces of per-row numbers finish
it, never the logits: the maximum m = max_r m_r, and the sums of s_r exp(m_r - m) and of the target logits. The
loss is mean_i(m + log s - z_i[y_i]). Backward recomputes each chunk's logits and takes
dz = g/N (exp(z - logsumexp) - onehot(y)) on this rank's columns: dW and db are this rank's slices (no
communication), and dh = dz W^T is this rank's part of the hidden rows' gradient, summed over the ranks by the f
(copy_to_region) in front of the head. The per-row logsumexp is kept by the forward op for its gradient; the op
is not recomputable (it communicates), so checkpointing never drops or recomputes it.

Reduction order: one process sums exp(z - m) over the whole row at once; here each rank sums its slice and the
slices are added (rescaled by exp(m_r - m)), which rounds differently, within float32's precision.
"""
import numpy as np

from .... import ops
from ....autograd import Tensor, TensorOp, TensorTupleOp
from ....backend_selection import array_api, device_of
from ....nn import Module
from ....ops.ops_fused import chunk_rows
from .. import comm
from .layers import slice_parameter
from .regions import copy_to_region, gather_from_region, not_kept

__all__ = ["VocabParallelCrossEntropy", "VocabParallelCrossEntropyGrad", "VocabParallelHead",
           "vocab_parallel_linear_cross_entropy"]


def _host(a):
    return np.asarray(array_api.to_numpy(a), dtype=np.float32)


def _logits(h, weight, bias):
    z = h @ weight
    return z if bias is None else z + bias.reshape(1, -1)


class VocabParallelCrossEntropy(TensorOp):
    """mean_i logsumexp(z_i) - z_i[y_i] over the whole vocabulary, z = h W + b, W's columns split over the group.

    Inputs (hidden (N, H), weight (H, V/n), [bias (1, V/n),] target (N,)); the output is a scalar."""

    autocast = "float32"
    saves = "inputs"
    recomputable = False

    def __init__(self, group, vocab_size, chunk_size=None, bias=True):
        self.group, self.vocab_size, self.chunk_size, self.bias = group, vocab_size, chunk_size, bias
        self.start = comm.rank(group) * (vocab_size // comm.world_size(group))
        self.logsumexp = None  # per row, set by compute: what the gradient needs

    def infer_shape(self, *shapes):
        return ()

    def compute(self, hidden, weight, *rest):
        bias, target = rest if self.bias else (None, *rest)
        h, w, y = _host(hidden), _host(weight), _host(target).astype(np.int64)
        b = None if bias is None else _host(bias)
        bad = (y < 0) | (y >= self.vocab_size)
        if bad.any():
            raise IndexError(f"vocab_parallel_linear_cross_entropy: target {int(y[bad][0])} at position "
                             f"{int(np.argmax(bad))} is outside [0, {self.vocab_size})")
        N, V = h.shape[0], w.shape[1]
        local = y - self.start
        mine = (local >= 0) & (local < V)
        row_max, row_sum, target_logit = (np.zeros(N, np.float32) for _ in range(3))
        c = chunk_rows(N, V, self.chunk_size)
        for s in range(0, N, c):
            z = _logits(h[s:s + c], w, b)
            row_max[s:s + c] = z.max(axis=1)
            row_sum[s:s + c] = np.exp(z - row_max[s:s + c, None]).sum(axis=1)
            rows = np.arange(z.shape[0])
            picked = z[rows, np.where(mine[s:s + c], local[s:s + c], 0)]
            target_logit[s:s + c] = np.where(mine[s:s + c], picked, 0)
        m = comm.all_reduce_buffer(row_max.copy(), "max", label="vocabulary-parallel loss: row maxima",
                                   group=self.group)
        sums = np.concatenate([row_sum * np.exp(row_max - m), target_logit])
        sums = comm.all_reduce_buffer(sums, "sum", label="vocabulary-parallel loss: row sums", group=self.group)
        self.logsumexp = m + np.log(sums[:N])
        loss = np.float32((self.logsumexp - sums[N:]).sum() / N)
        return array_api.array(np.array(loss, np.float32).reshape(()), dtype=str(hidden.dtype),
                               device=device_of(hidden))

    def gradient(self, out_grad, node):
        grads = VocabParallelCrossEntropyGrad(self)(*node.inputs, out_grad)
        return tuple(ops.tuple_get_item(grads, i) for i in range(3 if self.bias else 2)) + (None,)


class VocabParallelCrossEntropyGrad(TensorTupleOp):
    """(dh, dW, db) of VocabParallelCrossEntropy on this rank's columns: dh is this rank's part (summed by f)."""

    saves = "inputs"

    def __init__(self, forward):
        self.forward = forward

    def compute(self, hidden, weight, *rest):
        fwd = self.forward
        bias, target, g = rest if fwd.bias else (None, *rest)
        h, w, y = _host(hidden), _host(weight), _host(target).astype(np.int64)
        b = None if bias is None else _host(bias)
        N, V = h.shape[0], w.shape[1]
        scale = np.float32(_host(g).reshape(()) / N)
        local = y - fwd.start
        mine = (local >= 0) & (local < V)
        dh, dw = np.empty_like(h), np.zeros_like(w)
        db = None if b is None else np.zeros(V, np.float32)
        c = chunk_rows(N, V, fwd.chunk_size)
        for s in range(0, N, c):
            dz = np.exp(_logits(h[s:s + c], w, b) - fwd.logsumexp[s:s + c, None])
            rows = np.nonzero(mine[s:s + c])[0]
            dz[rows, local[s:s + c][rows]] -= 1
            dz *= scale
            dh[s:s + c] = dz @ w.T
            dw += h[s:s + c].T @ dz
            if db is not None:
                db += dz.sum(axis=0)
        out = [dh, dw] + ([] if db is None else [db.reshape(bias.shape)])
        return tuple(array_api.array(a, dtype=str(hidden.dtype), device=device_of(hidden)) for a in out)

    def gradient(self, out_grad, node):
        raise NotImplementedError("VocabParallelCrossEntropyGrad: second derivatives are not implemented")


def vocab_parallel_linear_cross_entropy(hidden, weight, bias, target, group=None, chunk_size=None):
    """The mean cross-entropy of `hidden @ weight + bias` against `target` over the whole vocabulary, where
    `weight` (H, V/N) and `bias` (1, V/N) are this rank's columns; see the module docstring. `hidden` must reach
    every rank whole and its gradient be summed over the ranks (VocabParallelHead puts f in front)."""
    if not isinstance(target, Tensor):
        target = Tensor(target, device=hidden.device, requires_grad=False)
    elif target.requires_grad:
        target = target.detach()
    vocab = weight.shape[1] * comm.world_size(group)
    op = VocabParallelCrossEntropy(group, vocab, chunk_size, bias is not None)
    return op(*((hidden, weight) + ((bias,) if bias is not None else ()) + (target,)))


class VocabParallelHead(Module):
    """The LM head (a Linear (H, V)) with its vocabulary split: `forward` gives the whole logits (all-gathered,
    for generation and evaluation), `loss` the fused vocabulary-parallel cross-entropy (what training uses).

    The hidden rows come replicated (f in front: their gradient is summed over the ranks), or with
    `sequence_parallel` as each rank's shard of the rows (all-gathered, reduce-scattered in backward)."""

    shard_axes = {"weight": 1, "bias": 1}

    def __init__(self, linear, group=None, sequence_parallel=False):
        super().__init__()
        what = f"the LM head Linear({linear.in_features}, {linear.out_features})"
        self.group, self.sequence_parallel = group, sequence_parallel
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = slice_parameter(linear.weight, 1, group, what)
        self.bias = None if linear.bias is None else slice_parameter(linear.bias, 1, group, what)

    def _hidden(self, hidden):
        if self.sequence_parallel:  # the whole rows: not kept, gathered again for the gradients (regions.not_kept)
            return gather_from_region(hidden, 0, self.group, regather=True)
        return copy_to_region(hidden, self.group)

    def _read(self, rows):
        if self.sequence_parallel:
            not_kept(rows)

    def forward(self, hidden):
        rows = self._hidden(hidden)
        logits = ops.linear(rows, self.weight, self.bias)
        self._read(rows)
        return gather_from_region(logits, 1, self.group, grad="split")

    def loss(self, hidden, target, chunk_size=None):
        rows = self._hidden(hidden)
        loss = vocab_parallel_linear_cross_entropy(rows, self.weight, self.bias, target, self.group, chunk_size)
        self._read(rows)
        return loss
