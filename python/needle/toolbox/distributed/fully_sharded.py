"""ZeRO stage 3 (Rajbhandari et al. 2020; PyTorch's FSDP): the parameters themselves partitioned across the ranks.

    model = dist.DataParallel(model)
    opt = dist.ZeroRedundancyOptimizer(model.parameters(), ndl.optim.Adam, stage=3, lr=1e-3)
    loss_fn(model(X), y).backward(); opt.step()     # the same numbers as DataParallel, 1/N of the model state
    model.module.state_dict()                       # full shapes on every rank (an all-gather: every rank calls it)

The model is cut into units: each layer of a stack (a module held in a list, as Transformer.layers) is one, and
the parameters outside every layer (embeddings, the head) are the root unit. Each unit's parameters are laid end
to end in one flat buffer and cut into N contiguous shards (as `zero.flat_partition` cuts); a rank keeps only its shard,
one 1-D Parameter, which is what the optimizer updates. The full parameters are released: the module keeps them
as placeholders that know their shape and hold no bytes.

A unit's weights exist only while they are used:

- forward: just before a layer's forward, `GatherShards` all-gathers its flat buffer (the next layer's all-gather
  is started at the same moment, non-blocking: prefetch) and the layer's attributes point at the full tensors;
  after it, the attributes point at the placeholders again and the gathered values are marked `drop` and released.
  The root unit is gathered around each call of the DataParallel wrapper (forward, `model.loss`, ...).
- backward: a gradient that reads a weight (a matmul's) finds it missing, so backward's plan recomputes it: the
  all-gather runs again (prefetching the layer below). It is a recomputation like any other (rule 2: at most once
  per backward; rule 3: released after its last use), so checkpointing composes: a layer recomputed for its own
  gradient gathers its weights once, as without checkpointing; a layer that backward passes through to rebuild a
  dropped boundary of the stack gathers them once more. This is a collective repeated on purpose, and on every
  rank alike, since every rank plans the same backward of the same graph; `Op.recomputable = False` is for the
  collectives that must never run twice (tensor parallelism's regions).
- the gradient of the gather is a reduce-scatter ("mean", as DataParallel averages): each rank receives the
  averaged gradient of its own shard, and nothing else.

Per step and rank: two all-gathers and one reduce-scatter of every parameter, against DataParallel's one
all-reduce; an all-reduce moves as much as a reduce-scatter plus an all-gather, so ZeRO-3 moves 1.5x as much.
Reduction order: the reduce-scatter sums the ranks' gradients in MPI's order, as DataParallel's all-reduce does.
Mixed precision composes: autocast casts the gathered weights where an op asks for 16-bit inputs, as it would
cast the parameters.
"""
import contextlib

import numpy as np

from ...autograd import Tensor, TensorOp, TensorTupleOp, release
from ...backend_selection import array_api, device_of
from ...nn import Module, Parameter
from ...regions import apply_decision
from . import comm

__all__ = ["FullyShardedModel", "GatherShards", "ReduceScatterShards", "ShardedUnit", "shard_model"]


def _host(t):
    return np.ascontiguousarray(array_api.to_numpy(t.realize_cached_data()))


class GatherShards(TensorTupleOp):
    """shard -> the unit's full parameters (a tuple, in their shapes): one all-gather of the flat buffer;
    d/dshard: the reduce-scatter ("mean") of their gradients. Recomputable on purpose (see the module docstring)."""

    saves = "none"

    def __init__(self, unit):
        self.unit = unit
        self.computed = 0  # the first compute is the forward's; later ones are backward's recomputations

    def infer_shape(self, shard_shape):
        return tuple(self.unit.shapes)

    def compute(self, shard):
        self.computed += 1
        flat = self.unit.take_prefetched()
        self.unit.prefetch_hits += flat is not None
        if flat is None:
            flat = self.unit.start_gather(shard).wait()
        # forward runs the layers in order, backward in reverse: start the all-gather of the one needed next
        neighbour = self.unit.next if self.computed == 1 else self.unit.previous
        if neighbour is not None:
            neighbour.prefetch()
        return tuple(_like(flat[lo:hi].reshape(shape), shard)
                     for (lo, hi), shape in zip(self.unit.bounds, self.unit.shapes))

    def gradient(self, out_grad, node):
        return (ReduceScatterShards(self.unit)(out_grad),)


class ReduceScatterShards(TensorOp):
    """The full parameters' gradients -> this rank's shard of their mean over the ranks (one reduce-scatter)."""

    saves = "none"

    def __init__(self, unit):
        self.unit = unit

    def infer_shape(self, shapes):
        return (self.unit.counts[comm.rank(self.unit.group)],)

    def compute(self, grads):
        flat = np.concatenate([np.asarray(array_api.to_numpy(g), np.float32).reshape(-1) for g in grads])
        shard = comm.reduce_scatter_buffer(flat, self.unit.counts, "mean", group=self.unit.group,
                                           label=f"ZeRO-3 gradient reduce-scatter of {self.unit.name}").wait()
        return _like(shard, grads[0])

    def gradient(self, out_grad, node):
        raise NotImplementedError("ZeRO-3: the reduce-scatter of gradients has no gradient (no second order)")


def _shard_counts(total, n):
    """N contiguous shards of ceil(total/N) elements, the last ones shorter (zero.flat_partition's cut)."""
    per = -(-total // n)
    return [max(0, min(per, total - r * per)) for r in range(n)]


def _like(values, array):
    return array_api.array(np.ascontiguousarray(values), dtype=str(array.dtype), device=device_of(array))


class ShardedUnit:
    """One unit's parameters: where they sit in the modules, the flat layout, this rank's shard (a Parameter)."""

    def __init__(self, name, slots, group):
        self.name, self.group = name, group
        self.params = list({id(p): p for _, _, p in slots}.values())  # a tied parameter is stored once
        self.slots = slots  # (module, attribute, parameter): where the forward finds each parameter
        self.shapes = [tuple(p.shape) for p in self.params]
        sizes = [int(np.prod(s)) for s in self.shapes]
        offsets = np.cumsum([0] + sizes)
        self.bounds = list(zip(offsets[:-1], offsets[1:]))
        self.counts = _shard_counts(sum(sizes), comm.world_size(group))
        self.start = int(sum(self.counts[:comm.rank(group)]))
        flat = np.concatenate([_host(p).reshape(-1) for p in self.params]) if self.params else np.zeros(0)
        device, dtype = self.params[0].device, str(self.params[0].dtype)
        self.shard = Parameter(flat[self.start:self.start + self.counts[comm.rank(group)]], device=device,
                               dtype=dtype)
        self.shard.name = f"ZeRO-3 shard of {name}"
        for p in self.params:
            release(p)  # a placeholder: its shape, dtype and device, no bytes
            p.requires_grad = False
        self.next = self.previous = None  # the units in forward order (prefetch)
        self.gathered = None  # the GatherShards output while the unit is in use
        self.prefetched = None  # (Pending all-gather, the shard's version it read)
        self.prefetch_hits = 0  # gathers that found their all-gather already started (tests count them)

    def start_gather(self, shard_array=None):
        values = _host(self.shard) if shard_array is None else np.ascontiguousarray(array_api.to_numpy(shard_array))
        return comm.all_gather_buffer(values.reshape(-1), self.counts, async_op=True, group=self.group,
                                      label=f"ZeRO-3 parameter all-gather of {self.name}")

    def prefetch(self):
        """Start the all-gather of this unit's shard now, non-blocking; GatherShards takes its result."""
        if self.prefetched is None:
            self.prefetched = (self.start_gather(), self.shard.version)

    def take_prefetched(self):
        """The prefetched flat buffer, or None (none started, or the shard changed since: then it is discarded)."""
        if self.prefetched is None:
            return None
        (pending, version), self.prefetched = self.prefetched, None
        flat = pending.wait()  # every rank started it, so every rank waits for it: MPI's order stays the same
        return flat if version == self.shard.version else None

    # ----- a forward through the unit ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def in_use(self):
        """The unit's modules see the full parameters inside the block; afterwards they are released again."""
        gathered = GatherShards(self)(self.shard)
        full = {id(p): gathered[i] for i, p in enumerate(self.params)}
        for module, attribute, p in self.slots:
            module.__dict__[attribute] = full[id(p)]
        try:
            yield
        finally:
            for module, attribute, p in self.slots:
                module.__dict__[attribute] = p
            for value in [gathered] + list(full.values()):  # backward gathers again where a gradient reads them
                apply_decision(value, False)

    # ----- full values, for state dicts -----------------------------------------------------------------------------
    def full_values(self):
        """{parameter: its full NumPy value} (one all-gather; every rank calls it)."""
        self.drain()
        flat = self.start_gather().wait()
        return {id(p): flat[lo:hi].reshape(shape) for p, (lo, hi), shape in zip(self.params, self.bounds, self.shapes)}

    def load(self, values):
        """Take this rank's shard of `values` ({id(parameter): full NumPy value}; those missing are kept)."""
        self.drain()
        flat = _host(self.shard)
        for p, (lo, hi) in zip(self.params, self.bounds):
            if id(p) in values:
                whole = np.asarray(values[id(p)], np.float32).reshape(-1)
                a, b = max(lo, self.start), min(hi, self.start + flat.size)
                if a < b:
                    flat[a - self.start:b - self.start] = whole[a - lo:b - lo]
        self.shard.data = Tensor(flat, device=self.shard.device, dtype=str(self.shard.dtype), requires_grad=False)

    def drain(self):
        """Wait for a prefetch nobody took (a unit whose backward read no weight), before the shard changes."""
        if self.prefetched is not None:
            self.prefetched[0].wait()
            self.prefetched = None


class ShardedLayer(Module):
    """Mixed into a layer's class: its forward runs with the unit's parameters gathered."""

    def forward(self, *args, **kwargs):
        with self.zero3_unit.in_use():
            return super().forward(*args, **kwargs)


class FullyShardedModel(Module):
    """Mixed into the wrapped model's class: state dicts in full shapes (the one-process model's keys)."""

    def state_dict(self):
        """The one-process model's state dict on every rank: every unit all-gathered (a collective)."""
        self.named_parameters()
        full = {}
        for unit in self.zero3_units:
            full.update(unit.full_values())
        return {name: np.array(full[id(t)] if id(t) in full else t.numpy(), copy=True)
                for name, t in self._named_tensors()}

    def load_state_dict(self, state_dict, strict=True):
        """Load full shapes: each rank keeps its shard of the parameters; buffers are copied."""
        own = dict(self._named_tensors())
        sharded = {id(p) for unit in self.zero3_units for p in unit.params}
        for name, t in own.items():
            if name in state_dict and id(t) in sharded:
                value = state_dict[name]
                value = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
                if value.shape != tuple(t.shape):
                    raise RuntimeError(f"load_state_dict for {type(self).__name__}: {name!r} has shape {value.shape} "
                                       f"in the state dict, but {tuple(t.shape)} in the module")
        rest = {k: v for k, v in state_dict.items() if k not in own or id(own[k]) not in sharded}
        missing, unexpected = super().load_state_dict(rest, strict=False)
        missing = [k for k in missing if id(own[k]) not in sharded]
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict for {type(self).__name__}: missing keys {missing}, unexpected keys "
                               f"{unexpected} (keys are attribute paths, as state_dict() gives them)")
        values = {id(own[k]): v.numpy() if hasattr(v, "numpy") else v for k, v in state_dict.items()
                  if k in own and id(own[k]) in sharded}
        for unit in self.zero3_units:
            unit.load(values)
        return [k for k in own if k not in state_dict], unexpected


_CLASSES = {}


def _mixed(mixin, cls):
    if issubclass(cls, mixin):
        return cls
    if (mixin, cls) not in _CLASSES:
        _CLASSES[mixin, cls] = type(f"{mixin.__name__.replace('Model', '').replace('Layer', '')}{cls.__name__}",
                                    (mixin, cls), {})
    return _CLASSES[mixin, cls]


def _layers(model):
    """The outermost modules held in lists or tuples (a stack of layers) that hold parameters: (name, module)."""
    layers, inside = [], []
    for name, m in model.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        last = name.rsplit(".", 1)[-1]
        if name and last.isdigit() and m.parameters():
            layers.append((name, m))
            inside.append(name + ".")
    return layers


def _slots(modules, params, what):
    """Where each parameter of `params` is an attribute of one of `modules`: [(module, attribute, parameter)]."""
    wanted = {id(p) for p in params}
    slots = [(m, k, v) for m in modules for k, v in m.__dict__.items() if isinstance(v, Parameter) and id(v) in wanted]
    found = {id(p) for _, _, p in slots}
    lost = [p.name for p in params if id(p) not in found]
    if lost:
        raise ValueError(f"ZeroRedundancyOptimizer(stage=3): {what}'s parameter {lost[0]} is not an attribute of a "
                         f"module (in a list or dict?): ZeRO-3 swaps attributes to gather a unit's weights")
    return slots


def shard_model(model, group=None):
    """Cut `model` (the module a DataParallel wraps) into units, keep this rank's shard of each, release the full
    parameters, and make its layers gather their weights in forward. Returns (units, the root unit or None)."""
    units, in_layers = [], set()
    for name, layer in _layers(model):
        params = [p for p in layer.parameters() if p.requires_grad]
        unit = ShardedUnit(name, _slots([m for _, m in layer.named_modules()], params, name), group)
        layer.zero3_unit = unit
        layer.__class__ = _mixed(ShardedLayer, type(layer))
        units.append(unit)
        in_layers |= {id(p) for p in params}
    for before, after in zip(units, units[1:]):
        before.next, after.previous = after, before
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in in_layers]
    root = None
    if rest:
        outer = [m for name, m in model.named_modules() if not any(name.startswith(n + ".") or name == n
                                                                     for n, _ in _layers(model))]
        root = ShardedUnit("the parameters outside the layers", _slots(outer, rest, "the model"), group)
        units.insert(0, root)
    model.zero3_units = units
    model.__class__ = _mixed(FullyShardedModel, type(model))
    return units, root
