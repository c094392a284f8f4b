"""CIFAR-10 from the Python pickles of the official archive (cifar-10-batches-py)."""
import os
import pickle

import numpy as np

from ..data_basic import Dataset, missing_data_error

try:  # NumPy >= 2 moved numpy.core to numpy._core (importing the old name warns)
    from numpy._core.multiarray import _reconstruct as numpy_reconstruct
except ImportError:  # pragma: no cover - NumPy 1.x
    from numpy.core.multiarray import _reconstruct as numpy_reconstruct

__all__ = ["CIFAR10Dataset", "RestrictedUnpickler", "load_cifar_batch"]


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds only what the official CIFAR-10 batches contain: dicts, lists, bytes, ints and
    NumPy arrays. Any other global (a function or class a crafted pickle could call) raises UnpicklingError.
    """

    # (module, name) -> the object; the batches were written by Python 2 with NumPy 1.x (numpy.core.*).
    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): lambda: numpy_reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): lambda: numpy_reconstruct,
        ("numpy", "ndarray"): lambda: np.ndarray,
        ("numpy", "dtype"): lambda: np.dtype,
    }

    def find_class(self, module, name):
        resolve = self.ALLOWED.get((module, name))
        if resolve is None:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a CIFAR-10 batch contains only "
                                         f"NumPy arrays, lists and bytes")
        return resolve()


def load_cifar_batch(path):
    """The dict of one CIFAR-10 batch file: {b"data": uint8 (n, 3072), b"labels": [...], ...}."""
    with open(path, "rb") as f:
        try:
            return RestrictedUnpickler(f, encoding="bytes").load()
        except (EOFError, pickle.UnpicklingError) as err:  # truncated, or refused by RestrictedUnpickler
            raise pickle.UnpicklingError(f"{path}: {err}") from err


def _images_and_labels(path, batch):
    """The images uint8 (n, 3, 32, 32) and labels int64 (n,) of one loaded batch, checked: a batch that is not
    the official layout raises a ValueError naming the file instead of loading mismatched or out-of-range data."""
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise ValueError(f"{path}: not a CIFAR-10 batch (expected a dict with b'data' and b'labels')")
    data, labels = np.asarray(batch[b"data"]), np.asarray(batch[b"labels"])
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or not np.issubdtype(data.dtype, np.integer):
        raise ValueError(f"{path}: data is {data.dtype} of shape {data.shape}, expected integers of shape "
                         f"(n, 3072): n images of 3 x 32 x 32")
    if data.dtype != np.uint8 and data.size and (data.min() < 0 or data.max() > 255):
        raise ValueError(f"{path}: pixel values must lie in 0..255, found {data.min()}..{data.max()}")
    if labels.ndim != 1 or len(labels) != len(data):
        raise ValueError(f"{path}: {len(data)} images but {labels.size} labels")
    if labels.size and not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{path}: labels are {labels.dtype}, expected integer class ids 0..9")
    bad = labels[(labels < 0) | (labels > 9)]
    if bad.size:
        raise ValueError(f"{path}: labels must be class ids 0..9; {bad.size} are not (e.g. {bad[0]})")
    return data.astype(np.uint8, copy=False).reshape(-1, 3, 32, 32), labels.astype(np.int64)


class CIFAR10Dataset(Dataset):
    """CIFAR-10: sample i is (x float32 (3, 32, 32) in [0, 1], y int64 class id).

    `base_folder` is the extracted `cifar-10-batches-py`; `train` selects data_batch_1..5, else test_batch.
    Transforms see each image as H x W x C (32 x 32 x 3). `p` is kept for the course's signature (unused).
    """

    def __init__(self, base_folder, train, p=0.5, transforms=None):
        super().__init__(transforms)
        self.p = p
        names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
        xs, ys = [], []
        for name in names:
            path = os.path.join(base_folder, name)
            if not os.path.exists(path):
                raise missing_data_error(path, "cifar10", os.path.dirname(os.path.normpath(base_folder)))
            images, labels = _images_and_labels(path, load_cifar_batch(path))
            xs.append(images)
            ys.append(labels)
        self.X = np.concatenate(xs).astype(np.float32) / 255.0
        self.y = np.concatenate(ys)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        x, y = self.X[index], self.y[index]
        if self.transforms:
            images = x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # to H x W x C for the transforms
            x = np.stack([self.apply_transforms(img) for img in images]).transpose(0, 3, 1, 2).reshape(x.shape)
        return x, y
