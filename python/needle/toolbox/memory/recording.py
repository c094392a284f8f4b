"""`ndl.memory.record()`: the context that turns the recorder on for a block and gives back its Snapshot."""
from ...backend_selection import default_device
from .recorder import Recorder
from .snapshot import Snapshot

__all__ = ["record"]


class record:
    """`with ndl.memory.record(device=None, check=False) as snap:` records every allocation and free of
    `device`'s allocator (default: the default device) inside the block; `snap` is complete when it ends.
    `check=True` also stores the allocator's own count after each event (`backend_bytes`) and resets its peak
    when recording begins, to store it when it ends. Recording begins with a garbage collection."""

    def __init__(self, device=None, check=False):
        device = device or default_device()
        if not hasattr(device, "memory_stats"):
            raise ValueError(f"ndl.memory.record: device {device} has no allocator statistics to record")
        self.recorder = Recorder(device, check)
        self.snapshot = Snapshot(None)

    def __enter__(self):
        self.recorder.begin()
        return self.snapshot

    def __exit__(self, *exc):
        self.recorder.end()
        self.snapshot.data = Snapshot.from_recorder(self.recorder).data
        return False
