"""Compressed saved activations: what backward reads, kept in k bits per element instead of 32 (ActNN, GACT).

Checkpointing drops a value and recomputes it; offloading parks it in host memory. Compression is a third way out
for what a policy keeps: after its last forward use the value is kept as k-bit codes on the device, one float32
scale per block of 256 elements, its full-precision buffer given back; backward rebuilds it from the codes just
before the gradient that reads it (Chen et al. 2021, "ActNN"; Liu et al. 2022, "GACT").

    model.enable_gc(policy=checkpoint.compress(bits=8))                      # keep everything, compressed
    model.enable_gc(policy=checkpoint.compress(bits=8, policy="selective"))  # selective's checkpoints, compressed

A `Codec` is a `Store` (needle/store.py), as offloading's host memory is: the policy answers a codec for a value,
the forward pass `put`s it there when it gives the value back (`Codec.encode`: the backends' quantize_stochastic),
and backward brings it back (`Codec.decode`: dequantize_linear) one step ahead of its gradient.

Which values, and why the gradient stays unbiased. A kept value is compressed only where every gradient that reads
it (through views: a reshape or transpose of it is read as it is) is one of:
- `UNBIASED`: matmul and the linear layers (MatMul, Linear, LinearActivation), whose weight gradient x^T dy is
  linear in the saved input x. Stochastic rounding makes each code's expectation the value itself
  (E[x̂] = x: rounded up with probability equal to x's distance from the grid point below), so
  E[x̂^T dy] = x^T dy: the gradient is unbiased, only noisier;
- `FIRST_ORDER`: layer norm, fused attention and the fused LM head (LayerNorm, ScaledDotProductAttention,
  LinearCrossEntropy), whose gradients are not linear in what they read: there E[g(x̂)] = g(x) + O(scale²), a bias
  of the order of the rounding noise's variance, (absmax / 127)² at 8 bits, which ActNN and GACT find harmless.
Anything else (an element-wise op reading its own output, a ReLU's mask: rounding could flip a sign) keeps its
value exact, and so does any value not float32. The choice is made once, when backward starts, on the whole graph
(rule 4d, `_Graph.approximation_allowed`): a value with a reader that does not allow it stays as the policy left
it, so a rebuilt value only ever reaches the gradients named above — and compression never makes backward
recompute more than the policy it wraps (it only ever replaces a kept value by its codes).

Around a checkpointing policy ("selective", "sqrt", "all", a Budget) the values it keeps are its checkpoints, and
backward recomputes what it dropped from them: from the rebuilt value, where the checkpoint is compressed. The
recomputation is exact given its inputs (rule 4 still checks shapes, dtypes and versions), so what the gradients
read is a smooth function of the compressed checkpoint: unbiased to first order, as FIRST_ORDER's. Rule 4d asks
the readers of what is recomputed from a compressed checkpoint too: a ReLU recomputed from it (a step function:
its mask would flip near 0) keeps the checkpoint exact.

A kept value that no gradient reads and no recomputation starts from is dropped instead: nothing in backward will
ask for it. A view of a compressed value is dropped too (it would hold the full buffer): backward recomputes it
from the rebuilt value. A region's outputs (rule 1 keeps them: they are the next region's inputs) are decided like
the rest. A lazy step, decided before anything is computed, compresses each value after its last forward consumer;
an eager one, whose forward has run, compresses them all as backward starts (its forward holds them exact).

Deterministic: the rounding noise of element i of a value is a hash of (the value's seed, i) (src/README.md), and a
value's seed is the policy's `seed` and how many values it compressed before it. So a rerun — the same seed, a fresh
model and a fresh policy — gives the same bytes, and so does compressing a value again. `state_dict()` carries that
count, so a run resumed from a checkpoint (gc.py --resume) draws the noise the unbroken run would have drawn.

Around a Budget, the Budget plans first (at the same moment), then what it keeps is compressed. The Budget's ledger
does not know which of what it keeps will be compressed: it counts those values whole. That is not a proof of the
bound: while a value is being compressed or rebuilt, its codes and the whole value coexist, so a peak that falls
exactly there could exceed the uncompressed prediction by the codes' bytes (a quarter of the value at 8 bits); in
the tests the measured M_peak stays under b at every step (tests/toolbox/test_compress.py). The ledger itself can
count the codes (`walk_step(..., stores={id: codec})`: within 1% of the allocator), but the Budget does not plan
with them.
"""
import itertools
import math
import weakref
from dataclasses import dataclass

from ..autograd import defer_until_backward, element_dtype, element_shapes, find_topo_sort, infer_spec, itemsize
from ..backend_selection import array_api
from ..backward import always_kept, reads
from ..checkpoint import resolve_policy
from ..ledger import view_copies
from ..regions import apply_decision
from ..store import Store

__all__ = ["BLOCK_SIZE", "BITS", "Codec", "CodecStore", "Compress", "FIRST_ORDER", "TupleCodec", "UNBIASED",
           "compress", "compressed_bytes", "is_codec"]

BLOCK_SIZE = 256  # elements per scale: 4 bytes per 256 elements, 1.6% of a float32 value
BITS = (2, 4, 8)  # bits per element a codec may keep (ActNN goes down to 2)
UNBIASED = frozenset({"MatMul", "Linear", "LinearActivation"})  # gradients linear in the saved input
FIRST_ORDER = frozenset({"LayerNorm", "ScaledDotProductAttention", "LinearCrossEntropy"})  # unbiased to first order


_traffic = {"compressed_bytes": 0, "decompressed_bytes": 0}


class CodecStore(Store):
    """What the codecs share as stores: the value kept as codes on the device (`encode`), rebuilt by `decode`."""

    kind = "compressed"
    kept_until_last_use = False  # the codes go as soon as the value is rebuilt: device bytes, not needed again

    def detail(self):
        return f", {self.bits} bits"

    def put(self, node):
        stored = self.encode(node.cached_data)  # device buffers: the allocator counts them
        _traffic["compressed_bytes"] += self.nbytes(stored)
        return stored

    def get(self, node, stored):
        _traffic["decompressed_bytes"] += self.nbytes(stored)
        return self.decode(stored)  # an approximation of the forward's value

    def device_bytes(self, spec):
        return self.bytes_for(spec)

    @classmethod
    def take_traffic(cls):
        taken = dict(_traffic)
        _traffic.update(compressed_bytes=0, decompressed_bytes=0)
        return taken


@dataclass(frozen=True)
class Codec(CodecStore):
    """How one array is kept: `bits`-bit linear codes with stochastic rounding, a scale per `block_size` elements,
    its noise from `seed`."""

    bits: int
    seed: int
    block_size: int = BLOCK_SIZE

    def allows(self, op):
        """Whether a gradient of `op` may read the rebuilt value (UNBIASED, FIRST_ORDER): settle_compressed."""
        return _reader_allows_op(op)

    def encode(self, data):
        """(codes, scales, shape): the device arrays, `bits` bits per element plus 4 bytes per block."""
        codes, scales = array_api.quantize_stochastic(data, self.bits, self.block_size, self.seed)
        return codes, scales, tuple(data.shape)

    def decode(self, stored):
        codes, scales, shape = stored
        return array_api.dequantize_linear(codes, scales, shape, self.bits, self.block_size)

    def nbytes(self, stored):
        return _nbytes(stored[0]) + _nbytes(stored[1])

    def bytes_for(self, spec):
        """Device bytes of the codes of a value with this (shape, dtype, device) spec."""
        return compressed_bytes(math.prod(spec[0]), self.bits, self.block_size)


@dataclass(frozen=True)
class TupleCodec(CodecStore):
    """How a tuple value is kept: each element with its Codec, or as it is (None)."""

    codecs: tuple

    def allows(self, op):
        return _reader_allows_op(op)

    def encode(self, data):
        return tuple(x if c is None else c.encode(x) for c, x in zip(self.codecs, data))

    def decode(self, stored):
        return tuple(x if c is None else c.decode(x) for c, x in zip(self.codecs, stored))

    def nbytes(self, stored):
        return sum(_nbytes(x) if c is None else c.nbytes(x) for c, x in zip(self.codecs, stored))

    def bytes_for(self, spec):
        shapes, dtype = element_shapes(spec[0]), spec[1]
        return sum(math.prod(s) * itemsize(element_dtype(dtype, k)) if c is None else
                   compressed_bytes(math.prod(s), c.bits, c.block_size)
                   for k, (c, s) in enumerate(zip(self.codecs, shapes)))

    @property
    def bits(self):
        return min(c.bits for c in self.codecs if c is not None)


def is_codec(flag):
    """Whether a policy's decision asks to keep a value compressed (a Codec or TupleCodec)."""
    return isinstance(flag, CodecStore)


def _nbytes(array):
    return int(array.size) * array.itemsize


def compressed_bytes(n, bits, block_size=BLOCK_SIZE):
    """Device bytes of a compressed value of n elements: the packed codes and the block scales."""
    return -(-n * bits // 8) + 4 * -(-n // block_size)


class Compress:
    """A policy that keeps what `policy` keeps, compressed where the gradients reading it allow (module doc).

    At annotate it answers what `policy` answers, and remembers the values kept (and the region's outputs, which
    rule 1 keeps); it decides which of them to compress once, when backward starts (`autograd.defer_until_backward`),
    with the whole graph in view and after the policy it wraps has decided (a Budget plans at that moment too). So a
    value is compressed only where every gradient that reads it, or reads a value recomputed from it, may read an
    approximation (rule 4d); the others stay as `policy` left them, so compression never makes backward recompute
    more than `policy` does.
    """

    def __init__(self, bits=8, policy=None, seed=0):
        if isinstance(bits, bool) or bits not in BITS:
            raise ValueError(f"checkpoint.compress: bits must be one of {BITS}, got {bits!r}")
        if policy is not None and not callable(policy):
            raise TypeError(f"Compress: policy must be a policy callable or None, got {policy!r} (checkpoint.compress "
                            f"takes a policy's name)")
        self.bits, self.seed = bits, int(seed)
        self.policy = policy  # None: keep everything
        self.values_compressed = 0  # so far: each value's seed is the policy's and this count before it
        # The values waiting for backward's start: number -> (a weak reference that removes itself when its value
        # dies, whether it is a region's output). An eval forward that never runs backward leaves nothing here.
        self._waiting, self._numbers = {}, itertools.count()
        self._decided = None  # a weak reference to the root of the last backward whose graph was decided

    def __repr__(self):
        return f"compress(bits={self.bits}, policy={self.policy!r})"

    def state_dict(self):
        """What the next values' rounding noise depends on, for a checkpoint: the seed and the count so far."""
        return {"seed": self.seed, "values_compressed": self.values_compressed}

    def load_state_dict(self, state):
        """Go on from `state_dict()`'s count; the seed must be this policy's (a ValueError naming both if not)."""
        if not isinstance(state, dict) or set(state) != {"seed", "values_compressed"}:
            raise ValueError(f"Compress.load_state_dict: expected a dict with seed and values_compressed, got "
                             f"{state!r}")
        if int(state["seed"]) != self.seed or int(state["values_compressed"]) < 0:
            raise ValueError(f"Compress.load_state_dict: the state has seed {state['seed']} and count "
                             f"{state['values_compressed']}; this policy's seed is {self.seed}")
        self.values_compressed = int(state["values_compressed"])

    def __call__(self, nodes, outputs=()):
        decisions = [True] * len(nodes) if self.policy is None else list(self.policy(nodes, outputs))
        answered_outputs = len(decisions) > len(nodes)  # (a policy may answer for the outputs too)
        for n, decision in zip(nodes, decisions):
            if isinstance(decision, bool) and decision:
                self._wait(n, output=False)
        for o in () if answered_outputs else outputs:
            if not o.is_leaf() and not always_kept(o):
                self._wait(o, output=True)
        first = (list(nodes) or list(outputs))[:1]
        for n in first:
            defer_until_backward(n, self._at_backward)
        return decisions

    def _wait(self, node, output):
        number, waiting = next(self._numbers), self._waiting
        waiting[number] = (weakref.ref(node, lambda _, number=number: waiting.pop(number, None)), output)

    def _at_backward(self, roots):
        """Decide, once per graph, which waiting values to compress: consumers first (a value's fate depends on
        theirs), each where its readers and what is recomputed from it allow (rule 4d)."""
        if self._decided is not None and self._decided() is roots[0]:
            return
        self._decided = weakref.ref(roots[0])
        order = find_topo_sort(roots)
        position = {id(n): i for i, n in enumerate(order)}
        waiting = []
        for number, (ref, output) in list(self._waiting.items()):  # this graph's; another graph's wait on
            v = ref()
            if v is not None and id(v) in position:
                del self._waiting[number]
                waiting.append((v, output))
        waiting.sort(key=lambda pair: -position[id(pair[0])])
        graph = _Graph(order)
        for v, output in waiting:
            if v.drop or (_view_op(v) and not view_copies(v)):  # dropped by the policy; a view goes with its base
                continue
            fate = graph.fate(v)
            if fate == "unread" and not output:
                graph.drop_unread(v)  # nothing in backward asks for it
            elif fate and fate != "unread" and graph.approximation_allowed(v, fate):
                apply_decision(v, self._codec(fate))  # (computed: eager) compressed now; (lazy) after its last use
        for v, _ in waiting:  # a kept view of a compressed (or dropped) value would hold its buffer
            for view in graph.viewed(v) if v.store is not None or v.drop else ():
                if not view.drop and _view_op(view) and not view_copies(view) and graph.gives_way(view):
                    apply_decision(view, False)

    def _codec(self, elements):
        """A Codec for an array (`elements` True), a TupleCodec for a tuple (`elements`: a flag per element)."""
        def one():
            self.values_compressed += 1
            return Codec(self.bits, (self.seed * 1000003 + self.values_compressed - 1) & 0xFFFFFFFF)
        return one() if elements is True else TupleCodec(tuple(one() if e else None for e in elements))


class _Graph:
    """Who reads what in a whole graph, for `Compress`: consumers, readers, and what backward recomputes."""

    def __init__(self, order):
        self.consumers, self.unread = {}, set()
        for n in order:
            for x in n.inputs:
                self.consumers.setdefault(id(x), []).append(n)

    def drop_unread(self, node):
        apply_decision(node, False)
        self.unread.add(id(node))

    def recomputed(self, node):
        """Whether backward may recompute `node`: dropped, into no store, and read by something."""
        return node.drop and node.store is None and id(node) not in self.unread

    def viewed(self, node):
        """`node` and its views among its consumers, transitively."""
        found, stack = [], [node]
        while stack:
            v = stack.pop()
            found.append(v)
            stack.extend(u for u in self.consumers.get(id(v), ()) if _view_op(u))
        return found

    def readers(self, seen):
        """(the consumers of the values `seen` (a value and its views) that are not views, those whose gradients
        read one of them)."""
        ids = {id(v) for v in seen}
        users = [u for v in seen for u in self.consumers.get(id(v), ()) if not _view_op(u)]
        return users, [u for u in users if any(id(r) in ids for r in reads(u))]

    def gives_way(self, view):
        """Whether a kept view should be dropped: the value it views is dropped or compressed, and what reads the
        view may read a rebuilt value."""
        base = _base(view)
        if base.drop and base.store is None:
            return True
        if not is_codec(base.store):
            return False
        return all(map(_reader_allows, self.readers(self.viewed(view))[1]))

    def fate(self, node):
        """"unread", None (kept exact), True (an array to compress) or a flag per element (a tuple)."""
        spec = infer_spec(node)
        if spec is None:
            return None
        shapes = element_shapes(spec[0])
        own = any(r is node for r in reads(node))  # its own gradient reads its output
        if shapes is None:
            users, readers = self.readers(self.viewed(node))
            if not readers and not own and not any(map(self.recomputed, users)):
                return "unread"  # (a value a recomputation starts from is a checkpoint: compressed, not dropped)
            allowed = str(spec[1]) == "float32" and all(map(_reader_allows, readers))
            return True if allowed and (not own or 0 in compressible_outputs(node.op)) else None
        getters = self.consumers.get(id(node), [])
        if any(type(g.op).__name__ != "TupleGetItem" for g in getters):
            return None  # read whole (a tuple of gradients, say): kept as it is
        elements = []
        for k in range(len(shapes)):
            seen = [v for g in getters if g.op.index == k for v in self.viewed(g)]
            users, readers = self.readers(seen)
            elements.append(str(element_dtype(spec[1], k)) == "float32" and all(map(_reader_allows, readers))
                            and (not own or k in compressible_outputs(node.op)))
        return elements if any(elements) else None

    def approximation_allowed(self, value, fate):
        """Rule 4d: whether every gradient that would read `value` rebuilt from codes, or read a value backward
        recomputes from it, allows an approximation (UNBIASED, FIRST_ORDER). A tuple's exact elements (`fate`'s
        False flags) are no approximation."""
        exact_elements = set() if fate is True else {k for k, e in enumerate(fate) if not e}
        stack, seen = [value], {id(value)}
        while stack:  # the values derived from the rebuilt one: its views and what backward recomputes from it
            w = stack.pop()
            if any(r is w for r in reads(w)) and not (w is value and _own_read_allowed(value, exact_elements)):
                return False
            for u in self.consumers.get(id(w), ()):
                if w is value and u.op.view and getattr(u.op, "index", None) in exact_elements:
                    continue  # an exact element of a compressed tuple
                if any(r is w for r in reads(u)) and not _reader_allows(u):
                    return False
                if (u.op.view or self.recomputed(u)) and id(u) not in seen:
                    seen.add(id(u))
                    stack.append(u)
        return True


def _reader_allows(node):
    """Whether `node`'s gradient may read a compressed copy of its inputs (UNBIASED, FIRST_ORDER)."""
    return _reader_allows_op(node.op)


def _reader_allows_op(op):
    return type(op).__name__ in UNBIASED | FIRST_ORDER


def _view_op(node):
    return node.op is not None and node.op.view


def _base(node):
    while _view_op(node):
        node = node.inputs[0]
    return node



def compress(bits=8, policy=None, seed=0):
    """A policy: what `policy` keeps for backward (None: everything; a name, a segment policy, a Budget or any
    callable) kept as `bits`-bit codes (2, 4 or 8) where the gradients reading it allow, the rest exact; `seed`
    picks the rounding noise (this module's doc says which values, and why the gradients stay unbiased).

        model.enable_gc(policy=checkpoint.compress(8))               # everything kept, compressed
        model.enable_gc(policy=checkpoint.compress(8, "selective"))  # selective's checkpoints, compressed
    """
    return Compress(bits, None if policy is None else resolve_policy(policy), seed)


# ----- rule 4d: a rebuilt value reaches only the gradients that allow it -------------------------------------------
def _own_read_allowed(node, exact_elements):
    """A gradient reading its own output reads a compressed copy only through `compressible_outputs`."""
    elements = element_shapes(infer_spec(node)[0])
    compressed = {k for k in range(len(elements or [None])) if k not in exact_elements}
    return compressed <= set(compressible_outputs(node.op))


def compressible_outputs(op):
    """The elements of `op`'s own output (0 for a plain Tensor) that its gradient reads at most linearly, if it
    reads its output: a compressed copy of them leaves the gradient unbiased. Usually none; an op declares them in
    a `compressible_outputs` attribute (the few-bit activations: f(x), read by no gradient of theirs)."""
    return getattr(op, "compressible_outputs", ())
