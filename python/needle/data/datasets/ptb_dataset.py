"""Penn Treebank (Mikolov's split) for language modelling: a vocabulary, token ids, and BPTT batches."""
import os

import numpy as np

from ...autograd import Tensor
from ..data_basic import missing_data_error

__all__ = ["Corpus", "Dictionary", "batchify", "get_batch"]


class Dictionary:
    """A vocabulary: `word2idx` maps a word to its id, `idx2word` lists the words in order of first appearance."""

    def __init__(self):
        self.word2idx = {}
        self.idx2word = []

    def add_word(self, word):
        """The id of `word`, adding it at the end if it is new."""
        if word not in self.word2idx:
            self.word2idx[word] = len(self.idx2word)
            self.idx2word.append(word)
        return self.word2idx[word]

    def __len__(self):
        return len(self.idx2word)

    def encode(self, text):
        """The ids of `text`'s words (split on whitespace), `<eos>` after each line break, as Corpus reads a file.
        A word not in the vocabulary is a ValueError naming it (PTB writes rare words as <unk>, numbers as N)."""
        lines = text.split("\n")
        words = [w for i, line in enumerate(lines) for w in line.split() + ["<eos>"] * (i < len(lines) - 1)]
        unknown = sorted({w for w in words if w not in self.word2idx})
        if unknown:
            raise ValueError(f"not in the vocabulary of {len(self)} words: {', '.join(map(repr, unknown[:10]))}"
                             f"{' ...' if len(unknown) > 10 else ''}")
        return [self.word2idx[w] for w in words]

    def decode(self, ids):
        """The words of `ids` (integers, or whole floats as batchify holds them) joined with one space."""
        words = []
        for i in ids:
            if int(i) != i or not 0 <= int(i) < len(self):
                raise ValueError(f"decode: {i!r} is not a word id of this vocabulary (0..{len(self) - 1})")
            words.append(self.idx2word[int(i)])
        return " ".join(words)


class Corpus:
    """`train` and `test` token-id lists read from base_dir/{train,test}.txt, with one shared `dictionary`.

    Words are separated by whitespace and an `<eos>` token ends every line. `max_lines` reads only the first
    lines of each file.
    """

    def __init__(self, base_dir, max_lines=None):
        self.dictionary = Dictionary()
        self.train = self.tokenize(os.path.join(base_dir, "train.txt"), max_lines)
        self.test = self.tokenize(os.path.join(base_dir, "test.txt"), max_lines)

    def encode(self, text):
        """The dictionary's ids of `text` (Dictionary.encode)."""
        return self.dictionary.encode(text)

    def decode(self, ids):
        """The dictionary's words of `ids`, joined with one space (Dictionary.decode)."""
        return self.dictionary.decode(ids)

    def tokenize(self, path, max_lines=None):
        """The list of word ids of the file at `path` (first `max_lines` lines), adding new words."""
        if not os.path.exists(path):
            raise missing_data_error(path, "ptb", os.path.dirname(os.path.dirname(os.path.normpath(path))))
        ids = []
        with open(path, encoding="utf-8") as f:
            try:
                for i, line in enumerate(f):
                    if max_lines is not None and i >= max_lines:
                        break
                    ids.extend(self.dictionary.add_word(w) for w in line.split() + ["<eos>"])
            except UnicodeDecodeError as err:
                good = i + 1 if ids else 0
                raise ValueError(f"{path}: not UTF-8 text ({err.reason}; {good} lines read before it): is it a PTB "
                                 f"text file?") from None
        return ids


def batchify(data, batch_size, device, dtype):
    """Arrange a token-id list in `batch_size` columns: a NumPy array (nbatch, batch_size).

    Column j holds the consecutive tokens data[j*nbatch:(j+1)*nbatch] (column-major); the remainder that does not
    fill a whole row is dropped. `device` is unused (the array stays in NumPy until get_batch).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batchify: batch_size must be a positive integer, got {batch_size!r}")
    nbatch = len(data) // batch_size
    if nbatch == 0:
        raise ValueError(f"batchify: {len(data)} tokens are fewer than batch_size={batch_size}")
    array = np.asarray(data[:nbatch * batch_size], dtype=dtype)
    return np.ascontiguousarray(array.reshape(batch_size, nbatch).T)


def get_batch(batches, i, bptt, device=None, dtype=None):
    """The BPTT window starting at row i: inputs X (seq_len, B) and next-token targets y (seq_len * B,).

    seq_len = min(bptt, len(batches) - 1 - i); both are Tensors on `device` that do not require grad.
    """
    n = len(batches)
    # Row i needs row i + 1 for its targets. A negative i would slice from the end and give an empty batch.
    if not 0 <= i < n - 1:
        raise IndexError(f"get_batch: i={i} is out of range for {n} rows of batches (valid: 0..{n - 2}; "
                         f"the last row has no next-token target)")
    if bptt < 1:
        raise ValueError(f"get_batch: bptt={bptt} must be at least 1")
    seq_len = min(bptt, n - 1 - i)
    data = batches[i:i + seq_len]
    target = batches[i + 1:i + 1 + seq_len].reshape(-1)
    return (Tensor(data, device=device, dtype=dtype, requires_grad=False),
            Tensor(target, device=device, dtype=dtype, requires_grad=False))
