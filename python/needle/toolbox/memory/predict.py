"""ndl.memory.predict: a training step's whole peak, to the byte, before it runs.

    prediction = ndl.memory.predict(train_step, X, y)   # train_step(X, y): forward, loss, backward, opt.step()
    prediction.peak_bytes, prediction.phase             # the allocator's peak_bytes the step would reach, and where
    prediction.by_category                              # {"parameters": ..., "activations": ...}: sums to the peak
    prediction.top(5)                                   # the largest values alive at the peak, and why

A dry run: the step runs in lazy mode with `memory_hook.PREDICTOR` set, so its forward only builds the graph (a
Tensor made from data inside it gets a shape and no buffer), `loss.backward()` walks the ledger (ledger.py: the
very backward plan the executor runs, with the model's checkpointing decisions) instead of computing, and an
optimizer's `step()` counts each update's state and workspace (`Optimizer.update_bytes`) instead of making it.
What already exists is read from the allocator (`current_bytes`) and named: the parameters, the optimizer's state,
the gradients (freed by `reset_grad` or replaced by backward's), the batch. Nothing is computed or allocated, and
the parameters and the optimizer's state are unchanged afterwards. Not predicted (an error says so): a second
backward in one step (accumulation), a value read inside the step (`loss.numpy()`), offloaded gradients.
"""
import contextlib
import dataclasses
import math
import weakref

import ml_dtypes
import numpy as np

from ... import memory_hook
from ...autograd import element_shapes, find_topo_sort, infer_spec, lazy_mode, placeholder, run_deferred
from ...backend_ndarray.array_api import dtype_name
from ...backend_selection import default_device
from ...ledger import Ledger, walk_step
from ...nn import Parameter
from .account import Account, at_the_floor_if_infeasible, by_category_of, causes_of, value_row
from .recorder import ModuleScope, module_names

__all__ = ["predict", "Prediction"]


class Prediction(Account):
    """What `predict` found: `peak_bytes`, `phase`, `by_category`, `top(n)`, `causes`; `str()` explains it. Also
    gc.py's two activation figures: `activation_bytes` (M_act, what the forward pass holds when backward starts)
    and `peak_activation_bytes` (M_peak, the most forward and backward hold), both above the step's start."""
    measured = False
    activation_bytes = peak_activation_bytes = 0
    after_backward_bytes = gradient_bytes = 0  # the bytes alive when backward returns; its gradients' among them


def predict(step, *args, **kwargs):
    """Trace `step(*args, **kwargs)` without computing it and return its `Prediction` (see the module docstring).
    A Budget below its floor is predicted at the floor (`below-floor` among the causes, `floor_bytes` set)."""
    device = kwargs.pop("device", None) or default_device()
    return at_the_floor_if_infeasible(lambda: _predicted(device, step, args, kwargs))


def _predicted(device, step, args, kwargs):
    predictor = Predictor(device)
    tracker = ModuleTracker(predictor)
    previous_recorder = memory_hook.set_recorder(tracker)
    previous = memory_hook.set_predictor(predictor)
    try:
        with lazy_mode(True):
            step(*args, **kwargs)
    finally:
        memory_hook.set_predictor(previous)
        memory_hook.set_recorder(previous_recorder)
    prediction = predictor.prediction(tracker)
    predictor.walk = predictor.best = None  # (the ledger and the predictor refer to each other: the traced graph,
    return prediction  # the batch under it, goes now, not at the next garbage collection)


class Predictor:
    """memory_hook.PREDICTOR during a dry run: what backward, optimizers and reset_grad hand it, counted."""

    def __init__(self, device):
        self.device = device
        self.start = device.memory_stats()["current_bytes"]
        self.freed = 0  # bytes of the start's that the step frees (the gradients reset_grad or backward replaces)
        self.freed_grads, self.freed_buffers = set(), set()  # the gradient Tensors and buffers counted in `freed`
        self.old_grads = []  # the gradients reset_grad freed: their graphs go with them (free_old_graphs)
        self.optimizers, self.parameters = [], {}  # id -> Parameter: those the step's graph or optimizers name
        self.walk = None  # the ledger after backward's walk
        self.best = None  # (bytes, phase, [(node, bytes, category, reason)]) at the peak
        self.module_of = {}  # id(node) -> the module it was built in
        self.eager, self.regions = False, []  # an eager step (traced lazily): its regions, as annotate made them
        self.made = []  # the id of every graph value the step made, in order (eager mode computes them so)
        self.constants = []  # [made at, freed at (None: alive), bytes, id] of each constant the step made
        self.note(self.start, "forward", [])

    # ----- what the core hands over (memory_hook.PREDICTOR) -------------------------------------------------------
    def constant(self, node, shape, dtype, device):
        """A Tensor made from data (or by init) inside the step, with no buffer: its spec (shape, dtype, device), as
        the backends would store it; it is counted while it lives (`constants`: made and freed by the count of
        values made, for an eager walk; bytes)."""
        shape, dtype = tuple(shape), "float32" if dtype in (None, "bool", bool) else dtype_name(dtype)
        entry = [len(self.made), None, math.prod(shape) * np.dtype(_numpy_dtype(dtype)).itemsize, id(node)]
        made = self.made  # (the callback holds the list, not the predictor: nothing outlives the dry run)
        entry.append(weakref.ref(node, lambda _, entry=entry: entry.__setitem__(1, len(made))))
        self.constants.append(entry)
        return shape, dtype, device

    def eager_op(self, node):
        """An op applied outside lazy mode: the step is eager (traced lazily all the same, walked as eager). A value
        no gradient flows through is a constant there (make_from_op detaches it): here a spec of one."""
        self.eager = True
        spec = None if node.requires_grad or node.op.view else infer_spec(node)  # (a view: the ledger aliases it)
        if spec is None or isinstance(spec[1], tuple) or element_shapes(spec[0]) is not None:  # (a tuple: as it is)
            return node
        constant = placeholder(spec, requires_grad=False)
        self.constant(constant, *spec)
        return constant

    def refuse_value(self, node):
        op = type(node.op).__name__ if node.op is not None else "a leaf"
        raise RuntimeError(f"ndl.memory.predict: the step read the value of {op} (shape {tuple(node.shape)}), but "
                           "a dry run computes nothing; return the loss instead of reading it (loss.numpy(), "
                           "float(loss)), or measure the step with ndl.memory.explain")

    def reset_grad(self, optimizer):
        self.see_optimizer(optimizer)
        for p in optimizer.params:
            self.free_grad(p)

    def backward(self, root, out_grad):
        if self.walk is not None:
            raise NotImplementedError("ndl.memory.predict: a second backward() in one step (accumulation over "
                                      "micro-batches) is not predicted; predict one micro-batch's step")
        if out_grad is not None:
            raise NotImplementedError("ndl.memory.predict: backward(out_grad) is not predicted; call backward() "
                                      "on a scalar loss")
        decided = {id(n) for n in find_topo_sort([root]) if n.drop}  # as forward decided (eager: region by region)
        run_deferred([root])  # a Budget plans here, on the graph, before anything is computed (as backward does)
        order = find_topo_sort([root])
        for node in order:
            if isinstance(node, Parameter):
                self.parameters[id(node)] = node
                if node.optimizer is not None:
                    self.see_optimizer(node.optimizer)
        self.free_old_graphs(order)
        dropped = {id(n) for n in order if n.drop}
        stores = {id(n): n.store for n in order if n.store is not None and n.drop}
        self.forward_ids = {id(n) for n in order}
        self.dropped_any = bool(dropped)
        # (ids: a later value may reuse a freed one's, and comes later in `made`, so the last index is its own)
        self.index_of = {key: i for i, key in enumerate(self.made)}
        regions, made = self.eager_plan(root, order, decided) if self.eager else (None, None)
        # constants outside the loss's graph that the step's Python still holds (a model's zero state), by when
        self.loose = [e for e in self.constants if e[1] is not None or e[3] not in self.forward_ids]
        self.backward_at = len(self.made)
        self.walk = walk_step(root, dropped, regions, stores, None, ledger=lambda *a: StepLedger(self, *a),
                              order=made)
        walk = self.walk  # what backward leaves: the start's bytes less those freed, and what the walk still holds
        self.after_backward = self.start - self.freed + walk.live
        self.gradient_bytes = sum(walk.size[k] for g in walk.grads.values() for k in walk.buffers.get(id(g), ()))

    def optimizer_step(self, optimizer):
        """An ordinary step after backward: each update's state and workspace, the gradients still alive."""
        self.see_optimizer(optimizer)
        if optimizer.in_backward or self.walk is None:
            return
        ledger = self.walk
        params = [p for p in optimizer.params if id(p) in ledger.grads or p.grad is not None]
        for k, p in enumerate(params):
            state, workspace = optimizer.update_bytes(p)
            if optimizer.offload_state and k + 1 < len(params):  # the next parameter's state is on its way in
                following = params[k + 1]
                workspace += optimizer.update_bytes(following)[1] - optimizer.workspace_bytes(following)
            ledger.live += state
            ledger.state_made += state
            self.note_ledger(ledger, "optimizer", workspace, p)

    def eager_plan(self, root, order, decided):
        """(regions, order) of an eager step's walk: the values in the order they were made; what each region
        dropped (an inner region's kept value an outer one drops goes at the outer one's end), released at its
        end; drops decided when backward starts (a deferred policy: compression's, a Budget's first step)
        released when the forward pass ends, as eager mode computed it whole."""
        regions = [([o for o in outs if o is not None], [c for c in dropped if id(c) in decided])
                   for outs, dropped in self.regions]
        late = [n for n in order if n.drop and id(n) not in decided]
        if late:
            regions.append(([root], late))
        return regions, sorted(order, key=lambda n: self.index_of.get(id(n), -1))

    # ----- bookkeeping --------------------------------------------------------------------------------------------
    def see_optimizer(self, optimizer):
        if optimizer not in self.optimizers:
            self.optimizers.append(optimizer)
            for p in optimizer.params:
                self.parameters[id(p)] = p

    def free_grad(self, p):
        """p's gradient as the step starts goes (reset_grad, or backward's new one replaces it)."""
        grad = p.grad
        if grad is not None and id(grad) not in self.freed_grads:
            self.freed_grads.add(id(grad))
            self.freed += _new_bytes(grad.cached_data, self.freed_buffers)
            self.old_grads.append(grad)

    def free_old_graphs(self, order):
        """The values only the freed gradients' graphs held go with them (their seed, constants of the last
        step's graph): those with data, not parameters and not in this step's graph (`order`)."""
        held = set()  # the buffers this step's graph and the parameters still hold (a detached copy shares one)
        for node in order + list(self.parameters.values()):
            _new_bytes(node.cached_data, held)
        for node in find_topo_sort(self.old_grads):
            if node.cached_data is not None and id(getattr(node.cached_data, "buffer", node.cached_data)) not in held:
                self.freed += _new_bytes(node.cached_data, self.freed_buffers)
        self.old_grads = []

    def note(self, total, phase, values):
        if self.best is None or total > self.best[0]:
            self.best = (total, phase, values)

    def note_ledger(self, ledger, phase, workspace=0, node=None):
        total = self.start - self.freed + ledger.live + workspace
        if self.best is None or total > self.best[0]:
            values = ledger.snapshot()  # (the values alive are read from it once the walk is over: alive_at)
            if workspace and isinstance(node, Parameter):  # an update's: named by its parameter
                values.append((node, workspace, "temporaries", "the workspace of the parameter's update (and its "
                                                               "state on the device, if offloaded)"))
            elif workspace:
                op = type(node.op).__name__ if node is not None and node.op is not None else "an op"
                values.append((None, workspace, "temporaries", f"the workspace of {op}, running at the peak"))
            if ledger.state_made:
                values.append((None, ledger.state_made, "optimizer_state", "made by the update at the peak"))
            self.best = (total, phase, values)

    def prediction(self, tracker):
        total, phase, values = self.best
        if values and isinstance(values[0], Snapshot):
            values = self.walk.alive_at(values[0]) + values[1:]
        names = module_names(tracker.roots.values())
        rows = [value_row(node, nbytes, category, reason, self.module_of, names)
                for node, nbytes, category, reason in values]
        prediction = Prediction(total, phase, by_category_of(rows, total, self.existing_bytes()), rows)
        walk = self.walk
        # M_act: what the forward pass holds when backward starts (backward's seed is backward's)
        prediction.activation_bytes = walk.forward_live - (0 if self.eager else walk.seed_bytes) if walk else 0
        prediction.peak_activation_bytes = walk.peak if walk else 0  # M_peak: forward + backward, above the start
        prediction.after_backward_bytes = getattr(self, "after_backward", self.start - self.freed)
        prediction.gradient_bytes = getattr(self, "gradient_bytes", 0)
        modules = [m for root in tracker.roots.values() for _, m in root.named_modules()]
        prediction.causes = causes_of(prediction, any(m.checkpoint_policy is not None for m in modules),
                                      getattr(self, "dropped_any", False), head_width(modules))
        return prediction

    def existing_bytes(self):
        """{category: bytes} of what the allocator held at the start and still holds: the parameters, the
        optimizers' state, the gradients not freed; the rest of the start's bytes are `other` (by_category_of)."""
        seen, out = set(), {"parameters": 0, "optimizer_state": 0, "gradients": 0}
        for p in self.parameters.values():
            out["parameters"] += _new_bytes(p.cached_data, seen)
            if p.grad is not None and id(p.grad) not in self.freed_grads:
                out["gradients"] += _new_bytes(p.grad.cached_data, seen)
        out["optimizer_state"] = sum(o.state_bytes() for o in self.optimizers)
        return out


def _new_bytes(array, seen):
    """Bytes of `array`'s whole buffer the first time it is seen (views of one buffer count once)."""
    if array is None:
        return 0
    buffer = getattr(array, "buffer", array)  # an NDArray's flat buffer; a NumPy array (NEEDLE_BACKEND=np) as is
    if id(buffer) in seen:
        return 0
    seen.add(id(buffer))
    return int(buffer.size * buffer.itemsize)


def _numpy_dtype(name):
    return ml_dtypes.bfloat16 if name == "bfloat16" else name


def head_width(modules):
    """The widest output of a Linear that widens its input (an LM head's vocabulary), or None."""
    widths = [m.out_features for m in modules if type(m).__name__ == "Linear" and m.out_features > m.in_features]
    return max(widths) if widths else None


@dataclasses.dataclass
class Snapshot:
    """The moment of a peak: the log's length then, whether backward had begun, whether backward's seed was counted,
    and the device bytes of the stored copies alive."""
    position: int
    in_backward: bool
    seed_counted: bool
    held: list


class StepLedger(Ledger):
    """The ledger of a predicted step: as Ledger, and at each new peak of the whole step (the start's bytes less
    those freed, plus what the walk holds) which values are alive, with their categories."""

    def __init__(self, predictor, root, out_grad, stores=None, gradient_store=None):
        self.predictor, self.owner, self.state_made = predictor, {}, 0
        self.phase, self.log = "forward", []  # the log: (buffer, made alive or let go), in order
        super().__init__(root, out_grad, stores, gradient_store)
        for node in find_topo_sort([root]):  # leaves with a buffer exist at the start: in its bytes already
            if node.is_leaf() and node.cached_data is not None:
                for key in self.buffers[id(node)]:
                    if self.holders.get(key) and self.size[key]:
                        self.live -= self.size[key]
                    self.size[key] = 0
        self.out_grad = out_grad
        # backward's seed (the loss's gradient) is made by backward(): in lazy mode before the forward pass it runs,
        # in eager mode after the forward pass ran; there it is counted from backward's start (`in_backward`)
        self.seed = [(key, self.size[key]) for key in self.buffers[id(out_grad)]]
        self.seed_bytes = sum(size for _, size in self.seed)
        if predictor.eager:
            for key, size in self.seed:
                self.live -= size
                self.size[key] = 0
        else:
            self.seed = []
        self.extra = 0  # bytes of the loose constants alive now (Predictor.loose)
        if not predictor.eager:  # lazy: the forward pass runs inside backward(), when those alive then are
            self.hold_constants(predictor.backward_at)

    def hold_constants(self, index):
        """Count the loose constants alive when the index-th value was made."""
        extra = sum(b for made, freed, b, *_ in self.predictor.loose
                    if made <= index and (freed is None or freed > index))
        self.live += extra - self.extra
        self.extra = extra

    @property
    def in_backward(self):
        return self.__dict__.get("_in_backward", False)

    @in_backward.setter
    def in_backward(self, value):
        self._in_backward = value
        for key, size in self.__dict__.get("seed", []) if value else []:
            self.size[key] = size
            self.live += size
        if value:
            self.seed = []
            if self.predictor.eager:  # the constants alive when backward() was called (M_act counts those)
                held = self.extra
                self.hold_constants(self.predictor.backward_at)
                self.forward_live += self.extra - held

    def _own(self, node):
        super()._own(node)
        for key in self.buffers[id(node)]:
            self.owner[key] = (node, self.phase)

    def _note_peak(self, workspace=0):
        super()._note_peak(workspace)
        self.predictor.note_ledger(self, self.phase, workspace, self.seen[-1] if self.seen else None)

    def recompute(self, node, passing=False):
        phase, self.phase = self.phase, "recompute"
        super().recompute(node, passing)
        self.phase = phase

    def compute(self, node):
        if self.in_backward and self.phase == "forward":
            self.phase = "backward"
        elif not self.in_backward and self.predictor.eager:  # eager: the constants alive when it was made
            self.hold_constants(self.predictor.index_of.get(id(node), self.predictor.backward_at))
        super().compute(node)

    def set_grad(self, node, grad):
        self.predictor.free_grad(node)  # the step's old gradient goes when the new one is set
        super().set_grad(node, grad)

    def update(self, node):
        phase, self.phase = self.phase, "optimizer"
        self.predictor.see_optimizer(node.optimizer)
        state, workspace = node.optimizer.update_bytes(node)
        self.live += state
        self.state_made += state
        super()._note_peak(workspace)
        self.predictor.note_ledger(self, self.phase, workspace, node)
        self.live -= state
        self.state_made -= state
        super().update(node)
        self.phase = phase

    # A peak is noted often (in forward, at almost every op): what is alive then is kept as a position in the log
    # of buffers made alive and let go, and read back once, after the walk.
    def _hold(self, node):
        for key in self.buffers[id(node)]:
            self.holders[key] = self.holders.get(key, 0) + 1
            if self.holders[key] == 1:
                self.live += self.size[key]
                self.log.append((key, True))

    def _let_go(self, key):
        super()._let_go(key)
        if self.holders[key] == 0:
            self.log.append((key, False))

    def snapshot(self):
        held = [device for device, _ in self.held.values() if device]
        return [Snapshot(len(self.log), self.in_backward, not self.seed, held)]

    def alive_at(self, snap):
        """[(node, bytes, category, reason)] of the buffers alive at `snap` (a buffer once, by its first owner)."""
        alive = {}
        for key, on in self.log[:snap.position]:
            if on:
                alive[key] = True
            else:
                alive.pop(key, None)
        seed = {key for key in self.buffers.get(id(self.out_grad), ())} if not snap.seed_counted else set()
        rows = []
        for key in alive:
            if self.size[key] > 0 and key not in seed:
                node, phase = self.owner.get(key, (None, None))
                rows.append((node, self.size[key], *self.category(node, phase, snap.in_backward)))
        return rows + [(None, device, "activations", "a stored copy on the device") for device in snap.held]

    def category(self, node, phase, in_backward):
        if node is None:
            return "other", ""
        if node is self.out_grad:
            return "gradients", "the seed of backward (the loss's gradient)"
        if node.is_leaf():
            return "inputs", "a constant the step made (a leaf Tensor that is not a Parameter)"
        if id(node) in self.predictor.forward_ids:
            if phase == "recompute":
                return "activations", "dropped in forward, recomputed"
            return "activations", "kept for backward" if in_backward else "a forward value"
        return "gradients", "made by backward"


class ModuleTracker:
    """memory_hook.RECORDER during a dry run, for one thing: the module each graph value was built in."""

    def __init__(self, predictor):
        self.predictor, self.modules, self.roots = predictor, [], {}
        self.backward_module = None

    def node_made(self, node):
        self.predictor.made.append(id(node))
        module = self.modules[-1] if self.modules else self.backward_module
        if node.op is not None and module is not None:
            self.predictor.module_of[id(node)] = module

    def in_module(self, module):
        return ModuleScope(self, module)  # (it keeps `modules` and `roots` as the recorder's)

    def enter_phase(self, name, owner=None):
        return None

    def exit_phase(self, previous, owner=None):
        pass

    def allocating_state(self, optimizer):
        return contextlib.nullcontext()

    def allocated(self, array):
        pass

    def differentiating(self, node):
        """run_backward's step for `node`: the gradients it builds belong to `node`'s module."""
        self.backward_module = self.predictor.module_of.get(id(node))

    def brought_back(self, node):
        pass

    def parked(self, node, nbytes):
        pass
