"""MNIST from the four gzip-compressed idx files of the official distribution."""
import gzip
import os

import numpy as np

from ..data_basic import Dataset, missing_data_error

__all__ = ["MNISTDataset", "parse_mnist"]

_IMAGES_MAGIC, _LABELS_MAGIC = 2051, 2049  # idx3 (unsigned bytes, 3 dims) and idx1 headers


def _read_idx(filename, magic, header_ints):
    if not os.path.exists(filename):
        raise missing_data_error(filename, "mnist", os.path.dirname(filename))
    with gzip.open(filename, "rb") as f:
        raw = f.read()
    header = np.frombuffer(raw, dtype=">i4", count=header_ints)
    if header[0] != magic:
        raise ValueError(f"{filename}: magic number {header[0]}, expected {magic} (is it an MNIST idx file?)")
    return header, np.frombuffer(raw, dtype=np.uint8, offset=4 * header_ints)


def parse_mnist(image_filename, label_filename):
    """Read MNIST idx files: X float32 (n, rows*cols) scaled to [0, 1], y uint8 (n,)."""
    (_, n, rows, cols), pixels = _read_idx(image_filename, _IMAGES_MAGIC, 4)
    (_, n_labels), labels = _read_idx(label_filename, _LABELS_MAGIC, 2)
    if n != n_labels or pixels.size != n * rows * cols or labels.size != n:
        raise ValueError(f"{image_filename} ({n} images) and {label_filename} ({n_labels} labels) do not match")
    X = pixels.reshape(n, rows * cols).astype(np.float32) / 255.0
    return X, labels.copy()


class MNISTDataset(Dataset):
    """MNIST digits: sample i is (x float32 (784,) in [0, 1], y uint8).

    Transforms see each image as H x W x C (28 x 28 x 1); the result is flattened back to (784,), as in the
    course. A slice or an index array gives a batch: x (k, 784), y (k,).
    """

    def __init__(self, image_filename, label_filename, transforms=None):
        super().__init__(transforms)
        self.images, self.labels = parse_mnist(image_filename, label_filename)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        x, y = self.images[index], self.labels[index]
        if self.transforms:
            side = int(round(np.sqrt(self.images.shape[1])))
            images = x.reshape(-1, side, side, 1)
            x = np.stack([self.apply_transforms(img) for img in images]).reshape(x.shape)
        return x, y
