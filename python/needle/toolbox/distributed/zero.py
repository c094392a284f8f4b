"""ZeRO (Rajbhandari et al. 2020): data parallelism without N copies of the optimizer's state.

With plain data parallelism every rank holds the whole model state: parameters, gradients and the optimizer's
state (Adam: m and v; with mixed precision also float32 master weights: 16 bytes per parameter in all, of which
12 are optimizer state). ZeRO partitions it across the N data-parallel ranks:

- stage 1: each rank keeps the optimizer state of 1/N of the parameters and updates only those; after the step
  the updated parameters are all-gathered, so every rank again holds all of them. Gradients are all-reduced as in
  DataParallel.
- stage 2: the gradients too: each bucket of gradients is reduce-scattered instead of all-reduced, so a rank
  receives (and keeps) only the averaged gradient of its own 1/N; the full local gradients are dropped as soon as
  they are copied into their bucket (`p.grad` is None after backward; the shard is inside the optimizer).

    model = dist.DataParallel(model)
    opt = dist.ZeroRedundancyOptimizer(model.parameters(), ndl.optim.Adam, stage=2, lr=1e-3)
    loss_fn(model(X), y).backward(); opt.step()      # every rank's parameters: the same as with DataParallel

How parameters are split (`partition`):

- "flat" (the default for SGD and Adam, whose update of an element reads only that element): as ZeRO and llm.c
  do, all parameters are laid end to end in one flat buffer (order of definition) and cut into N contiguous
  shards of ceil(P/N) elements (the last one shorter), whatever the tensor sizes; a tensor may straddle two shards.
  The inner optimizer is built on this rank's shard, one 1-D Parameter, so its state is exactly the state of
  ceil(P/N) (or the last rank's rest of) elements. Updates are element-wise, so the result equals DataParallel's
  bit for bit.
- "tensors" (the default for every other optimizer): whole tensors are assigned to ranks, largest first to the
  least-loaded rank, and each rank's inner optimizer works on the real tensors it owns. For optimizers whose
  update of a tensor reads the whole tensor this keeps the algorithm unchanged: Adafactor factors the second moment
  of a matrix into row and column means and clips by the tensor's RMS (on a flat shard it would see a vector:
  unfactored state, and a different update), and Adam8bit quantizes per tensor in blocks of 256 and keeps the
  tensors in `fp32_state_params` in float32 (passed on for the tensors this rank owns). The price: a rank's share
  is 1/N only as far as whole tensors allow (the PTB LM's embedding is 38% of its parameters).

- stage 3: the parameters too (`fully_sharded`): each layer's parameters flat-sharded, all-gathered just before its
  forward and again in backward, freed after use; gradients reduce-scattered by the gather's gradient. The inner
  optimizer updates the shards; the wrapped module's state_dict() gives full shapes.

`state_bytes()` is this rank's optimizer state (the inner optimizer's), as every optimizer reports it.
All parameters must have one dtype. At world size 1 the one rank owns everything; without mpiexec no
DataParallel is needed.
"""
import numpy as np

from ...autograd import Tensor
from ...backend_selection import array_api
from ...nn import Parameter
from ...optim import SGD, Adam, Optimizer
from . import comm, fully_sharded
from .data_parallel import check_same_model, wrapper_of

__all__ = ["ZeroRedundancyOptimizer", "flat_partition", "tensor_partition"]

ELEMENTWISE = (SGD, Adam)  # the optimizers (exactly these classes) whose update is element by element
PARTITIONS = ("auto", "flat", "tensors")


def flat_partition(sizes, n):
    """Cut the flat buffer of tensors of `sizes` elements into n contiguous shards of ceil(P/n) elements.

    Returns (pieces, shard sizes): pieces[i] lists tensor i's (i, first element, end element, owner, offset in
    the owner's shard)."""
    total = sum(sizes)
    per = -(-total // n) if total else 0
    bounds = [min(r * per, total) for r in range(n + 1)]
    pieces, start = [], 0
    for i, size in enumerate(sizes):
        mine = []
        for r in range(n):
            lo, hi = max(start, bounds[r]), min(start + size, bounds[r + 1])
            if lo < hi:
                mine.append((i, lo - start, hi - start, r, lo - bounds[r]))
        pieces.append(mine)
        start += size
    return pieces, [bounds[r + 1] - bounds[r] for r in range(n)]


def tensor_partition(sizes, n):
    """Whole tensors to ranks: largest first, each to the rank with the fewest elements so far (ties: lower rank,
    then order of definition). Returns (pieces, shard sizes) as flat_partition; a rank's shard is its tensors in
    order of definition."""
    owner, load = {}, [0] * n
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    pieces, used = [], [0] * n
    for i, size in enumerate(sizes):
        r = owner[i]
        pieces.append([(i, 0, size, r, used[r])])
        used[r] += size
    return pieces, load


class ZeroRedundancyOptimizer(Optimizer):
    """`optimizer_class(**kw)` run on this rank's 1/N of the parameters (ZeRO stage 1, 2 or 3); see the module
    docstring. `params` are those of a DataParallel model (at world size 1, any parameters)."""

    def __init__(self, params, optimizer_class, stage=1, partition="auto", **kw):
        super().__init__(params)
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroRedundancyOptimizer: stage must be 1 (optimizer state), 2 (and gradients) or 3 "
                             f"(and parameters), got {stage!r}")
        if partition not in PARTITIONS:
            raise ValueError(f"ZeroRedundancyOptimizer: partition must be one of {', '.join(PARTITIONS)}, got "
                             f"{partition!r}")
        if kw.get("in_backward"):
            raise ValueError("ZeroRedundancyOptimizer: in_backward=True is not supported: each rank updates its shard "
                             "after the gradients are reduced across ranks, not inside backward")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"ZeroRedundancyOptimizer: optimizer_class must be an Optimizer class such as "
                            f"ndl.optim.Adam, got {optimizer_class!r}")
        dtypes = sorted({str(p.dtype) for p in self.params})
        if len(dtypes) > 1:
            raise ValueError(f"ZeroRedundancyOptimizer: the parameters must have one dtype, got {', '.join(dtypes)}")
        comm.init()
        self.wrapper = self._data_parallel()
        self.group = None if self.wrapper is None else self.wrapper.group  # ZeRO shards over the data dimension
        self.stage, self.optimizer_class = stage, optimizer_class
        if stage == 3:
            self._shard_parameters(partition, kw)
            return
        self.partition = partition if partition != "auto" else \
            "flat" if optimizer_class in ELEMENTWISE else "tensors"
        n, me = comm.world_size(self.group), comm.rank(self.group)
        check_same_model("ZeroRedundancyOptimizer", [(p.name or f"parameter {i}", p) for i, p in
                                                     enumerate(self.params)], self.group)
        sizes = [int(np.prod(p.shape)) for p in self.params]
        cut = flat_partition if self.partition == "flat" else tensor_partition
        self.pieces, self.shard_sizes = cut(sizes, n)
        self.mine = [piece for pieces in self.pieces for piece in pieces if piece[3] == me]
        if self.partition == "flat":
            fp32_params = kw.get("fp32_state_params")
            if fp32_params:
                raise ValueError("ZeroRedundancyOptimizer: fp32_state_params names tensors, which a flat shard does "
                                 "not have: use partition='tensors'")
            self.shard = Parameter(self._gather_mine(lambda p: _host(p)), device=self._device(), dtype=dtypes[0]
                                   if dtypes else "float32")
            self.shard.name = f"ZeRO shard of rank {me}"
            self.optimizer = optimizer_class([self.shard], **kw)
            self.param_versions = [p.version for p in self.params]  # what the shard was copied from
        else:
            owned = [self.params[i] for i, *_ in self.mine]
            if "fp32_state_params" in kw:  # per-tensor options: for the tensors this rank owns
                keep = {id(p) for p in owned}
                kw = {**kw, "fp32_state_params": [p for p in kw["fp32_state_params"] if id(p) in keep]}
            self.shard = None
            self.optimizer = optimizer_class(owned, **kw)
        if stage == 2 and self.wrapper is not None:
            self.wrapper.reducer.reduce_scatter_to(self.pieces, self.shard_sizes[me])

    def _shard_parameters(self, partition, kw):
        """Stage 3 (fully_sharded): the model's units flat-sharded; the inner optimizer updates the shards."""
        if partition not in ("auto", "flat") or self.optimizer_class not in ELEMENTWISE:
            raise ValueError(f"ZeroRedundancyOptimizer(stage=3): shards are flat (partition 'flat'), so the "
                             f"optimizer must update element by element (SGD, Adam), got "
                             f"{self.optimizer_class.__name__} with partition {partition!r}")
        if self.wrapper is None:
            raise ValueError("ZeroRedundancyOptimizer(stage=3): the parameters must be those of a DataParallel "
                             "model (model = DataParallel(model)), in one process too")
        check_same_model("ZeroRedundancyOptimizer", [(p.name or f"parameter {i}", p) for i, p in
                                                     enumerate(self.params)], self.group)
        self.partition = "flat"
        self.units, root = fully_sharded.shard_model(self.wrapper.module, self.group)
        self.wrapper.shard_parameters(root)
        self.full_params = self.params
        self.params = [unit.shard for unit in self.units]
        self.shard_sizes = [sum(unit.counts[r] for unit in self.units) for r in range(comm.world_size(self.group))]
        self.shard = None
        self.optimizer = self.optimizer_class(self.params, **kw)

    def _data_parallel(self):
        wrappers = {id(w): w for w in (wrapper_of(p) for p in self.params)}
        if comm.world_size() == 1 and None in wrappers.values():
            return None  # one process: nothing to reduce
        if len(wrappers) != 1 or None in wrappers.values():
            raise ValueError("ZeroRedundancyOptimizer: the parameters must be those of one DataParallel model "
                             "(model = DataParallel(model); ZeroRedundancyOptimizer(model.parameters(), ...)): its "
                             "backward averages the gradients across ranks")
        wrapper = next(iter(wrappers.values()))
        if len(wrapper.reducer.params) != len(self.params):
            raise ValueError("ZeroRedundancyOptimizer: give it all the DataParallel model's parameters (ZeRO shards "
                             "the flat buffer of all of them)")
        return wrapper

    def _device(self):
        return self.params[0].device if self.params else None

    def _gather_mine(self, values_of):
        """This rank's shard: its pieces of `values_of(param)` (flat NumPy), in shard order."""
        parts = [values_of(self.params[i]).reshape(-1)[lo:hi] for i, lo, hi, _, _ in self.mine]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    # ----- a step ---------------------------------------------------------------------------------------------------
    def step(self):
        if self.stage == 3:  # backward left each shard's averaged gradient in its .grad: the update is local
            for unit in self.units:
                unit.drain()
            self.optimizer.step()
            return
        self._refresh_shard()
        self._shard_gradients()
        self.optimizer.step()
        self._all_gather_parameters()

    def _refresh_shard(self):
        """A flat shard is a copy of this rank's pieces of the parameters: if they were written since it was taken
        (a model's load_state_dict, `.data =`), it takes their values again, so the step updates what the model
        holds — not the values from before, which its all-gather would write back over the load."""
        if self.shard is not None and [p.version for p in self.params] != self.param_versions:
            self.shard.cached_data = array_api.array(self._gather_mine(_host), dtype=str(self.shard.dtype),
                                                     device=self.shard.device)

    def _shard_gradients(self):
        """Give the inner optimizer this rank's averaged gradients: stage 1 cuts them out of the full `.grad`s
        (a missing `.grad` counts as zeros), stage 2 takes the shard that backward's reduce-scatter left."""
        if self.stage == 2 and self.wrapper is not None:
            shard = self.wrapper.reducer.take_shard()
            if shard is None:
                raise RuntimeError("ZeroRedundancyOptimizer.step(): no gradients: call backward() through the "
                                   "DataParallel model first")
        else:
            shard = self._gather_mine(lambda p: np.zeros(p.shape, np.float32) if p.grad is None else
                                      _host(p.grad).astype(np.float32, copy=False))
        if self.shard is not None:
            self.shard.grad = _tensor(shard, self.shard)
            return
        for i, lo, hi, _, at in self.mine:  # "tensors": whole tensors, their own .grad
            p = self.params[i]
            p.grad = _tensor(shard[at:at + hi - lo].reshape(p.shape), p)

    def _all_gather_parameters(self):
        """Every rank's updated shard to every rank, written into the parameters (rank order, one Allgatherv)."""
        n, me = comm.world_size(self.group), comm.rank(self.group)
        mine = self._gather_mine(_host) if self.shard is None else _host(self.shard)
        if n == 1 and self.shard is None:
            return  # the inner optimizer updated the parameters themselves
        everything = comm.all_gather_buffer(np.ascontiguousarray(mine.reshape(-1)), self.shard_sizes,
                                            label="ZeroRedundancyOptimizer's parameter all-gather", group=self.group)
        starts = np.cumsum([0] + self.shard_sizes)
        flats = {}
        for pieces in self.pieces:
            for i, lo, hi, owner, at in pieces:
                if self.shard is None and owner == me:
                    continue  # already updated in place by the inner optimizer
                p = self.params[i]
                flat = flats.setdefault(i, np.empty(int(np.prod(p.shape)), everything.dtype))
                flat[lo:hi] = everything[starts[owner] + at:starts[owner] + at + hi - lo]
        for i, flat in flats.items():
            p = self.params[i]
            p.cached_data = array_api.array(flat.reshape(p.shape), dtype=str(p.dtype), device=p.device)
        if self.shard is not None:
            self.param_versions = [p.version for p in self.params]

    def reset_grad(self):
        for p in self.params:
            p.grad = None
        if self.shard is not None:
            self.shard.grad = None
        if self.wrapper is not None and self.stage == 2:
            self.wrapper.reducer.take_shard()

    # ----- saving and resuming: each rank its own shard ----------------------------------------------------------
    def state_dict(self):
        """This rank's shard of the state: the inner optimizer's state_dict (its parameter i is the i-th tensor
        this rank owns, or with partition "flat" the one flat shard, whose values are saved too: they are what
        the inner optimizer updates), keyed by the rank that holds it. No communication: every rank saves its own,

            ndl.save(opt.state_dict(), f"optimizer.rank{dist.rank()}.npz")   # and rank 0 the model's state_dict

        and `load_state_dict` on rank r accepts only rank r's, saved by a job of the same world size and
        partition (the stage may differ: stages 1 and 2 keep the same optimizer state)."""
        state = {"rank": comm.rank(self.group), "world_size": comm.world_size(self.group), "stage": self.stage,
                 "partition": self.partition, "shard_sizes": list(self.shard_sizes),
                 "optimizer_class": self.optimizer_class.__name__, "optimizer": self.optimizer.state_dict()}
        if self.shard is not None:
            state["shard"] = _host(self.shard)
        return state

    def load_state_dict(self, state_dict):
        """Restore this rank's shard from `state_dict()`'s result saved by this rank; ValueError naming the
        mismatch (another rank's shard, another world size, partition or optimizer class)."""
        keys = ("rank", "world_size", "partition", "shard_sizes", "optimizer_class", "optimizer")
        missing = [k for k in keys if not isinstance(state_dict, dict) or k not in state_dict]
        if missing or (self.shard is not None and "shard" not in state_dict):
            raise ValueError(f"ZeroRedundancyOptimizer.load_state_dict: the state lacks "
                             f"{', '.join(missing or ['shard'])}")
        here = {"rank": comm.rank(self.group), "world_size": comm.world_size(self.group), "partition": self.partition,
                "shard_sizes": list(self.shard_sizes), "optimizer_class": self.optimizer_class.__name__}
        for key, value in here.items():
            saved = state_dict[key]
            if isinstance(saved, (list, tuple, np.ndarray)):
                saved = [int(x) for x in saved]  # shard_sizes, a list however it was stored
            if saved != value:
                raise ValueError(f"ZeroRedundancyOptimizer.load_state_dict: the state is for {key}="
                                 f"{state_dict[key]!r}, this rank has {key}={value!r}"
                                 + (" (each rank loads the file its own rank saved)" if key == "rank" else ""))
        if self.shard is not None:
            shard = np.asarray(state_dict["shard"])
            if shard.shape != tuple(self.shard.shape):
                raise ValueError(f"ZeroRedundancyOptimizer.load_state_dict: the saved shard has shape {shard.shape},"
                                 f" this rank's is {tuple(self.shard.shape)}")
        self.optimizer.load_state_dict(state_dict["optimizer"])  # checks its own state before changing anything
        if self.shard is not None:
            self.shard.cached_data = array_api.array(shard, dtype=str(self.shard.dtype), device=self.shard.device)
            self.param_versions = [p.version for p in self.params]  # the loaded shard, not the parameters, wins

    # ----- accounting ---------------------------------------------------------------------------------------------
    def state_bytes(self):
        """Bytes of optimizer state on this rank's device: the inner optimizer's, for its 1/N of the parameters."""
        return self.optimizer.state_bytes()

    def host_state_bytes(self):
        return self.optimizer.host_state_bytes()

    def gradient_bytes(self):
        """Bytes of gradients this rank holds for the step: stage 2 its float32 shard, stage 1 every `.grad`,
        stage 3 its shards' `.grad`s."""
        if self.stage == 2 and self.wrapper is not None:
            shard = self.wrapper.reducer.shard
            return 0 if shard is None else int(shard.nbytes)
        return sum(int(p.grad.realize_cached_data().nbytes) for p in self.params if p.grad is not None)

    def shard_size(self, rank=None):
        """Elements of the parameters `rank` (default: this one) updates."""
        return self.shard_sizes[comm.rank(self.group) if rank is None else rank]


def _host(t):
    return np.ascontiguousarray(array_api.to_numpy(t.realize_cached_data()))


def _tensor(values, like):
    """A gradient Tensor holding NumPy `values` in `like`'s dtype and device."""
    return Tensor(array_api.array(values, dtype=str(like.dtype), device=like.device), device=like.device,
                  dtype=str(like.dtype), requires_grad=False)
