"""A copy thread: host copies that run beside the C++ CPU backend's compute, as a CUDA copy stream's run beside
kernels (src/cpu/copy_thread.h).

On cpu() a "device" buffer and a host buffer are both main memory, so a copy between them is a memcpy. Done by the
thread that computes, nothing runs beside it. Done by the backend's copy thread, it runs on the other core while
the computing thread goes on with the next ops (most of a step's time is Python and one-thread kernels, so a core
is often free). The worker is C++ and never takes Python's GIL: a Python thread would need the GIL to start each
copy, and would wait for it up to the interpreter's switch interval (5 ms) behind a busy computing thread.

One thread, one queue: copies run in the order they were issued, like a CUDA stream's, so a host buffer written
by one copy and read by a later one needs no extra wait. What a CUDA stream gives for free the caller does by
hand here: the device buffer a copy reads or writes must stay untouched until the copy is done, and the caller
keeps it until it has waited for the copy, so it is the computing thread that decides when it is freed
(offload.py's rules 1 and 2) and the allocator's counts stay deterministic, which is what lets the ledger predict
them (ledger.Ledger, `holds_parked_copies`). A copy also holds both of its arrays itself (src/cpu/copy_thread.h)
until a wait sees it done: an array dropped too early is freed late, never read or written after it is freed.
"""
import numpy as np

__all__ = ["Copy", "CopyThread", "covers_its_buffer"]


class Copy:
    """A queued copy: `result()` waits until it (and every copy issued before it) is done, and returns None.
    Until then the backend holds both of its arrays alive."""

    def __init__(self, mod, ticket):
        self.mod, self.ticket, self.finished = mod, ticket, False

    def result(self):
        if not self.finished:
            self.mod.copy_thread_wait(self.ticket)
            self.finished = True
        return None


def covers_its_buffer(a):
    """Whether the NDArray `a` is compact and is its whole buffer: what the copy thread copies."""
    return a.is_compact() and not a.offset and a.size == a.buffer.size


def _whole_buffer(a, op):
    if not covers_its_buffer(a):
        raise ValueError(f"CopyThread.{op}: needs a compact array covering its whole buffer, got shape {a.shape} "
                         f"strides {a.strides} offset {a.offset} on a buffer of {a.buffer.size} elements")
    return a.buffer


class CopyThread:
    """The copy thread of `mod` (a backend module with `copy_thread_to_host`): `to_host(a, out)` and
    `to_device(host, out)` queue a copy and return a `Copy` at once. The caller leaves the NDArray untouched, and
    keeps it (so that it is freed when the caller says), until that copy's `result()` has returned."""

    def __init__(self, mod):
        self.mod = mod

    def to_host(self, a, out):
        """Queue a copy of `a` (a compact NDArray, its whole buffer) into `out`, a C-contiguous host array of its
        bytes."""
        return Copy(self.mod, self.mod.copy_thread_to_host(_whole_buffer(a, "to_host"), out))

    def to_device(self, host, out):
        """Queue a copy of `host` (a host array of out's bytes) into `out`, a compact NDArray (its whole buffer)."""
        host = np.ascontiguousarray(host)
        return Copy(self.mod, self.mod.copy_thread_to_device(host, _whole_buffer(out, "to_device")))
