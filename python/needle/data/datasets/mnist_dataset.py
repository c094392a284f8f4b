"""MNIST from the four gzip-compressed idx files of the official distribution."""
import gzip
import math
import os
import zlib

import numpy as np

from ..data_basic import Dataset, missing_data_error

__all__ = ["MNISTDataset", "parse_mnist"]

_IMAGES_MAGIC, _LABELS_MAGIC = 2051, 2049  # idx3 (unsigned bytes, 3 dims) and idx1 headers


def _read_idx(filename, magic, ndim):
    """The sizes in the header of an idx file of unsigned bytes with `ndim` dimensions, and its data (uint8, flat).

    The header is the magic number and one big-endian int32 size per dimension; the data must hold exactly their
    product of bytes. A file that breaks this (truncated download, wrong file) raises a ValueError naming it,
    rather than reading garbage.
    """
    if not os.path.exists(filename):
        raise missing_data_error(filename, "mnist", os.path.dirname(filename))
    try:
        with gzip.open(filename, "rb") as f:
            raw = f.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:  # not gzip, or a cut-off / corrupted stream
        raise ValueError(f"{filename}: not a complete gzip file ({err})") from err
    header_bytes = 4 * (1 + ndim)
    if len(raw) < header_bytes:
        raise ValueError(f"{filename}: {len(raw)} bytes, shorter than the {header_bytes}-byte idx header")
    header = [int(v) for v in np.frombuffer(raw, dtype=">i4", count=1 + ndim)]
    if header[0] != magic:
        raise ValueError(f"{filename}: magic number {header[0]}, expected {magic} (is it an MNIST idx file?)")
    sizes = header[1:]
    if min(sizes) < 1:
        raise ValueError(f"{filename}: the header gives sizes {sizes}; each must be at least 1")
    data = np.frombuffer(raw, dtype=np.uint8, offset=header_bytes)
    expected = math.prod(sizes)
    if data.size != expected:
        raise ValueError(f"{filename}: the header gives sizes {sizes}, i.e. {expected} bytes of data, but the file "
                         f"has {data.size} after the header ({'truncated' if data.size < expected else 'too long'})")
    return sizes, data


def _read_mnist(image_filename, label_filename):
    """(X float32 (n, rows*cols) in [0, 1], y uint8 (n,), (rows, cols)) from a pair of idx files."""
    (n, rows, cols), pixels = _read_idx(image_filename, _IMAGES_MAGIC, 3)
    (n_labels,), labels = _read_idx(label_filename, _LABELS_MAGIC, 1)
    if n != n_labels:
        raise ValueError(f"{image_filename} holds {n} images but {label_filename} holds {n_labels} labels")
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
