"""A dataset over in-memory arrays that share their first axis."""
from ..data_basic import Dataset

__all__ = ["NDArrayDataset"]


class NDArrayDataset(Dataset):
    """Sample i is `tuple(a[i] for a in arrays)`; a slice or an index array gives batched tuples."""

    def __init__(self, *arrays):
        super().__init__()
        if not arrays:
            raise ValueError("NDArrayDataset needs at least one array")
        lengths = [len(a) for a in arrays]
        if len(set(lengths)) != 1:
            raise ValueError(f"NDArrayDataset: the arrays' first axes differ: {lengths}")
        self.arrays = arrays

    def __len__(self):
        return len(self.arrays[0])

    def __getitem__(self, index):
        return tuple(a[index] for a in self.arrays)
