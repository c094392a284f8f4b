"""Fused ops: the work of several ops in one `compute`, so that a large intermediate never becomes a graph value.

The language model's head, `linear_cross_entropy`, is the mean cross-entropy of the logits z = h W + b without
the (tokens, vocabulary) logits ever existing whole: they are computed a chunk of tokens at a time, inside the
op, in the forward pass and again in the gradient. Chunking only reorders sums, so the numbers are the unfused
ones up to rounding. The field's references: Liger Kernel's FusedLinearCrossEntropy and Apple's Cut
Cross-Entropy (Wijmans et al., 2024).
"""
import numpy

from ..autograd import Tensor, TensorOp, TensorTupleOp
from ..backend_selection import array_api, device_of
from .ops_tuple import tuple_get_item

__all__ = ["LOGITS_CHUNK_ELEMENTS", "LinearCrossEntropy", "LinearCrossEntropyGrad", "chunk_rows",
           "linear_cross_entropy"]

# chunk_size=None: as many token rows as have logits within 2**20 elements (4 MiB of float32).
LOGITS_CHUNK_ELEMENTS = 1 << 20


def chunk_rows(num_tokens, vocab, chunk_size=None):
    """Token rows per chunk: `chunk_size`, or the most rows whose logits fit in LOGITS_CHUNK_ELEMENTS; 1..N."""
    if chunk_size is None:
        chunk_size = LOGITS_CHUNK_ELEMENTS // max(vocab, 1)
    return max(1, min(chunk_size, num_tokens))


class LinearCrossEntropy(TensorOp):
    """mean_i logsumexp(z_i) - z_i[y_i], z = h W + b, chunk by chunk;  d/dz_i = g/N (softmax(z_i) - onehot(y_i))

    Inputs (hidden (N, H), weight (H, V), [bias (V,) or (1, V),] target (N,)); the output is a scalar.
    """

    autocast = "float32"
    saves = "inputs"
    compacts_inputs = True  # a strided input is copied (a chunk's rows of hidden or target, or the whole of it)

    def __init__(self, chunk_size=None, bias=True):
        self.chunk_size, self.bias = chunk_size, bias

    def infer_shape(self, *shapes):
        return () if _fits(*_split(shapes, self.bias)) else None  # None: compute raises the error

    def workspace(self, *shapes):
        hidden, weight, bias, _ = _split(shapes, self.bias)
        (N, H), V = hidden, weight[1]
        c = chunk_rows(N, V, self.chunk_size)
        copied = c < N  # a chunk's rows of hidden and target are copied (whole compact arrays are used as they are)
        return N + max(  # the (N,) row losses, plus the most alive at once while a chunk is computed:
            c * V + copied * c * H,  # the logits (the bias, then the product added) beside the copy of the chunk's rows
            c * V + 3 * c,  # the logits, their row logsumexp, the target logits (beside the target copy), the losses
            1,  # at the end: the losses' sum (the output is the sum / N)
        )

    def compute(self, hidden, weight, *rest):
        bias, target = rest if self.bias else (None, *rest)
        N, V = _check(type(self).__name__, hidden, weight, bias, target)
        c = chunk_rows(N, V, self.chunk_size)
        losses = array_api.empty((N,), dtype=hidden.dtype, device=device_of(hidden))
        for s in range(0, N, c):
            losses[s:s + c] = _chunk_losses(hidden[s:s + c], weight, bias, target[s:s + c])
        return array_api.sum(losses) / N  # summed as the unfused loss is: one sum of the N row losses, then / N

    def gradient(self, out_grad, node):
        grads = LinearCrossEntropyGrad(self.chunk_size, self.bias)(*node.inputs, out_grad)
        parts = tuple(tuple_get_item(grads, i) for i in range(3 if self.bias else 2))
        return parts + (None,)  # targets are integers: no gradient


def linear_cross_entropy(hidden, weight, bias, target, chunk_size=None):
    """Mean cross-entropy of the logits `hidden @ weight + bias` against `target`, computed chunk by chunk.

    The trade-off: a language model's logits (tokens × vocabulary) are often its largest activation, and the
    unfused head (`nn.SoftmaxLoss()(hidden @ W + b, y)`) keeps them, and their gradient, whole. Here at most one
    chunk of tokens' logits exists at a time (plus, while it is used, a block of the same size: the logits plus
    bias, or their gradient), paid for by computing the logits twice: once in the forward pass and once in the
    gradient, which takes softmax − one-hot per chunk (the softmax_xent_grad kernel) and accumulates dW, db and
    dhidden. Chunking only reorders sums: the result is the unfused one up to rounding.

    hidden (N, H), weight (H, V), bias (V,), (1, V) or None, target (N,): integer class ids stored as floats (as
    SoftmaxLoss's labels); a target outside [0, V) raises IndexError naming it and its position. Returns the
    scalar mean loss; differentiable once in hidden, weight and bias.

    chunk_size: token rows per chunk. None picks the most rows whose logits fit in LOGITS_CHUNK_ELEMENTS = 2**20
    elements (4 MiB of float32), at least 1 and at most N: over a hundred rows for vocabularies up to ~10k (20 at
    GPT-2's 50k), so each chunk's matmul stays an efficient one and the Python loop short, while the logits held at
    once are a fixed 4 MiB however long the sequence or large the batch (16 MiB chunks were as fast on the PTB LM
    but kept four times the memory; bench_gc.py --head_part compares). The rule reads only the sizes (not the
    dtype), so the memory the op declares to the Budget's ledger (`workspace`) is known from shapes alone.

        h = ndl.Tensor(np.random.randn(6, 4), requires_grad=True)
        W = ndl.Tensor(np.random.randn(4, 10), requires_grad=True)
        loss = ndl.ops.linear_cross_entropy(h, W, None, ndl.Tensor([1, 0, 9, 3, 3, 2]), chunk_size=4)
        loss.backward()  # h.grad, W.grad: as nn.SoftmaxLoss()(h @ W, y) gives them
    """
    if not isinstance(target, Tensor):
        target = Tensor(target, device=hidden.device, requires_grad=False)
    elif target.requires_grad:
        target = target.detach()  # labels are data: nothing to differentiate
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"linear_cross_entropy: chunk_size must be a positive int or None, got {chunk_size!r}")
    shapes = [None if x is None else tuple(x.shape) for x in (hidden, weight, bias, target)]
    _check_shapes("linear_cross_entropy", *shapes)
    if target.cached_data is not None:  # a leaf's values exist already: check them here, computing nothing
        _check_targets("linear_cross_entropy", target.cached_data, shapes[1][1])
    inputs = (hidden, weight) + ((bias,) if bias is not None else ()) + (target,)
    return LinearCrossEntropy(chunk_size, bias is not None)(*inputs)


class LinearCrossEntropyGrad(TensorTupleOp):
    """(dh, dW, db) for out_grad g: dz = g/N (softmax(z) - onehot(y)) per chunk; dh = dz W^T, dW = Σ h^T dz, db = Σ dz

    Inputs (hidden, weight, [bias,] target, g); the output is (dhidden, dweight[, dbias]), dbias of bias's shape.
    """

    saves = "inputs"
    compacts_inputs = True

    def __init__(self, chunk_size=None, bias=True):
        self.chunk_size, self.bias = chunk_size, bias

    def infer_shape(self, *shapes):
        hidden, weight, bias, target = _split(shapes[:-1], self.bias)
        if not _fits(hidden, weight, bias, target):
            return None  # compute raises the error
        return (hidden, weight) + ((bias,) if self.bias else ())

    def workspace(self, *shapes, low=False):
        hidden, weight, bias, _ = _split(shapes[:-1], self.bias)
        (N, H), V = hidden, weight[1]
        c = chunk_rows(N, V, self.chunk_size)
        copied = c < N  # a chunk's rows of hidden and target are copied (whole compact arrays are used as they are)
        return 1 + max(  # g/N, plus the most alive at once while a chunk is differentiated:
            c * V + copied * c * H,  # the logits, or dz, beside the copy of the chunk's hidden rows (or of h^T)
            # the logits, dz = their gradient, copies of g/N and of the targets (float32 targets: in 16 bits, twice)
            2 * c * V + c + copied * c * (2 if low else 1),
            (bias is not None) * (c * V + V + max(c, V)),  # dz, its column sum (a row of ones, or the new db)
            c * V + c * H,  # dz, W dz^T (matmul reads dz^T in place; dW += h^T dz adds into dW: nothing more)
            2 * c * H,  # dz W^T and the compact copy written into dhidden
        )

    def workspace_16bit(self, *shapes):
        return self.workspace(*shapes, low=True) - self.workspace(*shapes)

    def compute(self, hidden, weight, *rest):
        bias, target, g = rest if self.bias else (None, *rest)
        N, V = _check(type(self).__name__, hidden, weight, bias, target)
        H, c = hidden.shape[1], chunk_rows(N, V, self.chunk_size)
        device, dtype = device_of(hidden), hidden.dtype
        dhidden = array_api.empty((N, H), dtype=dtype, device=device)
        dweight = array_api.zeros((H, V), dtype=dtype, device=device)
        dbias = None if bias is None else array_api.zeros((V,), dtype=dtype, device=device)
        g_row = array_api.reshape(g, (1,)) / N  # d loss / d loss_i, the same for every row i
        for s in range(0, N, c):
            dhidden[s:s + c] = _chunk_grads(hidden[s:s + c], weight, bias, target[s:s + c], g_row, dweight, dbias)
        if bias is None:
            return dhidden, dweight
        return dhidden, dweight, array_api.reshape(dbias, bias.shape)

    def gradient(self, out_grad, node):
        raise NotImplementedError(
            "LinearCrossEntropyGrad: second derivatives of linear_cross_entropy are not implemented; to "
            "differentiate twice, use the unfused head: ops.softmax_cross_entropy(hidden @ weight + bias, target)")


# ----- one chunk of tokens -------------------------------------------------------------------------------------
# Temporaries die when these return, so a chunk's logits never outlive it (the ops' `workspace` counts them).
def _logits(h, weight, bias):
    """z = h W + b for one chunk's rows h: b written into every row, then the product added to it (add_matmul), so
    the logits and the logits plus bias never exist side by side."""
    if bias is None:
        return array_api.matmul(h, weight)
    rows = array_api.broadcast_to(array_api.reshape(bias, (1, weight.shape[1])), (h.shape[0], weight.shape[1]))
    return array_api.add_matmul(array_api.copy(rows), h, weight)


def _chunk_losses(h, weight, bias, y):
    """logsumexp(z_i) - z_i[y_i] for one chunk."""
    z = _logits(h, weight, bias)
    return array_api.logsumexp(z, axis=1) - array_api.take_along_rows(z, y)


def _chunk_grads(h, weight, bias, y, g_row, dweight, dbias):
    """Add one chunk's share to dweight (and dbias) in place; return its rows of dhidden, dz W^T."""
    c = h.shape[0]
    dz = array_api.softmax_xent_grad(_logits(h, weight, bias), y, array_api.broadcast_to(g_row, (c,)))
    if dbias is not None:
        dbias[:] = dbias + array_api.sum(dz, axis=0)
    array_api.add_matmul(dweight, array_api.transpose(h, (1, 0)), dz)  # dW += h^T dz, the matmul adding into dW
    # (W dz^T)^T: matmul reads dz^T in place (the transpose of a whole compact matrix)
    return array_api.transpose(array_api.matmul(weight, array_api.transpose(dz, (1, 0))), (1, 0))


# ----- checks ------------------------------------------------------------------------------------------------
def _split(shapes, has_bias):
    """(hidden, weight, bias or None, target) from an op's inputs, which list bias only when it has one."""
    return tuple(shapes) if has_bias else (shapes[0], shapes[1], None, shapes[2])


def _fits(hidden, weight, bias, target):
    return (len(hidden) == 2 and len(weight) == 2 and hidden[1] == weight[0] and hidden[0] >= 1 and weight[1] >= 1
            and bias in (None, (weight[1],), (1, weight[1])) and tuple(target) == (hidden[0],))


def _check_shapes(name, hidden, weight, bias, target):
    if not _fits(hidden, weight, bias, target):
        raise ValueError(f"{name}: need hidden (N, H) with N >= 1, weight (H, V) with V >= 1, bias (V,), (1, V) or "
                         f"None, and target (N,); got hidden {hidden}, weight {weight}, bias {bias}, target {target}")


def _check(name, hidden, weight, bias, target):
    """Check shapes and targets of raw arrays; return (N, V)."""
    _check_shapes(name, tuple(hidden.shape), tuple(weight.shape), None if bias is None else tuple(bias.shape),
                  tuple(target.shape))
    _check_targets(name, target, weight.shape[1])
    return hidden.shape[0], weight.shape[1]


def _check_targets(name, target, vocab):
    """IndexError naming the first target that is not an integer in [0, vocab), and its position."""
    t = numpy.asarray(array_api.to_numpy(target), dtype=numpy.float64)
    with numpy.errstate(invalid="ignore"):
        bad = ~((t >= 0) & (t < vocab) & (t == numpy.floor(t)))
    if bad.any():
        i = int(numpy.argmax(bad))
        raise IndexError(f"{name}: target {t[i]:g} at position {i} is not a class id in [0, {vocab})")

