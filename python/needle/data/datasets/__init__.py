"""Datasets on disk (MNIST, CIFAR-10, Penn Treebank) and in memory."""
from .cifar10_dataset import CIFAR10Dataset, RestrictedUnpickler, load_cifar_batch
from .mnist_dataset import MNISTDataset, parse_mnist
from .ndarray_dataset import NDArrayDataset
from .ptb_dataset import Corpus, Dictionary, batchify, get_batch

__all__ = [
    "CIFAR10Dataset",
    "Corpus",
    "Dictionary",
    "MNISTDataset",
    "NDArrayDataset",
    "RestrictedUnpickler",
    "batchify",
    "get_batch",
    "load_cifar_batch",
    "parse_mnist",
]
