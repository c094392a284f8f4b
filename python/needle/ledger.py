"""The Budget's ledger: a backward machine that computes nothing and counts the bytes a step would hold.

`Ledger` implements `autograd.Machine` like `backward.Compute`, so `walk_step` runs the very realization and
backward plan the executor will run (`autograd.realize`, `backward.plan_backward`, `backward.run_backward`) and
only counts: the device buffers alive, their peak, and the bytes of the values stores hold (store.py).
checkpoint_budget.Budget plans on it.
"""
import math

from .autograd import (Machine, element_dtype, element_shapes, elements_of, find_topo_sort, infer_spec, itemsize,
                       placeholder, realize, spec_nbytes)
from .backend_ndarray.ndarray import compact_strides  # the strides NDArray gives a compact array
from .backend_ndarray.ndarray import is_transposed_matrix  # the views a 2-D matmul reads in place
from .backward import plan_backward, run_backward
from .ops import MakeTensorTuple, TupleGetItem

__all__ = ["Ledger", "predict_peak", "required_spec", "value_bytes", "view_copies", "walk_step", "holds_base"]


def required_spec(node):
    """(shape, dtype, device) of `node` from shape inference; an error naming the op where it cannot infer it."""
    spec = infer_spec(node)
    if spec is None:
        raise RuntimeError(f"Budget: cannot infer the shape of {type(node.op).__name__} without computing it; "
                           f"give the op an infer_shape")
    return spec


class Ledger(Machine):
    """A backward machine that computes nothing: it tracks which values would exist and the bytes they hold.

    Memory is counted per buffer, as the allocator does: a view (`op.view`, and `op.view_strides` not None for
    its input's strides) holds its base's buffer; a tuple's elements are buffers of their own. Values that exist
    when the walk starts are leaves; those that require grad (parameters) are not counted (they are held before
    the step starts), the others (batch, masks, constants) are.

    `stores` ({id: Store}, store.py) are the dropped values put into a store instead of forgotten: the ledger counts
    the bytes the store says it takes for them (`device_bytes` on the device, `host_bytes` beside it) from the
    forward release that puts them to their last use in backward. With `gradient_store`, each parameter's complete
    gradient goes there (as a leaf's `store` makes backward.Compute do), unless a grad hook waits for it.
    """

    def __init__(self, root, out_grad, stores=None, gradient_store=None):
        self.present, self.holders, self.size, self.buffers, self.strides = set(), {}, {}, {}, {}
        self.elements = {}  # buffer -> its elements (size is 0 for parameters' buffers: they are not counted)
        self.live = self.peak = self.made = 0
        self.forward_peak = None  # walk_step: the peak of the forward pass
        self.forward_live = None  # walk_step: the bytes alive when backward begins
        self.forward_buffers = {}  # walk_step: each value's buffers when backward begins
        # When each buffer was made and freed in forward, on a clock that ticks at every compute and release, and
        # when forward peaked: the buffers freed before that moment are what keeping their values would add to it.
        self.clock, self.born, self.freed, self.forward_peak_clock, self.forward_clock = 0, {}, {}, 0, 0
        # Stores: which values go to one; the (device, host) bytes each stored copy holds now; the host bytes at
        # most; the host bytes put and brought back.
        self.stores, self.held = stores or {}, {}
        self.host_live = self.host_peak = self.host_bytes_out = self.host_bytes_back = 0
        self.gradient_store = gradient_store
        # The device bytes of the gradients stored so far, and the peak the same walk would reach were they kept:
        # nothing else differs, so one walk with a gradient store answers for both (the Budget's search uses it).
        self.gradients_stored_bytes = self.peak_keeping_gradients = 0
        self.in_backward = False  # as backward.Compute's: run_backward sets it
        self.grads = {}  # parameter id -> its gradient node (set_grad), until an update in backward releases it
        # A store that copies beside the compute holds a put's buffers until its next put or get: `in_flight`.
        self.device = infer_spec(out_grad)[2]
        self.in_flight = []
        self.seen = []  # every node the walk met, kept alive so that no id is reused while the ledger counts it
        self.specs = {}  # id -> (node, its spec): each node's shape inferred once per walk (the node kept alive)
        for node in find_topo_sort([root]) + [out_grad]:
            if node.is_leaf():
                self._own(node)
                self.present.add(id(node))
                if node.requires_grad and node is not out_grad:  # a parameter: held before the step, not counted
                    for key in self.buffers[id(node)]:
                        self.size[key] = 0
                self._hold(node)

    # -- buffers
    def spec(self, node):
        """required_spec(node), inferred once per walk."""
        known = self.specs.get(id(node))
        if known is None:
            known = self.specs[id(node)] = (node, required_spec(node))
        return known[1]

    def _own(self, node):
        """Fresh buffers for `node`'s value: one per tuple element, else one."""
        self.seen.append(node)
        shape, dtype, _ = self.spec(node)
        self.made += 1  # a recomputed value gets new buffers, even while views of its old ones are held
        elements = element_shapes(shape)  # a tuple value: one buffer per element
        keys = [(self.made, k) for k in range(len(elements or [shape]))]
        for k, (key, s) in enumerate(zip(keys, elements or [shape])):
            self.born[key] = self.clock
            self.elements[key] = math.prod(s)
            self.size[key] = math.prod(s) * itemsize(element_dtype(dtype, k))
        if elements is None:  # an array, compact: the ledger follows its views' strides
            self.strides[id(node)] = compact_strides(shape)
        self.buffers[id(node)] = keys

    def _alias(self, node):
        """The buffers a view's value lives in, or False if computing it makes a fresh buffer."""
        op = node.op
        if not op.view:
            return False
        if isinstance(op, MakeTensorTuple):  # packs its inputs' buffers
            self.buffers[id(node)] = [b for x in node.inputs for b in self.buffers[id(x)]]
            return True
        inp = node.inputs[0]
        if isinstance(op, TupleGetItem):  # an element of a tuple
            self.buffers[id(node)] = [self.buffers[id(inp)][op.index]]
            self.strides[id(node)] = compact_strides(self.spec(node)[0])
            return True
        strides = self.strides.get(id(inp))
        out = strides and op.view_strides(self.spec(inp)[0], strides, self.spec(node)[0])
        if out is None or strides is None:
            return False
        self.buffers[id(node)], self.strides[id(node)] = self.buffers[id(inp)], out
        return True

    def _hold(self, node):
        for key in self.buffers[id(node)]:
            self.holders[key] = self.holders.get(key, 0) + 1
            if self.holders[key] == 1:
                self.live += self.size[key]

    def _workspace(self, node):
        """Bytes compute allocates besides its result: declared temporaries (elements of the result's dtype) and
        compact copies of strided inputs (each in its input's dtype)."""
        shapes = [self.spec(x)[0] for x in node.inputs]
        extra = node.op.workspace(*shapes)
        compacted = node.op.compacts_inputs  # True (every input) or the positions of the inputs it compacts
        if element_dtype(self.spec(node)[1], 0) in ("float16", "bfloat16"):  # 16-bit entry points: compact operands
            extra += node.op.workspace_16bit(*shapes)
            compacted = compacted or getattr(node.op, "elementwise", False)  # (TensorOps have it)
        if not compacted and not extra:
            return 0  # most ops: nothing besides the result (the ledger's most frequent question, answered first)
        transposed_in_place = compacted and node.op.reads_transposed(*shapes)
        copies = 0
        for i, (x, shape) in enumerate(zip(node.inputs, shapes)):
            if compacted is True or (compacted and i in compacted):
                strides = self.strides.get(id(x))
                if strides is None or strides == compact_strides(shape):
                    continue
                if transposed_in_place and is_transposed_matrix(shape, strides) and self._whole_buffer(x, shape):
                    continue
                copies += elements_of(shape) * itemsize(element_dtype(self.spec(x)[1], 0))
        return extra * itemsize(element_dtype(self.spec(node)[1], 0)) + copies

    def _whole_buffer(self, node, shape):
        keys = self.buffers[id(node)]
        return len(keys) == 1 and self.elements[keys[0]] == math.prod(shape)

    # -- the machine (autograd.Machine), as backward.Compute
    def has(self, node):
        if id(node) in self.present:  # (the ledger's most frequent question, answered first)
            return True
        if node.is_leaf():  # a constant a gradient made: it exists, and counts
            self._own(node)
            self.present.add(id(node))
            self._hold(node)
            return True
        return False

    def compute(self, node):
        self.clock += 1
        if not self._alias(node):
            self._own(node)
        self.seen.append(node)
        self.present.add(id(node))
        self._hold(node)
        self._note_peak(self._workspace(node))

    def recompute(self, node, passing=False):
        self.compute(node)

    def _note_peak(self, workspace=0):
        if self.live + workspace > self.peak and not self.in_backward:
            self.forward_peak_clock = self.clock
        self.peak = max(self.peak, self.live + workspace)
        self.peak_keeping_gradients = max(self.peak_keeping_gradients,
                                          self.live + workspace + self.gradients_stored_bytes)

    def bring_back(self, node):
        """A stored value back in memory: a fresh device buffer, its stored copy still held (store.py)."""
        self.settle_copy()
        self._own(node)
        self.present.add(id(node))
        self._hold(node)
        self.host_bytes_back += self.held[id(node)][1]
        self._note_peak()
        if not self.stores[id(node)].kept_until_last_use:  # as backward.Compute: the stored copy goes at once
            device, host = self.held.pop(id(node))
            self.live -= device
            self.host_live -= host

    def release(self, node):
        """As autograd.release: a value with a store is put there on its first release (forward), and its stored
        copy goes with its last (backward)."""
        if id(node) in self.held:
            if self.in_backward:
                device, host = self.held.pop(id(node))
                self.live -= device
                self.host_live -= host
        elif id(node) in self.stores and id(node) in self.present and not self.in_backward:
            self._put(node, self.stores[id(node)])
        if id(node) not in self.present:
            return
        self.clock += 1
        self.present.discard(id(node))
        for key in self.buffers[id(node)]:
            self._let_go(key)

    def _put(self, node, store):
        """`store` takes `node`'s value: its stored copy's bytes from now on (made while the value is there)."""
        spec = self.spec(node)
        device, host = store.device_bytes(spec), store.host_bytes(spec)
        self.held[id(node)] = (device, host)
        self.live += device
        self._note_peak()
        self.host_live += host
        self.host_bytes_out += host
        self.host_peak = max(self.host_peak, self.host_live)
        if store.holds_while_copying(self.device):  # the copy reads the buffers until the next put or get
            self.settle_copy()
            self.in_flight = list(self.buffers[id(node)])
            for key in self.in_flight:
                self.holders[key] += 1

    def _let_go(self, key):
        self.holders[key] -= 1
        if self.holders[key] == 0:
            self.live -= self.size[key]
            self.freed[key] = self.clock

    def settle_copy(self):
        """The copy in flight is done: its buffers are no longer held by it."""
        for key in self.in_flight:
            self._let_go(key)
        self.in_flight = []

    def check_reads(self, node):
        pass

    def ready(self):
        pass

    def set_grad(self, node, grad):
        """As backward.Compute's: with a gradient store, a parameter's complete gradient goes there (unless a grad
        hook waits for it on the device)."""
        self.grads[id(node)] = grad
        if self.gradient_store is not None and not node._grad_hooks and id(grad) in self.present:
            live = self.live
            self._put(grad, self.gradient_store)
            self.held.pop(id(grad))  # (kept until the optimizer's update: beyond this walk)
            self.release(grad)
            self.gradients_stored_bytes += live - self.live

    def update(self, node):
        """As backward.Compute's: the optimizer's update in backward — the state it creates (on its first step),
        its workspace for a moment, then the gradient released."""
        state, workspace = node.optimizer.update_bytes(node)
        self.live += state
        self._note_peak(workspace)
        grad = self.grads.pop(id(node), None)
        if grad is not None:
            self.release(grad)

    def value(self, node):
        return None


def predict_peak(root, dropped, regions=None, stores=None, gradient_store=None):
    """Predicted M_peak of a step on the graph above `root` if the values whose ids are in `dropped` were dropped
    (those in `stores`, {id: Store}: put into that store and brought back, not recomputed).

    The forward pass is modelled as the executor runs it: lazy (`regions` None) — realization releases a dropped
    value after its last consumer; eager (`regions`: [(outputs, candidates)] in the order they ran) — every value
    lives until its region's output exists. Then the backward plan runs on the ledger; with `gradient_store`,
    parameters' gradients go there as they are completed. Nothing is computed.
    """
    return walk_step(root, dropped, regions, stores, gradient_store).peak


def walk_step(root, dropped, regions=None, stores=None, gradient_store=None, ledger=Ledger, order=None):
    """The Ledger after walking a step's forward and backward passes (see predict_peak): its device `peak`, its
    `host_peak`, the host bytes put (`host_bytes_out`) and brought back (`host_bytes_back`). `ledger`: the class
    (or a function of Ledger's arguments) that walks, Ledger or one that also notes more (ndl.memory.predict's);
    `order`: eager mode's, the order the values were made in (default: a topological order)."""
    out_grad = placeholder(required_spec(root))  # the root's gradient: its shape, dtype and device, no data
    ledger = ledger(root, out_grad, stores, gradient_store)
    if regions is None:
        realize([root], lambda n: id(n) not in dropped, ledger)
    else:
        ends, order = {}, order or find_topo_sort([root])
        for outputs, candidates in regions:
            ends.setdefault(id(outputs[-1]), []).extend(candidates)
        # A value dropped outside every region (autocast's cast of an activation) is computed for its consumer
        # and not kept, as realization does: released after its last consumer.
        in_regions = {id(n) for _, candidates in regions for n in candidates}
        last = {id(x): node for node in order for x in node.inputs if id(x) in dropped and id(x) not in in_regions}
        for node in order:
            if not ledger.has(node):
                ledger.compute(node)
            for n in ends.get(id(node), ()):
                if id(n) in dropped:
                    ledger.release(n)
            for x in node.inputs:
                if last.get(id(x)) is node:
                    ledger.release(x)
    ledger.forward_peak, ledger.forward_live = ledger.peak, ledger.live  # the forward pass alone
    ledger.forward_buffers = dict(ledger.buffers)
    ledger.forward_clock = ledger.clock
    run_backward(plan_backward(root, ledger.has, lambda n: id(n) in ledger.stores), out_grad, ledger)
    return ledger


def view_copies(node):
    """Whether a view op's value has a buffer of its own: its input's strides do not allow the view, so compute
    copied (a reshape of a transposed value), as the ledger's strides say."""
    chain = []
    while _is_view_op(node) and type(node.op).__name__ not in ("TupleGetItem", "MakeTensorTuple"):
        chain.append(node)
        node = node.inputs[0]
    specs = [infer_spec(n) for n in chain + [node]]
    if not chain or any(s is None or element_shapes(s[0]) is not None for s in specs):
        return False
    strides = compact_strides(tuple(specs[-1][0]))  # a value with its own buffer is compact
    for k in reversed(range(len(chain))):
        strides = chain[k].op.view_strides(tuple(specs[k + 1][0]), strides, tuple(specs[k][0]))
        if strides is None:
            if k == 0:
                return True
            strides = compact_strides(tuple(specs[k][0]))
    return False


def holds_base(node):
    """A view op whose value lives in its input's buffer (not one that copies: see view_copies)."""
    return _is_view_op(node) and not view_copies(node)


def _is_view_op(node):
    return node.op is not None and node.op.view


def value_bytes(node):
    """Bytes of `node`'s value, from its spec (nothing computed)."""
    return spec_nbytes(required_spec(node))
