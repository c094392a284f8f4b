"""CIFAR-10 from the Python pickles of the official archive (cifar-10-batches-py)."""
import os
import pickle

import numpy as np

from ..data_basic import Dataset, missing_data_error

__all__ = ["CIFAR10Dataset", "RestrictedUnpickler", "load_cifar_batch"]


def _numpy_reconstruct():
    try:  # NumPy >= 2 moved numpy.core to numpy._core (importing the old name warns)
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # pragma: no cover - NumPy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that builds only what the official CIFAR-10 batches contain: dicts, lists, bytes, ints and
    NumPy arrays. Any other global (a function or class a crafted pickle could call) raises UnpicklingError.
    """

    # (module, name) -> the object; the batches were written by Python 2 with NumPy 1.x (numpy.core.*).
    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _numpy_reconstruct,
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
        return RestrictedUnpickler(f, encoding="bytes").load()


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
            batch = load_cifar_batch(path)
            xs.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            ys.append(np.asarray(batch[b"labels"], dtype=np.int64))
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
