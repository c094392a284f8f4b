"""needle.data: datasets, the DataLoader that batches them, and image transforms.

`python -m needle.data.download ptb|mnist|cifar10 --dir data` fetches the data sets (see needle.data.download,
which is not imported here so that running it as a module stays clean).
"""
from .data_basic import DataLoader, Dataset, missing_data_error
from .data_transforms import RandomCrop, RandomFlipHorizontal, Transform
from .datasets import (
    CIFAR10Dataset,
    Corpus,
    Dictionary,
    MNISTDataset,
    NDArrayDataset,
    RestrictedUnpickler,
    batchify,
    get_batch,
    load_cifar_batch,
    parse_mnist,
)

__all__ = [
    "CIFAR10Dataset",
    "Corpus",
    "DataLoader",
    "Dataset",
    "Dictionary",
    "MNISTDataset",
    "NDArrayDataset",
    "RandomCrop",
    "RandomFlipHorizontal",
    "RestrictedUnpickler",
    "Transform",
    "batchify",
    "get_batch",
    "load_cifar_batch",
    "missing_data_error",
    "parse_mnist",
]
