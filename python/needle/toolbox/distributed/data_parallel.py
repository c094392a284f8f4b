"""Data parallelism: every rank holds the whole model and trains on its own share of each batch; gradients are
averaged across ranks during backward, so every rank takes the same optimizer step.

    model = dist.DataParallel(model)                 # rank 0's parameters are copied to every rank
    X, y = dist.split_batch(X), dist.split_batch(y)  # this rank's share of the global batch B (B/N rows)
    loss = loss_fn(model(X), y)                      # a mean over this rank's rows
    loss.backward()                                  # .grad: the mean over all ranks, as one process with batch B
    opt.step()                                       # any optimizer; every rank's parameters stay identical

Gradients are averaged in buckets of about `bucket_mb` MB (PyTorch DDP's default, 25 MB): parameters in reverse
order of definition, roughly the order in which backward finishes them. When backward has set the last gradient
of a bucket (a grad hook: `Tensor.register_grad_hook`), the bucket's gradients are copied into one flat float32
buffer and its all-reduce starts, non-blocking (MPI_Iallreduce), while backward goes on with the layers below;
each later gradient lets MPI progress and finishes the buckets already reduced. Buckets start in index order on
every rank (MPI requires collectives in the same order everywhere), so a bucket ready early waits for the ones
before it. When the last bucket has started, backward waits for all of them: `loss.backward()` returns with every
`.grad` averaged. `last_sync_stats()` says how many buckets, how many bytes, and how long backward waited.

Reduction order (why N ranks x B/N equal one process x B to rounding, and every rank holds the same bits): each
rank's gradient is the gradient of the mean loss over its own B/N rows, summed by backward in its usual order;
the ranks' gradients are then summed by MPI_Allreduce in float32 (MPICH's order: for two ranks a + b, which is
b + a in IEEE arithmetic, so both ranks get the same sum) and multiplied by 1/N (exact for N a power of two).
One process sums the same B products in one pass, so the two differ only in where float sums are rounded.

`no_sync()`: gradient accumulation. needle's backward replaces `.grad` (it does not add), so DataParallel keeps
the running sum itself: backward passes inside `with model.no_sync():` only add their gradients to the buckets
(no communication; `.grad` is that pass's local gradient), and the next backward outside it adds its own and
averages the sum across ranks: one synchronization per k micro-batches. Scale each micro-batch's loss by 1/k
for the mean.

Checks (comm, notices): every bucket's reduction is announced to the other ranks (its size, and the number of
backward passes since the forward, which must agree: an extra backward on one rank is a CollectiveMismatch on
every rank instead of pairing with the other rank's next step). The notices of all buckets go out at a
synchronizing pass's first gradient, so the other ranks' are in when a bucket is ready and its reduction starts
at once. A rank that leaves early, or runs one step fewer without join(), is named by the others' error.

`join()`: uneven inputs, as PyTorch's Join.

    with model.join():
        for X, y in my_batches:                      # ranks may have different numbers of batches
            opt.reset_grad(); loss_fn(model(X), y).backward(); opt.step()

A rank whose loop ends first shadows the others' collectives (a bucket all-reduce: zeros; a barrier) until every
rank's loop has ended. The averaged gradient is the mean over the ranks still training (a "mean" all-reduce
divides by the ranks that contributed: PyTorch's `divide_by_initial_world_size=False`; its default would divide
by all ranks, so the steps after a rank joined take a smaller step). When all have joined, every rank takes the
parameters and buffers of the rank that joined last (the one that trained longest), so all leave identical; the
optimizer state of a rank that joined early missed those steps, as in PyTorch. Only all_reduce and barrier can
be shadowed: ZeRO (its all-gather of updated shards) cannot be joined.

Parameters that a forward pass does not use get a zero gradient from this rank (found by walking the graph of the
outputs of `model(...)` or of any method called through the wrapper, e.g. `model.loss(x, y)`), so no bucket
waits for them. A backward through a graph that was not built through the wrapper must use every parameter.
`model.unwrap()` removes the hooks and returns the model.
"""
import contextlib
import time
import weakref
import zlib

import numpy as np

from ...autograd import Tensor, find_topo_sort
from ...backend_selection import array_api
from ...data import batchify as _batchify
from ...nn import Module
from . import comm

__all__ = ["DataParallel", "batchify", "split_batch"]

PASS_FORMAT = "backward pass {} since its forward"  # what a bucket's tag is, in error messages
# parameter -> the DataParallel that reduces its gradient (ZeroRedundancyOptimizer looks it up)
_WRAPPER = weakref.WeakKeyDictionary()


def wrapper_of(param):
    """The DataParallel whose model holds `param`, or None."""
    ref = _WRAPPER.get(param)
    return None if ref is None else ref()


def check_same_model(what, named_tensors, group=None, values=False):
    """Raise ValueError on every rank unless every rank has the same names, shapes and dtypes, in the same order
    (with `values`: the same numbers too, by a checksum of each tensor's bytes).

    One all-gather of the lists: every rank compares the same lists and so raises the same error (no rank is
    left waiting in a collective that the others never reach)."""
    mine = [(name, tuple(int(s) for s in t.shape), str(t.dtype)) + ((zlib.crc32(_host(t).tobytes()),) if values
                                                                      else ()) for name, t in named_tensors]
    everyone = comm.all_gather_object(mine, label=f"{what}'s model check", group=group)
    for r, theirs in enumerate(everyone[1:], 1):
        if theirs == everyone[0]:
            continue
        if len(theirs) != len(everyone[0]):
            raise ValueError(f"{what}: rank 0 has {len(everyone[0])} parameters, rank {r} has {len(theirs)}: every "
                             f"rank must build the same model")
        i, (a, b) = next((i, ab) for i, ab in enumerate(zip(everyone[0], theirs)) if ab[0] != ab[1])
        if a[:3] == b[:3]:
            raise ValueError(f"{what}: parameter {i} ({a[0]!r}) holds other values on rank {r} than on rank 0: "
                             f"every rank must build the same model, with the same seed")
        raise ValueError(f"{what}: parameter {i} is {a[0]!r} of shape {a[1]} ({a[2]}) on rank 0 but {b[0]!r} of "
                         f"shape {b[1]} ({b[2]}) on rank {r}: every rank must build the same model")


def _host(t):
    return np.ascontiguousarray(array_api.to_numpy(t.realize_cached_data()))


def _set_value(t, values):
    """Replace a leaf's value by `values` (NumPy), keeping its dtype and device; an in-place write."""
    t.cached_data = array_api.array(values.reshape(t.shape), dtype=str(t.dtype), device=t.device)


class DataParallel(Module):
    """Wrap `module` for data-parallel training; see the module docstring.

    Wrapping checks that every rank built the same parameters (names, shapes, dtypes: one all-gather; a mismatch
    is a ValueError on every rank), then copies rank 0's parameters and buffers to every rank.

    group: the ranks that share the data (a Group of new_group; None: the whole job). In a 2-D layout (tensor x
    data parallel) each data-parallel group holds the same slice of a tensor-parallel model: its members average
    their gradients among themselves, and "rank 0" above is the group's first member.
    """

    def __init__(self, module, bucket_mb=25, group=None):
        super().__init__()
        if not bucket_mb > 0:
            raise ValueError(f"DataParallel: bucket_mb must be positive, got {bucket_mb!r}")
        comm.init()
        self.module = module
        self.bucket_mb = bucket_mb
        self.group = group
        named = module.named_parameters()
        check_same_model("DataParallel", named + module.named_buffers(), group)
        self._broadcast_state(root=0)
        params = [p for _, p in named if p.requires_grad]
        self._reducer = _Reducer(params, int(bucket_mb * 2**20), group)
        self._sharded, self._root_unit = False, None  # ZeRO-3 (shard_parameters)
        self._unhook = [p.register_grad_hook(self._reducer.on_grad) for p in params]
        for p in params:
            _WRAPPER[p] = weakref.ref(self)

    def _broadcast_state(self, root):
        """Rank `root`'s parameters and buffers copied to every rank (one broadcast of them all, in float32)."""
        everything = [t for _, t in self.module.named_parameters() + self.module.named_buffers()]
        if comm.world_size(self.group) == 1 or not everything:
            return
        flat = np.concatenate([_host(t).astype(np.float32).reshape(-1) for t in everything])
        comm.broadcast_buffer(flat, root, label=f"DataParallel's parameter broadcast from rank {root}",
                              group=self.group)
        offset = 0
        for t in everything:
            size = int(np.prod(t.shape))
            _set_value(t, flat[offset:offset + size])
            offset += size

    @property
    def reducer(self):
        """The gradient reducer behind the grad hooks (ZeroRedundancyOptimizer switches it to reduce-scatter and
        takes its gradient shard)."""
        return self._reducer

    def unwrap(self):
        """The wrapped model, its parameters' grad hooks removed: backward is plain needle's again."""
        self._remove_hooks()
        for p in self._reducer.params:
            _WRAPPER.pop(p, None)
        return self.module

    def forward(self, *args, **kwargs):
        return self._through(self.module, args, kwargs)

    def __getattr__(self, name):
        # Attributes not found on the wrapper come from the wrapped module; its methods (model.loss(x, y)) run
        # through the wrapper, like forward, so that unused parameters are found.
        module = self.__dict__.get("module")
        if module is None:
            raise AttributeError(name)
        attr = getattr(module, name)
        if callable(attr) and not isinstance(attr, (Module, Tensor)):
            return lambda *args, **kwargs: self._through(attr, args, kwargs)
        return attr

    def shard_parameters(self, root):
        """ZeRO-3 (ZeroRedundancyOptimizer(stage=3)): the gradients are reduce-scattered by the gather ops'
        gradients, so the grad hooks come off; `root` (a fully_sharded.ShardedUnit, or None) is gathered around
        every call through the wrapper."""
        self._remove_hooks()
        self._sharded, self._root_unit = True, root

    def _remove_hooks(self):
        for remove in self._unhook:
            remove()
        self._unhook = []

    def _through(self, fn, args, kwargs):
        if self._sharded:  # ZeRO-3: no hooks, so no unused parameters to find
            if self._root_unit is None:
                return fn(*args, **kwargs)
            with self._root_unit.in_use():
                return fn(*args, **kwargs)
        out = fn(*args, **kwargs)
        self._reducer.expect(_tensors_in(out))
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes in this block add their gradients to the local sum and do not communicate."""
        previous, self._reducer.sync = self._reducer.sync, False
        try:
            yield
        finally:
            self._reducer.sync = previous

    @contextlib.contextmanager
    def join(self):
        """Uneven inputs: `with model.join(): for batch in my_batches: ...`. A rank whose loop ends first shadows
        the others' collectives (its buckets contribute zeros) until every rank's loop has ended; then every rank
        takes the parameters of the rank that trained longest. See the module docstring."""
        if self._reducer.partition is not None:
            raise ValueError("DataParallel.join(): not with ZeroRedundancyOptimizer(stage=2) (a rank out of data "
                             "cannot update its shard of the parameters)")
        yield self
        self._broadcast_state(root=comm.shadow_until_all_joined(self.group))

    def last_sync_stats(self):
        """The last synchronizing backward: buckets, bytes reduced per rank, buckets started before backward's
        last gradient, seconds backward waited for communication at its end (`wait_seconds`) and spent copying
        gradients into and out of the buckets (`copy_seconds`), peak bytes of the bucket buffers."""
        return dict(self._reducer.stats)

    def buckets(self):
        """The buckets: for each, the names of its parameters (in the order their all-reduces start)."""
        return [[p.name for p in b.params] for b in self._reducer.buckets]


def _tensors_in(value):
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    return []


class _Bucket:
    """Parameters whose gradients are reduced together, and the flat float32 buffer they are copied into.

    `pieces`: (parameter index, first element, end element, owner rank, offset in the owner's shard), in buffer
    order. For an all-reduce each parameter is one piece (no owner); for ZeRO-2's reduce-scatter a parameter may be
    cut where two ranks' shards meet, and the pieces are sorted by owner, so each rank's part is contiguous."""

    def __init__(self, indices, params):
        self.indices = indices
        self.params = [params[i] for i in indices]
        self.layout(None)
        self.buffer = None  # allocated by the pass's first gradient, dropped when the reduction is done
        self.accumulated = False  # the buffer holds the sum of no_sync passes
        self.ready = self.expected = 0
        self.ticket = None  # the reduction's arrival notice, sent at the pass's first gradient (comm.announce)
        self.pending = None

    def layout(self, partition):
        if partition is None:
            pieces = [(i, 0, int(np.prod(p.shape)), None, None) for i, p in sorted(zip(self.indices, self.params))]
        else:
            pieces = sorted((piece for i in self.indices for piece in partition[i]), key=lambda x: (x[3], x[4]))
        self.pieces, self.offsets, offset = pieces, [], 0
        self.where = {i: [] for i in self.indices}  # parameter index -> its (lo, hi, offset in the buffer)
        for i, lo, hi, _, _ in pieces:
            self.offsets.append(offset)
            self.where[i].append((lo, hi, offset))
            offset += hi - lo
        self.size = offset

    def counts(self, world_size):
        """Elements of this bucket each rank receives in a reduce-scatter."""
        counts = [0] * world_size
        for _, lo, hi, owner, _ in self.pieces:
            counts[owner] += hi - lo
        return counts


class _Reducer:
    """Runs DataParallel's grad hooks: copies gradients into buckets, starts and finishes their reductions."""

    def __init__(self, params, bucket_bytes, group=None):
        self.params = params
        self.group = group
        self.index = {id(p): i for i, p in enumerate(params)}
        self.sync = True
        self.partition = None  # ZeRO-2: parameter index -> its pieces; None: all-reduce whole gradients
        self.shard, self.shard_size = None, 0  # ZeRO-2: this rank's averaged gradient shard (NumPy)
        self.buckets, current, size = [], [], 0
        for i in reversed(range(len(params))):  # the last parameters' gradients are ready first
            nbytes = 4 * int(np.prod(params[i].shape))
            if current and size + nbytes > bucket_bytes:
                self.buckets.append(_Bucket(current, params))
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            self.buckets.append(_Bucket(current, params))
        self.bucket_of = {i: b for b in self.buckets for i in b.indices}
        self.unused = set()
        self.passes_since_forward = 0  # the ranks' buckets must agree on it: an extra backward on one rank is an error
        self.stats = {}
        self.buffer_bytes = 0
        self._copy_seconds = 0.0
        self._reset()

    def reduce_scatter_to(self, partition, shard_size):
        """ZeRO-2: reduce-scatter the gradients; this rank keeps its pieces of `partition`, a shard of shard_size."""
        if any(b.accumulated or b.ready for b in self.buckets):
            raise RuntimeError("ZeroRedundancyOptimizer(stage=2): create it before the first backward or between "
                               "steps, not while gradients are being accumulated")
        self.partition, self.shard_size = partition, shard_size
        for b in self.buckets:
            b.layout(partition)

    def expect(self, outputs):
        """Before a backward through `outputs`: the parameters it will not reach get a zero gradient."""
        used = {id(n) for n in find_topo_sort(outputs) if n.is_leaf()}
        self.unused = {i for i, p in enumerate(self.params) if id(p) not in used}
        self.passes_since_forward = 0
        self._reset()

    def _reset(self):
        """Ready for the next backward pass (the buffers and their sums stay)."""
        self.seen = set()
        self.next_launch = 0
        for b in self.buckets:
            b.ready = 0
            b.expected = sum(i not in self.unused for i in b.indices)

    # ----- the hook -----------------------------------------------------------------------------------------------
    def on_grad(self, p):
        i = self.index[id(p)]
        if i in self.seen:
            missing = [q.name or f"parameter {j}" for j, q in enumerate(self.params) if j not in self.seen]
            raise RuntimeError(f"DataParallel: a backward pass set the gradient of {p.name or 'a parameter'} again "
                               f"before an earlier pass had set {', '.join(missing[:4])}: call the model (or its "
                               f"methods) through the DataParallel wrapper, so that unused parameters are found")
        if not self.seen:
            self._first_gradient()
        self._add(i, p.grad)
        if self.partition is not None:
            p.grad = None  # ZeRO-2: a rank keeps only its shard of the averaged gradient
        if not self.sync:
            if len(self.seen) == len(self.params):  # the end of an accumulation pass
                for b in self.buckets:
                    b.accumulated = b.buffer is not None
                self._reset()
            return
        self.stats["last_gradient"] = time.perf_counter()
        self._launch_ready()
        for b in self.buckets[:self.next_launch]:  # lets MPI progress; frees the buffers of finished buckets
            if b.pending is not None and b.pending.done():
                self._finish(b)
        if self.next_launch == len(self.buckets):  # every reduction has started: wait for them
            t0, copied = time.perf_counter(), self._copy_seconds
            for b in self.buckets:
                if b.pending is not None:
                    self._finish(b)
            self.stats["wait_seconds"] = time.perf_counter() - t0 - (self._copy_seconds - copied)
            self.stats["copy_seconds"] = self._copy_seconds
            self.stats["gradient_seconds"] = self.stats.pop("last_gradient") - self.stats.pop("first_gradient")
            self._reset()

    def _first_gradient(self):
        self.passes_since_forward += 1
        if self.sync:
            self._announce()
            self.stats = {"buckets": len(self.buckets), "bytes": 0, "started_before_last_gradient": 0,
                          "wait_seconds": 0.0, "buffer_peak_bytes": self.buffer_bytes,
                          "first_gradient": time.perf_counter()}
            self._copy_seconds = 0.0
        for j in sorted(self.unused):  # parameters the forward did not use: this rank adds zeros
            self._add(j, None)

    def _add(self, i, grad):
        """Copy (after no_sync passes: add) parameter i's gradient into its bucket; None adds nothing."""
        self.seen.add(i)
        b = self.bucket_of[i]
        if b.buffer is None:
            b.buffer = np.zeros(b.size, np.float32)
            self.buffer_bytes += b.buffer.nbytes
            if self.stats:
                self.stats["buffer_peak_bytes"] = max(self.stats["buffer_peak_bytes"], self.buffer_bytes)
        if grad is not None:
            t0 = time.perf_counter()
            values = _host(grad).astype(np.float32, copy=False).reshape(-1)
            for lo, hi, offset in b.where[i]:
                target = b.buffer[offset:offset + hi - lo]
                if b.accumulated:
                    target += values[lo:hi]
                else:
                    target[...] = values[lo:hi]
            self._copy_seconds += time.perf_counter() - t0
        if i not in self.unused:
            b.ready += 1

    def _announce(self):
        """Send the notices of every bucket's reduction now, so that the other ranks' are in when a bucket is ready
        and its reduction starts at once (the checks cost no wait)."""
        n = comm.world_size(self.group)
        for k, b in enumerate(self.buckets):
            label = f"DataParallel bucket {k + 1} of {len(self.buckets)}"
            if self.partition is None:
                b.ticket = comm.announce("all_reduce", b.size, "float32", "mean", label=label,
                                         tag=self.passes_since_forward, tag_format=PASS_FORMAT, group=self.group)
            else:
                b.ticket = comm.announce("reduce_scatter", b.size, "float32", "mean", counts=b.counts(n), label=label,
                                         tag=self.passes_since_forward, tag_format=PASS_FORMAT, group=self.group)

    def _launch_ready(self):
        """Start the reductions of complete buckets, in bucket order (the same order on every rank)."""
        while self.next_launch < len(self.buckets):
            b = self.buckets[self.next_launch]
            if b.ready < b.expected:
                return
            tag = self.passes_since_forward
            if self.partition is None:
                b.pending = comm.all_reduce_buffer(b.buffer, "mean", async_op=True, tag=tag, announced=b.ticket,
                                                   group=self.group)
            else:
                b.pending = comm.reduce_scatter_buffer(b.buffer, b.counts(comm.world_size(self.group)), "mean",
                                                       tag=tag, announced=b.ticket, group=self.group)
            b.ticket = None
            self.stats["bytes"] += b.buffer.nbytes
            self.stats["started_before_last_gradient"] += len(self.seen) < len(self.params)
            self.next_launch += 1

    def _finish(self, b):
        """A bucket's reduction is done: hand out the averaged gradients and drop the buffer."""
        result = b.pending.wait()
        b.pending = None
        t0 = time.perf_counter()
        if self.partition is None:
            for (i, lo, hi, _, _), offset in zip(b.pieces, b.offsets):
                p = self.params[i]
                values = result[offset:offset + hi - lo].reshape(p.shape)
                p.grad = Tensor(array_api.array(values, dtype=str(p.dtype), device=p.device), device=p.device,
                                dtype=str(p.dtype), requires_grad=False)
        else:
            if self.shard is None:
                self.shard = np.zeros(self.shard_size, np.float32)
            me, taken = comm.rank(self.group), 0
            for _, lo, hi, owner, at in b.pieces:
                if owner == me:
                    self.shard[at:at + hi - lo] = result[taken:taken + hi - lo]
                    taken += hi - lo
        self._copy_seconds += time.perf_counter() - t0
        self.buffer_bytes -= b.buffer.nbytes
        b.buffer, b.accumulated = None, False

    def take_shard(self):
        """ZeRO-2: this rank's averaged gradient shard from the last backward (then forgotten), or None."""
        shard, self.shard = self.shard, None
        return shard


def split_batch(batch, axis=0, group=None):
    """This rank's contiguous share of a global batch along `axis` (B/N of its B entries; N: the ranks of `group`),
    as a Tensor (or the input's kind of array). Every rank raises the same ValueError when B does not divide by
    the rank count."""
    n, r = comm.world_size(group), comm.rank(group)
    size = batch.shape[axis]
    if size % n:
        raise ValueError(f"split_batch: a batch of {size} along axis {axis} does not split evenly over {n} ranks; "
                         f"give a batch size that divides by {n}")
    if n == 1:
        return batch
    share = size // n
    index = tuple(slice(r * share, (r + 1) * share) if a == axis else slice(None) for a in range(len(batch.shape)))
    if isinstance(batch, Tensor):
        return Tensor(batch.numpy()[index], device=batch.device, dtype=batch.dtype, requires_grad=False)
    return batch[index]


def batchify(data, batch_size, device=None, dtype="float32", group=None):
    """`needle.data.batchify` of the global batch, then this rank's columns: rank r gets columns
    [r B/N, (r+1) B/N) of the (nbatch, B) array, so the ranks see disjoint streams of the same tokens that one
    process would see with batch_size B. ValueError (on every rank) when B does not divide by the rank count."""
    n = comm.world_size(group)
    if batch_size % n:
        raise ValueError(f"batchify: batch_size {batch_size} does not split evenly over {n} ranks; give a batch size "
                         f"that divides by {n}")
    return split_batch(_batchify(data, batch_size, device=device, dtype=dtype), axis=1, group=group)

