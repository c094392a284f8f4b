"""Dataset and DataLoader: index a dataset sample by sample, group the samples into batches of Tensors."""
import numpy as np

from ..autograd import Tensor

__all__ = ["DataLoader", "Dataset", "missing_data_error"]


def missing_data_error(path, dataset, root):
    """The FileNotFoundError a loader raises for a missing data file: it names the path and the command to fetch it."""
    return FileNotFoundError(
        f"{path} not found; fetch it with: python -m needle.data.download {dataset} --dir {root or '.'}")


class Dataset:
    """A sized collection of samples; `dataset[i]` is a tuple of NumPy arrays (e.g. (x, y)).

    Subclasses implement `__getitem__` and `__len__`, and run each sample through `apply_transforms`.
    """

    def __init__(self, transforms=None):
        self.transforms = transforms

    def __getitem__(self, index):
        raise NotImplementedError

    def __len__(self):
        raise NotImplementedError

    def apply_transforms(self, x):
        """x after each transform in `self.transforms`, in order."""
        if self.transforms is not None:
            for transform in self.transforms:
                x = transform(x)
        return x


class DataLoader:
    """Iterate over a dataset in batches: each batch is a tuple of Tensors, one per field of a sample.

    Without shuffle the batches are consecutive index ranges (the short last batch is kept); with shuffle each
    `iter()` draws one `np.random.permutation(len(dataset))`. Samples are stacked along a new first axis, so a
    batch of samples shaped (784,) is (batch_size, 784).

        loader = DataLoader(NDArrayDataset(X, y), batch_size=32, shuffle=True)
        for X_batch, y_batch in loader: ...
    """

    def __init__(self, dataset, batch_size=1, shuffle=False, device=None):
        if batch_size < 1:
            raise ValueError(f"DataLoader: batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.device = device  # where the batch Tensors live (None: the default device)

    def __len__(self):
        return (len(self.dataset) + self.batch_size - 1) // self.batch_size

    def __iter__(self):
        # The permutation is drawn here, at iter(), as the course's loader does (the RNG order depends on it).
        n = len(self.dataset)
        order = np.random.permutation(n) if self.shuffle else np.arange(n)
        return self._batches(order)

    def _batches(self, order):
        for start in range(0, len(order), self.batch_size):
            samples = [self.dataset[int(i)] for i in order[start:start + self.batch_size]]
            samples = [s if isinstance(s, tuple) else (s,) for s in samples]
            yield tuple(Tensor(np.stack(field), device=self.device, requires_grad=False)
                        for field in zip(*samples))
