"""needle.memory: every byte of a step on a timeline.

    with ndl.memory.record() as snap:        # off by default; costs nothing when off
        loss = model.loss(x, y); loss.backward(); opt.step()
    snap.plot("step.png")                    # stacked live bytes by category, phases, the peak labelled
    snap.to_html("step.html")                # one self-contained page: zoom, hover an allocation, click an instant
    snap.save("step.json"); ndl.memory.load("step.json")
    print(ndl.memory.summary(snap))          # the peak's bytes per module x category

Each event is one buffer of the device allocator made or given back (`recorder.py` says how it is recorded and
how its category is decided; `snapshot.py` documents the JSON). The recorded live bytes equal the allocator's
`memory_stats()["current_bytes"]` after every event (`record(check=True)` stores the allocator's count beside
each event, which is how the tests check it).
"""
from ...backend_selection import default_device
from .recorder import CATEGORIES, PHASES, Recorder
from .snapshot import Snapshot, load
from .summary import Summary, summary

__all__ = ["CATEGORIES", "PHASES", "Snapshot", "Summary", "load", "record", "summary"]


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
