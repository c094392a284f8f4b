"""Offloading: a saved value parked in host memory after its last forward use, and fetched back for backward.

A `HostStore` is a `Store` (needle/store.py): the seam through which a value that leaves the device goes somewhere
else than oblivion. A policy offloads a value by answering `OFFLOAD` (this file's host store) for it;
`regions.apply_decision` sets its `drop` flag and its store, so the forward pass gives its device buffer back as it
gives back a dropped value's — through `autograd.release`, which first `put`s a value with a store (here: a copy
to the host, "park"). The backward plan brings a stored value back instead of recomputing it (`Step.bring_back`,
a step before the step whose gradient reads it: `get` here, "fetch"), and it is released after its last use like
any other, its host copy with it (`discard`).

Host copies come from a pool of NumPy buffers reused by size (a step parks the same sizes every time: allocating
host memory per tensor is what makes offloading slow in practice), outside the device allocator, so
`memory_stats()` shows exactly the device bytes a GPU would hold; `host_bytes()` counts the host side. On cuda the
pool's buffers are page-locked and the copies are queued on the copy stream (`array_api.copy_to_host` /
`from_host_async`), the host waiting for none of them. On cpu() a copy thread plays the stream
(`array_api.copy_thread`, backend_ndarray/copy_thread.py): copies run on it in issue order, beside the compute, and
the time the computing thread spends waiting for them is what is exposed (`traffic()["copy_seconds_exposed"]`).

What a stream does for free, this file does by hand on cpu(), with two rules the ledger follows too:

1. A park's device buffer stays alive while its copy may run: until the next park or fetch, which first waits
   for it (`settle_park`). So one park is in flight at a time, and it overlaps the forward ops up to the next
   (`HostStore.holds_while_copying`, which the ledger reads).
2. A fetch's device buffer is made when the fetch is issued, and filled by the copy thread: backward issues it a
   step ahead and waits for it (`ready`) before the step that reads it. A fetch outside backward (a parked
   gradient read by the optimizer) waits at once.

The copies are exact: a fetched value is the very bytes the forward pass made, so gradients are bit-identical to
gc off's. Rule 4c still holds: a fetched value is a computed value, and reading it checks the versions as ever.

Parameters' gradients can be parked too (ZeRO-Offload's gradient offloading), for a Budget that cannot fit
otherwise: at the end of backward every parameter's gradient is alive at once, a floor no choice among the
activations moves. A leaf's `store` is where its complete gradient goes (backward.Compute.set_grad): the toolbox's
Budget sets `GRADIENTS` (a host store whose parks wait, so the device buffer goes at once) on each parameter.
Reading the gradient brings it back (`Value.realize_cached_data`); the optimizers read each gradient for its own
update only, and give its device copy back after (`optim.Optimizer`). Its host copy lives as long as the gradient
(until `reset_grad`). A parameter with a grad hook (DataParallel reducing gradients as they come) keeps its
gradient on the device: the hook needs it there.
"""
import math
import time
import weakref

from .. import memory_hook
from ..backend_ndarray import array_api
from ..backend_ndarray.copy_thread import covers_its_buffer
from ..backend_ndarray.ndarray import DTYPES
from ..autograd import infer_spec
from ..specs import element_shapes, spec_nbytes
from ..store import Store

__all__ = ["GRADIENTS", "OFFLOAD", "HostPool", "HostStore", "copies_in_flight", "host_bytes", "offload_all",
           "offloadable", "settle_park", "traffic"]

_park_in_flight = []  # on a copy thread: [(the park's copy_thread.Copy, the device array it reads)], at most one
_fetches_in_flight = []  # on a copy thread: the Copy of each fetch issued and not yet waited for (rule 2)
_traffic = {"offloaded_bytes": 0, "fetched_bytes": 0, "host_peak_bytes": 0, "copy_seconds_exposed": 0.0}


class HostPool:
    """Host buffers reused by size: `take(nbytes, device)` gives a uint8 array for copies to and from `device` (a
    free one of that size, else a new one from `array_api.host_empty`: page-locked for cuda), `give(array)`
    returns it. What the pool holds (in use or free) is its `held_bytes`."""

    def __init__(self):
        self.free, self.in_use_bytes, self.held_bytes = {}, 0, 0
        self.kinds = {}  # id(buffer) -> its free list's key: (nbytes, whether page-locked)

    def take(self, nbytes, device):
        key = (nbytes, array_api.copies_async(device))
        free = self.free.get(key)
        buffer = free.pop() if free else None
        if buffer is None:
            buffer = array_api.host_empty(nbytes, device)
            self.held_bytes += nbytes
        self.kinds[id(buffer)] = key
        self.in_use_bytes += nbytes
        return buffer

    def give(self, buffer):
        self.in_use_bytes -= buffer.nbytes
        self.free.setdefault(self.kinds.pop(id(buffer)), []).append(buffer)

    def clear(self):
        """Give the free buffers back to the OS."""
        self.held_bytes -= sum(b.nbytes for bs in self.free.values() for b in bs)
        self.free.clear()


POOL = HostPool()


def offloadable(node):
    """Whether offloading `node` would give device bytes back: an array with a buffer of its own, not a view (a
    view or a tuple costs nothing to recompute)."""
    if node.op is None or node.op.view:
        return False
    spec = infer_spec(node)
    return spec is not None and element_shapes(spec[0]) is None


class HostStore(Store):
    """Values parked in host memory, brought back for backward (the module doc). `wait`: a park waits for its copy,
    so the device buffer goes at once (a gradient's: the ledger frees it at once)."""

    kind = "offloaded"

    def __init__(self, wait=False):
        self.wait = wait

    def __repr__(self):
        return "checkpoint.OFFLOAD" if self is OFFLOAD else f"HostStore(wait={self.wait})"

    def accepts(self, node):
        return offloadable(node)

    def put(self, node):
        return park(node, self.wait)

    def get(self, node, stored):
        return fetch(stored, wait=False)

    def ready(self):
        wait_for_fetches()

    def discard(self, node, stored):
        stored[2].detach()
        _give_back(stored[0])

    def host_bytes(self, spec):
        return spec_nbytes(spec)

    def holds_while_copying(self, device):
        return not self.wait and array_api.copy_thread(device) is not None

    @classmethod
    def take_traffic(cls):
        taken = traffic()
        _traffic.update(offloaded_bytes=0, fetched_bytes=0, host_peak_bytes=0, copy_seconds_exposed=0.0)
        return taken


OFFLOAD = HostStore()  # what a policy answers for a value to offload (checkpoint.OFFLOAD)
GRADIENTS = HostStore(wait=True)  # where the toolbox's Budget sends parameters' gradients when nothing fits without


def offload_all(nodes, outputs=()):
    """Offload what "all" drops: every candidate goes to host memory and comes back for backward ("offload")."""
    return [OFFLOAD] * len(nodes)


def host_bytes():
    """Bytes of host memory holding parked values now."""
    return POOL.in_use_bytes


def traffic():
    """The copies since the stores' traffic was last taken (backward takes it): bytes offloaded and fetched, the
    most host bytes held at once, and the seconds spent copying that nothing else ran beside."""
    return dict(_traffic)


def park(node, wait=False):
    """Copy `node`'s value (an array) to a host buffer from the pool; the caller releases the device value. On a
    copy thread the copy is only issued (the device array held until the next park or fetch: rule 1), unless
    `wait`. Returns what holds it: (the host buffer, the value's (shape, dtype, device), the buffer's finalizer)."""
    data = node.cached_data
    start = time.perf_counter()
    shape, dtype = tuple(data.shape), DTYPES[data.dtype]
    buffer = POOL.take(math.prod(shape) * dtype.itemsize, data.device)
    thread = array_api.copy_thread(data.device)
    if thread is None or not covers_its_buffer(data):
        array_api.copy_to_host(data, buffer.view(dtype).reshape(shape))  # on cuda queued on the copy stream
    elif wait:
        thread.to_host(data, buffer).result()
    else:
        settle_park()
        _park_in_flight.append((thread.to_host(data, buffer), data))
    # A graph that dies before its backward (an exception, an eval step) still gives its host copies back.
    stored = (buffer, (shape, dtype, data.device), weakref.finalize(node, _give_back, buffer))
    if memory_hook.RECORDER is not None:
        memory_hook.RECORDER.parked(node, buffer.nbytes)  # needle.memory: the host copy, from now
    _traffic["copy_seconds_exposed"] += time.perf_counter() - start
    _traffic["offloaded_bytes"] += buffer.nbytes
    _traffic["host_peak_bytes"] = max(_traffic["host_peak_bytes"], POOL.in_use_bytes)
    return stored


def settle_park():
    """Wait for the park in flight on the copy thread, if any, and let go of its device array (rule 1)."""
    if _park_in_flight:
        copy, _ = _park_in_flight.pop()
        copy.result()


def copies_in_flight():
    """{"park_bytes": the device bytes the park in flight still holds (rule 1), "fetches": fetches issued and not
    yet waited for (rule 2)}: both 0 except on a copy thread, between a copy's issue and the wait for it."""
    return {"park_bytes": sum(data.size * data.buffer.itemsize for _, data in _park_in_flight),
            "fetches": len(_fetches_in_flight)}


def wait_for_fetches():
    """Wait for every fetch issued on the copy thread: their values may be read from now on (rule 2)."""
    if not _fetches_in_flight:
        return  # (backward asks at every step)
    start = time.perf_counter()
    for copy in _fetches_in_flight:
        copy.result()
    _fetches_in_flight.clear()
    _traffic["copy_seconds_exposed"] += time.perf_counter() - start


def _wait_for_copies():
    """Wait until no copy on the copy thread runs or is queued, so that a host buffer about to go back to the pool
    is free to reuse. Nothing is let go of: the device bytes stay as rules 1 and 2 (and the ledger) count them."""
    for copy in [c for c, _ in _park_in_flight] + _fetches_in_flight:
        copy.result()


def _give_back(buffer):
    _wait_for_copies()
    POOL.give(buffer)


def fetch(stored, wait=True):
    """A parked value back on its device (returned), its host copy still parked (released with the value after its
    last use). On a copy thread, with `wait` False (backward: its plan brings values back a step ahead), the copy
    is only issued: its value must not be read before `wait_for_fetches()`."""
    buffer, (shape, dtype, device), _ = stored
    start = time.perf_counter()
    thread = array_api.copy_thread(device)
    if thread is None:
        # On cuda the host never waits: this copy is queued on the copy stream behind the park that filled
        # `buffer`, and ready() makes the device's next kernels (not the host) wait for it.
        data, ready = array_api.from_host_async(buffer.view(dtype).reshape(shape), device)
        ready()
    else:
        settle_park()  # rule 1: a fetch lets go of the park in flight, as the ledger counts it
        data = array_api.empty(shape, dtype=array_api.dtype_name(dtype), device=device)
        _fetches_in_flight.append(thread.to_device(buffer, data))
    _traffic["copy_seconds_exposed"] += time.perf_counter() - start
    _traffic["fetched_bytes"] += buffer.nbytes
    if wait:
        wait_for_fetches()  # (which counts its own wait)
    return data
