"""The corpus a run trains on (PTB, or a synthetic stand-in of PTB's vocabulary size) and a step's micro-batches."""
import functools
import os

import numpy as np

import needle as ndl
from needle.data import Corpus, get_batch

from . import ROOT
from .console import fail

PTB_VOCAB = 10000
SYNTHETIC = "synthetic"
DEFAULT_DATA = [os.path.join(ROOT, "data", "ptb"), os.path.join(ROOT, "..", "shared", "data", "ptb")]


def synthetic_corpus(num_tokens=200_000, vocab=PTB_VOCAB, seed=0):
    """Zipf-distributed word ids over a PTB-sized vocabulary (deterministic), standing in for PTB text."""
    rs = np.random.RandomState(seed)
    ranks = np.arange(1, vocab + 1)
    p = 1.0 / ranks
    return rs.choice(vocab, size=num_tokens, p=p / p.sum()).astype(np.float32), vocab


def has_ptb(path):
    return all(os.path.isfile(os.path.join(path, name)) for name in ("train.txt", "test.txt"))


def resolve_data(data):
    """The data source a run uses: a PTB folder, or SYNTHETIC.  An explicit folder must hold PTB; only the
    default (data/ptb, then ../shared/data/ptb next to gc.py) falls back to the synthetic corpus."""
    if data is None:
        return next((os.path.normpath(p) for p in DEFAULT_DATA if has_ptb(p)), SYNTHETIC)
    if data == SYNTHETIC or has_ptb(data):
        return data
    missing = "does not exist" if not os.path.exists(data) else "has no train.txt and test.txt"
    fail(f"--data {data} {missing} (fetch PTB with: python -m needle.data.download ptb --dir data; "
         f"or leave --data out, or give --data {SYNTHETIC}, for the synthetic corpus)")


def load_data(source):
    """(train token ids, vocabulary size) of a PTB folder, or of the synthetic corpus."""
    if source == SYNTHETIC:
        return synthetic_corpus()
    try:
        corpus = Corpus(source)
    except (OSError, ValueError) as err:  # unreadable, or not UTF-8 text: the loader's message names the file
        fail(f"--data {source}: {err}")
    return np.array(corpus.train, dtype=np.float32), len(corpus.dictionary)


@functools.cache
def vocabulary_words(source):
    """The words of a run's vocabulary, in id order: the PTB folder's dictionary, or the synthetic corpus's names
    w0, w1, ... (what gc.py sample writes its text with)."""
    if source == SYNTHETIC:
        return tuple(f"w{i}" for i in range(PTB_VOCAB))
    return tuple(Corpus(source).dictionary.idx2word)


def batch_text(config):
    b, k = config.batch_size, config.accumulation_steps
    return f"batch {b}" if k == 1 else f"batch {b} x {k} = {b * k} (--accumulation-steps {k})"


def windows(config, num_tokens):
    """How many seq_len windows a corpus of num_tokens holds for the step's batch (what get_batch can start at)."""
    return (num_tokens // (config.batch_size * config.accumulation_steps) - 1) // config.seq_len


def check_corpus(config, data):
    rows = len(data) // (config.batch_size * config.accumulation_steps)
    if rows - 1 < config.seq_len:
        fail(f"the corpus ({len(data)} tokens) is too small for {batch_text(config)} x seq_len {config.seq_len}: "
             f"a step needs {(config.seq_len + 1) * config.batch_size * config.accumulation_steps} tokens")


def micro_batches(batches, start, config, device):
    """The step's (X, y) micro-batches: the window at `start`, its columns split `accumulation_steps` ways."""
    k = config.accumulation_steps
    X_all, y_all = get_batch(batches, start, config.seq_len, device=device, dtype="float32")
    if k == 1:
        return [(X_all, y_all)]
    X_np, b = X_all.numpy(), config.batch_size  # micro-batch j is columns [j*b, (j+1)*b) of the big batch
    y_np = y_all.numpy().reshape(X_np.shape)
    return [(ndl.Tensor(X_np[:, j * b:(j + 1) * b], device=device, requires_grad=False),
             ndl.Tensor(y_np[:, j * b:(j + 1) * b].reshape(-1), device=device, requires_grad=False))
            for j in range(k)]
