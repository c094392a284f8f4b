"""Compressed saved activations: what backward reads, kept in k bits per element instead of 32 (ActNN, GACT).

Checkpointing drops a value and recomputes it; offloading parks it in host memory. Compression is a third way out
for what a policy keeps: after its last forward use the value is kept as k-bit codes on the device, one float32
scale per block of 256 elements, its full-precision buffer given back; backward rebuilds it from the codes just
before the gradient that reads it (Chen et al. 2021, "ActNN"; Liu et al. 2022, "GACT").

    model.enable_gc(policy=checkpoint.compress(bits=8))                      # keep everything, compressed
    model.enable_gc(policy=checkpoint.compress(bits=8, policy="selective"))  # selective's checkpoints, compressed

It rides on offloading's machinery (offload.py): a compressed value is marked with a `Codec` instead of for host
memory, parked when the forward pass gives it back (`Codec.encode`: the backends' quantize_stochastic) and fetched
in backward (`Codec.decode`: dequantize_linear), one step ahead of its gradient, like a value parked on the host.

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
value exact, and so does any value not float32. The choice is made per region as it is annotated, from the readers
the region shows; backward checks it again when it starts, on the whole graph (backward.settle_compressed, rule 4d):
a compressed value with a reader that does not allow it (one outside the region, added later) is recomputed
exactly instead, so a rebuilt value only ever reaches the gradients named above.

Around a checkpointing policy ("selective", "sqrt", "all", a Budget) the values it keeps are its checkpoints, and
backward recomputes what it dropped from them: from the rebuilt value, where the checkpoint is compressed. The
recomputation is exact given its inputs (rule 4 still checks shapes, dtypes and versions), so what the gradients
read is a smooth function of the compressed checkpoint: unbiased to first order, as FIRST_ORDER's. Rule 4d asks
the readers of what is recomputed from a compressed checkpoint too: a ReLU recomputed from it (a step function:
its mask would flip near 0) sends the checkpoint back to exact.

A kept value that no gradient reads and no recomputation starts from is dropped instead: nothing in backward will
ask for it (in an eager step it would otherwise wait for backward's start to be freed). A view of a compressed
value is dropped too (it would hold the full buffer): backward recomputes it from the rebuilt value. A region's
outputs (rule 1 keeps them: they are the next region's inputs) are decided once the whole graph exists, when it is
first realized: a lazy step then parks each after its last consumer; an eager one, whose forward has run, as
backward starts (so an eager M_act still holds them).

Deterministic: the rounding noise of element i of a value is a hash of (the value's seed, i) (src/README.md), and a
value's seed is the policy's `seed` and how many values it compressed before it. So a rerun — the same seed, a fresh
model and a fresh policy — gives the same bytes, and so does compressing a value again. `state_dict()` carries that
count, so a run resumed from a checkpoint (gc.py --resume) draws the noise the unbroken run would have drawn.

Around a Budget, a region is compressed once the Budget has decided it (a structure it has not planned yet runs as
the Budget plans it, uncompressed). The Budget's ledger does not know which of what it keeps will be compressed: it
counts those values whole. That is not a proof of the bound: while a value is being compressed or rebuilt, its
codes and the whole value coexist, so a peak that falls exactly there could exceed the uncompressed prediction by
the codes' bytes (a quarter of the value at 8 bits), which the Budget's 1% margin may not cover; in the tests the
measured M_peak stays under b at every step (tests/test_compress.py). The ledger itself can count the codes
(`walk_step(..., compressed=...)`: within 1% of the allocator), but the Budget does not plan with them yet.
"""
import itertools
import math
import weakref
from dataclasses import dataclass

from . import offload
from .autograd import (defer_until_realized, element_dtype, element_shapes, find_topo_sort, infer_spec, itemsize,
                       release)
from .backend_selection import array_api
from .backward import always_kept, reads
from .ledger import view_copies
from .regions import note_reason, region_structure

__all__ = ["BLOCK_SIZE", "BITS", "Codec", "Compress", "FIRST_ORDER", "TupleCodec", "UNBIASED", "compressed_bytes",
           "is_codec"]

BLOCK_SIZE = 256  # elements per scale: 4 bytes per 256 elements, 1.6% of a float32 value
BITS = (2, 4, 8)  # bits per element a codec may keep (ActNN goes down to 2)
UNBIASED = frozenset({"MatMul", "Linear", "LinearActivation"})  # gradients linear in the saved input
FIRST_ORDER = frozenset({"LayerNorm", "ScaledDotProductAttention", "LinearCrossEntropy"})  # unbiased to first order


@dataclass(frozen=True)
class Codec:
    """How one array is kept: `bits`-bit linear codes with stochastic rounding, a scale per `block_size` elements,
    its noise from `seed`."""

    bits: int
    seed: int
    block_size: int = BLOCK_SIZE

    def allows(self, op):
        """Whether a gradient of `op` may read the rebuilt value (UNBIASED, FIRST_ORDER): backward.settle_compressed."""
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
class TupleCodec:
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
    """Whether a policy's flag asks to keep a value compressed (a Codec or TupleCodec)."""
    return isinstance(flag, (Codec, TupleCodec))


def _nbytes(array):
    return int(array.size) * array.itemsize


def compressed_bytes(n, bits, block_size=BLOCK_SIZE):
    """Device bytes of a compressed value of n elements: the packed codes and the block scales."""
    return -(-n * bits // 8) + 4 * -(-n // block_size)


class Compress:
    """A policy that keeps what `policy` keeps, compressed where the gradients reading it allow (module doc)."""

    def __init__(self, bits=8, policy=None, seed=0):
        if isinstance(bits, bool) or bits not in BITS:
            raise ValueError(f"checkpoint.compress: bits must be one of {BITS}, got {bits!r}")
        if policy is not None and not callable(policy):
            raise TypeError(f"Compress: policy must be a policy callable or None, got {policy!r} (checkpoint.compress "
                            f"takes a policy's name)")
        self.bits, self.seed = bits, int(seed)
        self.policy = policy  # None: keep everything
        self.values_compressed = 0  # so far: each value's seed is the policy's and this count before it
        # Regions' outputs waiting for their graph to be realized (or differentiated): number -> a weak reference
        # that removes itself when its value dies (an eval forward that never runs backward leaves nothing here).
        self._outputs, self._numbers = {}, itertools.count()

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
        flags = [True] * len(nodes) if self.policy is None else list(self.policy(nodes, outputs))
        if self._waits_for_a_plan(nodes):
            return flags
        head, tail = flags[:len(nodes)], flags[len(nodes):]  # (a policy may answer for the outputs too)
        for o in outputs if not tail else ():  # who reads a region's output is known once its graph is whole
            if not o.is_leaf() and not always_kept(o):
                number, pending = next(self._numbers), self._outputs
                pending[number] = weakref.ref(o, lambda _, number=number: pending.pop(number, None))
                defer_until_realized(o, self._decide_outputs)
        return self.choose(nodes, outputs, head) + tail

    def _decide_outputs(self, roots):
        """Compress the regions' outputs (rule 1 keeps them) where the whole graph's gradients allow: a lazy step
        parks each after its last consumer, an eager one (whose forward has run) at once, as backward starts.
        (backward.settle_compressed checks the choice again when backward starts, on the graph as it is then.)"""
        if not self._outputs:  # the first output of a graph decided them all
            return
        order = find_topo_sort(roots)
        in_graph = {id(n) for n in order}
        pending = []
        for number, ref in list(self._outputs.items()):  # those of this graph; another graph's wait for theirs
            o = ref()
            if o is not None and id(o) in in_graph:
                del self._outputs[number]
                pending.append(o)
        graph = _Region.of_graph(order)
        for o in pending:
            if o.drop:
                continue
            fate = graph.fate(o)
            if fate and fate != "unread":
                o.drop = True
                offload.mark(o, self._codec(fate))
                note_reason(o, "compressed")
                offload.release_value(o)  # (computed: eager) compressed now; (lazy) after its last consumer
                for v in graph.viewed(o)[1:]:  # a kept view of it would hold its buffer
                    if not v.drop and not view_copies(v) and graph.gives_way(v):
                        v.drop = True
                        release(v)

    def _waits_for_a_plan(self, nodes):
        planned = getattr(self.policy, "planned", None)  # a Budget: its decisions come later, for this step
        if planned is None or not nodes:
            return False
        return region_structure(nodes) not in planned

    def choose(self, nodes, outputs, flags):
        """The flags with a codec for each kept value to compress, and False for each kept value nothing reads."""
        region = _Region(nodes, outputs, flags)
        for i in reversed(range(len(nodes))):  # consumers first: a value's fate depends on theirs
            node = nodes[i]
            if region.flags[i] is not True or (_view_op(node) and not view_copies(node)):
                continue
            fate = region.fate(node)
            if fate == "unread":
                region.drop_unread(i)
            elif fate:
                region.flags[i] = self._codec(fate)
        for i, node in enumerate(nodes):  # a kept view of a compressed (or dropped) value would hold its buffer
            if region.flags[i] is True and _view_op(node) and not view_copies(node) and region.gives_way(node):
                region.flags[i] = False
        return region.flags

    def _codec(self, elements):
        """A Codec for an array (`elements` True), a TupleCodec for a tuple (`elements`: a flag per element)."""
        def one():
            self.values_compressed += 1
            return Codec(self.bits, (self.seed * 1000003 + self.values_compressed - 1) & 0xFFFFFFFF)
        return one() if elements is True else TupleCodec(tuple(one() if e else None for e in elements))


class _Region:
    """A region's candidates, flags and consumers, for `Compress.choose`."""

    def __init__(self, nodes, outputs, flags, order=None):
        self.nodes, self.flags, self.unread = nodes, list(flags), set()
        self.position = {id(n): i for i, n in enumerate(nodes)}
        # Who reads what: the walk from the outputs through the candidates and the values inner regions dropped
        # (they are recomputed from what they read), stopping at the region's inputs.
        if order is None:
            inside = {id(n) for n in nodes} | {id(o) for o in outputs}
            order = find_topo_sort(list(outputs), expand=lambda n: id(n) in inside or n.drop)
        self.consumers = {}
        for n in order:
            for x in n.inputs:
                self.consumers.setdefault(id(x), []).append(n)

    @classmethod
    def of_graph(cls, order):
        """The whole graph as one region without candidates: its consumers only."""
        return cls([], [], [], order)

    def drop_unread(self, i):
        self.flags[i] = False  # nothing in backward asks for it
        self.unread.add(id(self.nodes[i]))

    def recomputed(self, node):
        """Whether backward may recompute `node`: this policy drops it (not as a value nothing reads), or an inner
        region dropped it (and did not park it)."""
        i = self.position.get(id(node))
        if i is not None:
            return self.flags[i] is False and id(node) not in self.unread
        return node.drop and not offload.is_marked(node)

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
        """Whether a kept view should be dropped: the value it views is dropped or compressed (here, or by an inner
        region), and what reads the view may read a rebuilt value."""
        base = _base(view)
        j = self.position.get(id(base))
        flag = self.flags[j] if j is not None else None
        if flag is False:
            return True
        if not (is_codec(flag) or (j is None and offload.is_compressed(base))):
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
            return True if allowed and (not own or 0 in node.op.compressible_outputs) else None
        getters = self.consumers.get(id(node), [])
        if any(type(g.op).__name__ != "TupleGetItem" for g in getters):
            return None  # read whole (a tuple of gradients, say): kept as it is
        elements = []
        for k in range(len(shapes)):
            seen = [v for g in getters if g.op.index == k for v in self.viewed(g)]
            users, readers = self.readers(seen)
            elements.append(str(element_dtype(spec[1], k)) == "float32" and all(map(_reader_allows, readers))
                            and (not own or k in node.op.compressible_outputs))
        return elements if any(elements) else None


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

