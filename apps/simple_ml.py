"""The course's training and evaluation helpers (homeworks 0-4), written with needle.

MNIST softmax regression / two-layer network (`parse_mnist`, `softmax_loss`, `nn_epoch`, `loss_err`), CIFAR-10
(`epoch_general_cifar10`, `train_cifar10`, `evaluate_cifar10`) and Penn Treebank language models
(`epoch_general_ptb`, `train_ptb`, `evaluate_ptb`). The CIFAR-10 and PTB helpers call `np.random.seed(4)` first,
as the course's do, so seeded runs reproduce the course's numbers.

needle's backward pass releases every activation after its last backward use (see needle.checkpoint), so each
training step reads what it needs from the forward pass — the loss value, the logits for the accuracy, the
detached hidden state — before it calls `backward()`.
"""
import math
import sys

import numpy as np

import needle as ndl
from needle import nn
from needle.autograd import Tensor
from needle.data import get_batch, parse_mnist as _read_mnist

__all__ = [
    "epoch_general_cifar10",
    "epoch_general_ptb",
    "evaluate_cifar10",
    "evaluate_ptb",
    "loss_err",
    "nn_epoch",
    "parse_mnist",
    "softmax_loss",
    "train_cifar10",
    "train_ptb",
]


# ----- homeworks 0-1: MNIST with explicit weights -------------------------------------------------------------
def parse_mnist(image_filename, label_filename):
    """Read MNIST idx.gz files: X float32 (n, 784) scaled to [0, 1], y uint8 (n,)."""
    return _read_mnist(image_filename, label_filename)


def softmax_loss(Z, y_one_hot):
    """Average softmax (cross-entropy) loss of logits Z (batch, classes) against one-hot labels, as a Tensor."""
    return (ndl.logsumexp(Z, axes=(1,)).sum() - (Z * y_one_hot).sum()) / Z.shape[0]


def _one_hot(y, num_classes):
    one_hot = np.zeros((y.shape[0], num_classes))
    one_hot[np.arange(y.size), y] = 1
    return one_hot


def nn_epoch(X, y, W1, W2, lr=0.1, batch=100):
    """One epoch of SGD, in order, on the network relu(X W1) W2 with softmax loss; returns the new (W1, W2).

    X: NumPy (n, input_dim), y: NumPy (n,) class ids, W1 (input_dim, hidden) and W2 (hidden, classes): Tensors.
    """
    num_classes, device = W2.shape[1], W1.device
    for start in range(0, X.shape[0], batch):
        Xb, yb = ndl.Tensor(X[start:start + batch], device=device), y[start:start + batch]
        Z = ndl.relu(Xb @ W1) @ W2
        loss = softmax_loss(Z, ndl.Tensor(_one_hot(yb, num_classes), device=device))
        loss.backward()
        W1 = ndl.Tensor(W1.numpy() - lr * W1.grad.numpy(), device=device)
        W2 = ndl.Tensor(W2.numpy() - lr * W2.grad.numpy(), device=device)
    return W1, W2


def loss_err(h, y):
    """(softmax loss, error rate) of logits h (a Tensor) against class ids y (NumPy)."""
    y_one_hot = ndl.Tensor(_one_hot(y, h.shape[-1]), device=h.device)
    return softmax_loss(h, y_one_hot).numpy(), np.mean(h.numpy().argmax(axis=1) != y)


# ----- shared pieces of the training loops ---------------------------------------------------------------------
def _progress(iterable, total, progress):
    """`iterable` wrapped in a tqdm bar on stderr when `progress` is truthy (a string is the bar's description).

    tqdm.auto draws a widget in a notebook and a text bar elsewhere; the finished bar stays as the epoch's last
    line, with the loss (and perplexity or accuracy) that the loop shows on it (`_show_metrics`)."""
    if not progress:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a declared dependency; without it training still runs, silently
        return iterable
    return tqdm(iterable, total=total, desc=progress if isinstance(progress, str) else None, leave=True,
                dynamic_ncols=True)


def _show_metrics(bar, **metrics):
    """Put the running metrics on a progress bar (a no-op without one); display only, nothing is computed."""
    if hasattr(bar, "set_postfix"):
        bar.set_postfix({k: f"{v:.4g}" for k, v in metrics.items()}, refresh=False)


def _perplexity(avg_loss):
    return math.exp(avg_loss) if avg_loss < 700 else float("inf")


def _show_progress(progress):
    """progress=None means: show a bar when stderr is a terminal, or in a notebook."""
    return (sys.stderr.isatty() or "ipykernel" in sys.modules) if progress is None else bool(progress)


def _item(value):
    """A Python float from a one-element Tensor or array."""
    return np.asarray(value.numpy() if isinstance(value, Tensor) else value).item()


def _model_device(model):
    params = model.parameters()
    return params[0].device if params else ndl.default_device()


def _on_device(tensor, device):
    return tensor if tensor.device == device else Tensor(tensor.numpy(), device=device, requires_grad=False)


def _detach(h):
    """The recurrent state cut from the graph: None, a Tensor, or a tuple of them (LSTM's (h, c))."""
    if h is None:
        return None
    if isinstance(h, (tuple, list)):
        return tuple(_detach(x) for x in h)
    return h.detach()


def _clip_grad_norm(params, max_norm):
    """Scale every gradient by max_norm / ||all gradients|| when that global norm exceeds max_norm."""
    grads = [(p, p.grad.realize_cached_data()) for p in params if p.grad is not None]
    norm = math.sqrt(sum(_item((g * g).sum()) for _, g in grads))
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for p, g in grads:
            p.grad = Tensor(g * scale, device=p.device, dtype=p.dtype, requires_grad=False)
    return norm


class _GradAccumulator:
    """Sums the gradients of several backward passes in raw arrays (outside the graph)."""

    def __init__(self, params):
        self.params = params
        self.sums = [None] * len(params)

    def add(self):
        for i, p in enumerate(self.params):
            if p.grad is not None:
                g = p.grad.realize_cached_data()
                self.sums[i] = g if self.sums[i] is None else self.sums[i] + g

    def store(self):
        """Put the sums into the parameters' `.grad` (for the optimizer) and start over."""
        for p, total in zip(self.params, self.sums):
            p.grad = None if total is None else Tensor(total, device=p.device, dtype=p.dtype, requires_grad=False)
        self.sums = [None] * len(self.params)


# ----- homework 4: CIFAR-10 ----------------------------------------------------------------------------------------
def epoch_general_cifar10(dataloader, model, loss_fn=nn.SoftmaxLoss(), opt=None, progress=False):
    """One pass over `dataloader`: trains with `opt` if given, else evaluates. Returns (avg_acc, avg_loss)."""
    np.random.seed(4)
    model.train() if opt is not None else model.eval()
    device = _model_device(model)
    correct = total_loss = 0.0
    seen = 0
    bar = _progress(dataloader, len(dataloader), progress)
    for X, y in bar:
        X, y = _on_device(X, device), _on_device(y, device)
        if opt is not None:
            opt.reset_grad()
        out = model(X)
        loss = loss_fn(out, y)
        n = y.shape[0]
        correct += float(np.sum(out.numpy().argmax(axis=1) == y.numpy()))
        total_loss += _item(loss) * n
        seen += n
        _show_metrics(bar, loss=total_loss / seen, acc=correct / seen)
        if opt is not None:
            loss.backward()
            opt.step()
    return correct / seen, total_loss / seen


def train_cifar10(model, dataloader, n_epochs=1, optimizer=ndl.optim.Adam, lr=0.001, weight_decay=0.001,
                  loss_fn=nn.SoftmaxLoss, progress=None):
    """Train for `n_epochs`; returns (avg_acc, avg_loss) of the last epoch. A tqdm bar per epoch on a terminal."""
    np.random.seed(4)
    opt = optimizer(model.parameters(), lr=lr, weight_decay=weight_decay)
    show = _show_progress(progress)
    for epoch in range(n_epochs):
        avg_acc, avg_loss = epoch_general_cifar10(dataloader, model, loss_fn(), opt,
                                                  progress=show and f"epoch {epoch + 1}/{n_epochs}")
    return avg_acc, avg_loss


def evaluate_cifar10(model, dataloader, loss_fn=nn.SoftmaxLoss):
    """(avg_acc, avg_loss) of `model` in eval mode over `dataloader`."""
    np.random.seed(4)
    return epoch_general_cifar10(dataloader, model, loss_fn())


# ----- homework 4: Penn Treebank -----------------------------------------------------------------------------------
def epoch_general_ptb(data, model, seq_len=40, loss_fn=nn.SoftmaxLoss(), opt=None, clip=None, device=None,
                      dtype="float32", accumulation_steps=1, progress=False):
    """One pass of truncated BPTT over batchified `data` (nbatch, B); trains with `opt` if given.

    Windows of `seq_len` rows are taken in order; the recurrent state is carried from one window to the next,
    detached. `clip` clips the gradients by their global norm. With `accumulation_steps=k` each window's B columns
    are split into k micro-batches of B/k columns, run one after the other (each with its own slice of the state)
    with their losses scaled by 1/k; the optimizer steps once on the summed gradients — the same update as the
    whole window at once, with about 1/k of the activation memory. Returns (avg_acc, avg_loss) per token.
    """
    np.random.seed(4)
    model.train() if opt is not None else model.eval()
    device = device or _model_device(model)
    nbatch, batch_size = data.shape
    if nbatch < 2:  # a window's targets are the next row: one row gives no window at all
        raise ValueError(f"epoch_general_ptb: the batchified data has {nbatch} row(s) of {batch_size} tokens; at "
                         "least 2 are needed (each window predicts the next row): use a smaller batch size or more "
                         "text")
    k = int(accumulation_steps)
    if k < 1 or batch_size % k:
        raise ValueError(f"accumulation_steps={accumulation_steps} must divide the batch size {batch_size}")
    micro = batch_size // k
    if getattr(opt, "in_backward", False) and (clip is not None or k > 1):
        why = ("the gradients never exist together to be clipped by their global norm" if clip is not None else
               "gradients cannot accumulate over micro-batches")
        raise ValueError(f"epoch_general_ptb: the optimizer updates inside backward (in_backward=True), so {why}; "
                         "use in_backward=False")
    columns = [data] if k == 1 else [np.ascontiguousarray(data[:, j * micro:(j + 1) * micro]) for j in range(k)]
    hidden = [None] * k
    params = model.parameters()
    accumulator = _GradAccumulator(params) if opt is not None and k > 1 else None
    correct = total_loss = 0.0
    seen = 0
    starts = range(0, nbatch - 1, seq_len)
    bar = _progress(starts, len(starts), progress)
    for i in bar:
        if opt is not None:
            opt.reset_grad()
        for j, part in enumerate(columns):
            X, y = get_batch(part, i, seq_len, device=device, dtype=dtype)
            out, h = model(X, hidden[j])
            loss = loss_fn(out, y)
            # Everything read from the forward pass is read now: backward releases it.
            n = y.shape[0]
            correct += float(np.sum(out.numpy().argmax(axis=1) == y.numpy()))
            total_loss += _item(loss) * n
            seen += n
            hidden[j] = _detach(h)
            if opt is not None:
                (loss if k == 1 else loss * (1.0 / k)).backward()
                if accumulator is not None:
                    accumulator.add()
        _show_metrics(bar, loss=total_loss / seen, ppl=_perplexity(total_loss / seen))
        if opt is not None:
            if accumulator is not None:
                accumulator.store()
            if clip is not None:
                _clip_grad_norm(params, clip)
            opt.step()
    return correct / seen, total_loss / seen


def train_ptb(model, data, seq_len=40, n_epochs=1, optimizer=ndl.optim.SGD, lr=4.0, weight_decay=0.0,
              loss_fn=nn.SoftmaxLoss, clip=None, device=None, dtype="float32", accumulation_steps=1, progress=None):
    """Train a language model for `n_epochs`; returns (avg_acc, avg_loss) of the last epoch.

    `accumulation_steps` (see epoch_general_ptb) trades time for activation memory without changing the updates.
    A tqdm bar per epoch, on stderr, is shown when stderr is a terminal or in a notebook (progress=None), or as
    `progress` says; each ends as a line with the epoch's loss and perplexity.
    """
    np.random.seed(4)
    opt = optimizer(model.parameters(), lr=lr, weight_decay=weight_decay)
    show = _show_progress(progress)
    for epoch in range(n_epochs):
        avg_acc, avg_loss = epoch_general_ptb(data, model, seq_len, loss_fn(), opt, clip, device, dtype,
                                              accumulation_steps=accumulation_steps,
                                              progress=show and f"epoch {epoch + 1}/{n_epochs}")
    return avg_acc, avg_loss


def evaluate_ptb(model, data, seq_len=40, loss_fn=nn.SoftmaxLoss, device=None, dtype="float32", progress=None):
    """(avg_acc, avg_loss) per token of `model` in eval mode over batchified `data`; a tqdm bar as train_ptb's,
    ending as a line with the loss and perplexity."""
    np.random.seed(4)
    return epoch_general_ptb(data, model, seq_len, loss_fn(), None, None, device, dtype,
                             progress=_show_progress(progress) and "eval")
