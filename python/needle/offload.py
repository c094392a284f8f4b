"""Offloading: a saved value parked in host memory after its last forward use, and fetched back for backward.

A third state for a value backward will read, beside kept and dropped (recomputed). A policy offloads a value by
returning `checkpoint.OFFLOAD` for it; `checkpoint.annotate` then marks it (`mark`) and sets its `drop` flag, so
the forward pass gives its device buffer back as it gives back a dropped value's — through `release_value`, which
first copies a marked value to the host (`park`). The backward plan (backward.plan_backward) fetches a parked value
instead of recomputing it: the fetch is issued a step before the step whose gradient reads it (`Step.fetch`), and
the value is released after its last use like any other, its host copy with it (`release_value` again).

Host copies come from a pool of NumPy buffers reused by size (a step parks the same sizes every time: allocating
host memory per tensor is what makes offloading slow in practice), outside the device allocator, so
`memory_stats()` shows exactly the device bytes a GPU would hold; `host_bytes()` counts the host side. On cuda the
pool's buffers are page-locked and the copies are queued on the copy stream (`array_api.copy_to_host` /
`from_host_async`), the host waiting for none of them. On cpu() a copy thread plays the stream
(`array_api.copy_thread`, backend_ndarray/copy_thread.py): copies run on it in issue order, beside the compute, and
the time the computing thread spends waiting for them is what is exposed (`traffic()["copy_seconds_exposed"]`).

What a stream does for free, this file does by hand on cpu(), with two rules the ledger follows too:

1. A park's device buffer stays alive while its copy may run: until the next park or fetch, which first waits
   for it (`settle_park`). So one park is in flight at a time, and it overlaps the forward ops up to the next.
2. A fetch's device buffer is made when the fetch is issued, and filled by the copy thread: backward issues it a
   step ahead and waits for it (`wait_for_fetches`) before the step that reads it. A fetch outside backward (a
   parked gradient read by the optimizer) waits at once.

The copies are exact: a fetched value is the very bytes the forward pass made, so gradients are bit-identical to
gc off's. Rule 4c still holds: a fetched value is a computed value, and reading it checks the versions as ever.

A value can also be parked compressed on the device instead (compress.py: `mark(node, codec)`): the same
park-on-release and fetch-in-backward, but `codec.encode` keeps k-bit codes of the value in device buffers and
`codec.decode` rebuilds it; `is_compressed` tells which. Those bytes are the device's (the allocator counts them),
not the host's, and the fetched value is an approximation, not the forward's bytes.

Parameters' gradients can be parked too (ZeRO-Offload's gradient offloading), for a Budget that cannot fit
otherwise: at the end of backward every parameter's gradient is alive at once, a floor no choice among the
activations moves. A marked parameter's gradient (`mark_gradient`) is parked as soon as backward has finished it
(backward.Compute.set_grad) and its device buffer given back. Reading it brings it back (`Value.realize_cached_data`
fetches a parked value); the optimizers fetch each gradient for its own update only, and give it back after
(`optim.Optimizer`). Its host copy lives as long as the gradient (until `reset_grad`). A parameter with a grad hook
(DataParallel reducing gradients as they come) is never parked: the hook needs its gradient on the device.
"""
import math
import time
import weakref


from . import memory_hook
from .autograd import element_shapes, infer_spec, release
from .backend_ndarray import array_api
from .backend_ndarray.copy_thread import covers_its_buffer
from .backend_ndarray.ndarray import DTYPES

__all__ = ["OFFLOAD", "HostPool", "codec_of", "fetch", "host_bytes", "is_compressed", "is_marked", "is_parked",
           "mark", "mark_gradient", "parked_copy", "unmark", "any_compressed", "settle_park", "wait_for_fetches",
           "copies_in_flight",
           "offloadable", "park", "park_gradient", "parked_bytes", "parks_gradient", "release_value", "reset_traffic",
           "traffic", "unmark_gradients"]

OFFLOAD = "offload"  # what a policy answers for a value to offload (checkpoint.OFFLOAD)

_marked = weakref.WeakKeyDictionary()  # values to park when the forward pass gives them back -> codec (None: host)
_gradient_marked = weakref.WeakSet()  # parameters whose gradients backward parks as soon as they are complete
_parked = weakref.WeakKeyDictionary()  # value -> (its host copy, its (shape, dtype, device), the copy's finalizer)
_park_in_flight = []  # on a copy thread: [(the park's copy_thread.Copy, the device array it reads)], at most one
_fetches_in_flight = []  # on a copy thread: the Copy of each fetch issued and not yet waited for (rule 2)
_traffic = {"offloaded_bytes": 0, "fetched_bytes": 0, "host_peak_bytes": 0, "copy_seconds_exposed": 0.0,
            "compressed_bytes": 0, "decompressed_bytes": 0}


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


def mark(node, codec=None):
    """Offload `node`: park it in host memory when the forward pass gives its device buffer back (with a `codec`,
    compress.py's: keep it compressed on the device instead)."""
    _marked[node] = codec


def unmark(node):
    """`node` is no longer to be parked (its host copy or codes, if any, given back): a dropped value, recomputed."""
    _marked.pop(node, None)
    parked = _parked.pop(node, None)
    if parked is not None and parked[2] is not None:  # a host copy: back to the pool, once no copy uses it
        parked[2].detach()
        _give_back(parked[0])


def any_compressed():
    """Whether any value is marked to be kept compressed (compress.py)."""
    return any(codec is not None for codec in _marked.values())


def codec_of(node):
    """The codec a marked value is parked with (None: host memory, or not marked)."""
    return _marked.get(node)


def is_compressed(node):
    """Whether `node` is marked to be kept compressed on the device (compress.py) rather than in host memory."""
    return _marked.get(node) is not None


def is_marked(node):
    return node in _marked


def mark_gradient(param):
    """Park `param`'s gradient in host memory as soon as backward has finished it (until `unmark_gradients`)."""
    _gradient_marked.add(param)


def unmark_gradients(params):
    for p in params:
        _gradient_marked.discard(p)


def parks_gradient(param):
    """Whether backward parks `param`'s gradient: it is marked, and no grad hook waits for it on the device."""
    return param in _gradient_marked and not param._grad_hooks


def park_gradient(param):
    """Park `param.grad` (a complete gradient) in host memory and give its device buffer back."""
    grad = param.grad
    if grad.cached_data is None or isinstance(grad.cached_data, tuple) or grad in _parked:
        return
    park(grad, wait=True)  # done before its buffer goes: the ledger frees a parked gradient's bytes at once
    release(grad)


def is_parked(node):
    return node in _parked


def parked_bytes(node):
    """Bytes holding `node`'s parked value: host memory, or its compressed copy on the device (0 if not parked)."""
    parked = _parked.get(node)
    if parked is None:
        return 0
    codec = _marked.get(node)
    return parked[0].nbytes if codec is None else codec.nbytes(parked[0])


def parked_copy(node):
    """What holds `node`'s parked value: its host buffer, or its codec's stored codes (None if not parked)."""
    parked = _parked.get(node)
    return None if parked is None else parked[0]


def host_bytes():
    """Bytes of host memory holding parked values now."""
    return POOL.in_use_bytes


def traffic():
    """The copies since the last `reset_traffic()`: bytes offloaded and fetched, the most host bytes held at once,
    and the seconds spent copying that nothing else ran beside (on cpu(): all of them)."""
    return dict(_traffic)


def reset_traffic():
    _traffic.update(offloaded_bytes=0, fetched_bytes=0, host_peak_bytes=0, copy_seconds_exposed=0.0,
                    compressed_bytes=0, decompressed_bytes=0)


def park(node, wait=False):
    """Copy `node`'s value (an array) to a host buffer from the pool, or compress it on the device where it was
    marked with a codec; the caller releases the device value. On a copy thread the copy is only issued (the
    device array held until the next park or fetch: rule 1), unless `wait`."""
    data = node.cached_data
    codec = _marked.get(node)
    if codec is not None:
        _parked[node] = (codec.encode(data), None, None)  # device buffers: the allocator counts them
        _traffic["compressed_bytes"] += parked_bytes(node)
        return
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
    _parked[node] = (buffer, (shape, dtype, data.device), weakref.finalize(node, _give_back, buffer))
    if memory_hook.RECORDER is not None:
        memory_hook.RECORDER.parked(node)  # needle.memory: the host copy, from now
    _traffic["copy_seconds_exposed"] += time.perf_counter() - start
    _traffic["offloaded_bytes"] += buffer.nbytes
    _traffic["host_peak_bytes"] = max(_traffic["host_peak_bytes"], POOL.in_use_bytes)


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


def fetch(node, wait=True):
    """Bring a parked value back to its device: `node.cached_data` again (returned), its host copy still parked
    (released with the value after its last use). On a copy thread, with `wait` False (backward: its plan issues
    fetches a step ahead), the copy is only issued: its value must not be read before `wait_for_fetches()`."""
    codec = _marked.get(node)
    if codec is not None:  # compressed on the device: rebuilt, an approximation of the forward's value
        node.cached_data = data = codec.decode(_parked[node][0])
        _traffic["decompressed_bytes"] += parked_bytes(node)
        return data
    buffer, (shape, dtype, device), _ = _parked[node]
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
    node.cached_data = data
    _traffic["copy_seconds_exposed"] += time.perf_counter() - start
    _traffic["fetched_bytes"] += buffer.nbytes
    if wait:
        wait_for_fetches()  # (which counts its own wait)
    return data


def release_value(node, last_use=False):
    """Give `node`'s device value back (autograd.release). A marked value is parked first (the forward pass's
    release); a parked value keeps its host copy until `last_use` (backward's release after its last use, or of a
    value no gradient reads), and a second release before that changes nothing."""
    if node in _parked:
        if last_use:
            buffer, _, finalizer = _parked.pop(node)
            if finalizer is not None:  # (a compressed copy is device memory: it goes with its last reference)
                finalizer.detach()
                _give_back(buffer)
    elif node in _marked and node.cached_data is not None and (not isinstance(node.cached_data, tuple)
                                                               or _marked[node] is not None):
        park(node)  # (a tuple only compressed, element by element)
    release(node)
