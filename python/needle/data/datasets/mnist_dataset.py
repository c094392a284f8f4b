"""MNIST from the four gzip-compressed idx files of the official distribution."""
import gzip
import math
import os
import zlib

import numpy as np

from ..data_basic import Dataset, missing_data_error

__all__ = ["MNISTDataset", "parse_mnist"]

_IMAGES_MAGIC, _LABELS_MAGIC = 2051, 2049  # idx3 (unsigned bytes, 3 dims) and idx1 headers


# DEFLATE cannot expand data more than 1032-fold; a header promising more than that (plus slack for the gzip
# framing) describes a file this one cannot be, and is refused before anything is inflated.
_MAX_INFLATION = 1100
# Bytes past the promised data that are counted for the error message before giving up counting.
_EXCESS_COUNTED = 1 << 24


def _idx_sizes(filename, head, magic, ndim):
    """The dimension sizes from the idx header bytes `head`, checked: magic number, length, every size >= 1."""
    if len(head) < 4 * (1 + ndim):
        raise ValueError(f"{filename}: {len(head)} bytes, shorter than the {4 * (1 + ndim)}-byte idx header")
    header = [int(v) for v in np.frombuffer(head, dtype=">i4", count=1 + ndim)]
    if header[0] != magic:
        raise ValueError(f"{filename}: magic number {header[0]}, expected {magic} (is it an MNIST idx file?)")
    sizes = header[1:]
    if min(sizes) < 1:
        raise ValueError(f"{filename}: the header gives sizes {sizes}; each must be at least 1")
    return sizes


def _count_rest(stream):
    """How many bytes remain in `stream`, counting at most _EXCESS_COUNTED (in chunks, nothing kept)."""
    rest = 0
    while rest <= _EXCESS_COUNTED:
        chunk = stream.read(1 << 20)
        if not chunk:
            break
        rest += len(chunk)
    return rest


def _check_inflation(filename, expected):
    compressed = os.path.getsize(filename)
    if expected > _MAX_INFLATION * compressed:
        raise ValueError(f"{filename}: the header promises {expected} bytes of data from {compressed} compressed "
                         f"bytes, more than gzip can inflate to (at most ~{_MAX_INFLATION}x): not an MNIST file")


def _read_idx(filename, magic, ndim):
    """The sizes in the header of an idx file of unsigned bytes with `ndim` dimensions, and its data (uint8, flat).

    The header is the magic number and one big-endian int32 size per dimension; the data must hold exactly their
    product of bytes. A file that breaks this (truncated download, wrong file) raises a ValueError naming it,
    rather than reading garbage.
    """
    if not os.path.exists(filename):
        raise missing_data_error(filename, "mnist", os.path.dirname(filename))
    header_bytes = 4 * (1 + ndim)
    try:
        with gzip.open(filename, "rb") as f:
            head = f.read(header_bytes)
            sizes = _idx_sizes(filename, head, magic, ndim)
            expected = math.prod(sizes)
            _check_inflation(filename, expected)
            # Read at most one byte more than the header promises: a stream that inflates further (a "gzip bomb",
            # or just the wrong file) is reported as too long without ever being inflated whole.
            body = f.read(expected + 1)
            found = len(body) if len(body) <= expected else len(body) + _count_rest(f)
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:  # not gzip, or a cut-off / corrupted stream
        raise ValueError(f"{filename}: not a complete gzip file ({err})") from err
    if found != expected:
        has = f"more than {found}" if found > expected + _EXCESS_COUNTED else str(found)
        raise ValueError(f"{filename}: the header gives sizes {sizes}, i.e. {expected} bytes of data, but the file "
                         f"has {has} after the header ({'truncated' if found < expected else 'too long'})")
    return sizes, np.frombuffer(body, dtype=np.uint8)


def _read_mnist(image_filename, label_filename):
    """(X float32 (n, rows*cols) in [0, 1], y uint8 (n,), (rows, cols)) from a pair of idx files."""
    (n, rows, cols), pixels = _read_idx(image_filename, _IMAGES_MAGIC, 3)
    (n_labels,), labels = _read_idx(label_filename, _LABELS_MAGIC, 1)
    if n != n_labels:
        raise ValueError(f"{image_filename} holds {n} images but {label_filename} holds {n_labels} labels")
    if labels.size and int(labels.max()) > 9:
        bad = int(np.flatnonzero(labels > 9)[0])
        raise ValueError(f"{label_filename}: label {int(labels[bad])} at index {bad} is outside 0..9 (MNIST digits)")
    X = pixels.reshape(n, rows * cols).astype(np.float32) / 255.0
    return X, labels.copy(), (rows, cols)


def parse_mnist(image_filename, label_filename):
    """Read MNIST idx files: X float32 (n, rows*cols) scaled to [0, 1], y uint8 (n,)."""
    X, y, _ = _read_mnist(image_filename, label_filename)
    return X, y


class MNISTDataset(Dataset):
    """MNIST digits: sample i is (x float32 (784,) in [0, 1], y uint8).

    Transforms see each image as H x W x C (28 x 28 x 1); the result is flattened back to (784,), as in the
    course. A slice or an index array gives a batch: x (k, 784), y (k,).
    """

    def __init__(self, image_filename, label_filename, transforms=None):
        super().__init__(transforms)
        self.images, self.labels, self.image_size = _read_mnist(image_filename, label_filename)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        x, y = self.images[index], self.labels[index]
        if self.transforms:
            images = x.reshape(-1, *self.image_size, 1)
            x = np.stack([self.apply_transforms(img) for img in images]).reshape(x.shape)
        return x, y
