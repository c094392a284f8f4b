"""The recorder behind `ndl.memory.record()`: every buffer the device allocator hands out or takes back, as an event.

A buffer is a `Block`. It is born in `allocated` (called by NDArray's constructors for each fresh buffer, through
`memory_hook`) and dies in `freed` (a weak reference's callback on the buffer object, which runs just after the
backend has given the bytes back), so the recorded live bytes follow the allocator's `current_bytes` event by event.
What a block *is* is learnt around it, from hooks that cost nothing when recording is off:

- the op computing when it was made (`computing`/`computed`, autograd's Compute): the op's result is its output,
  anything else it made is the op's workspace;
- the phase (`memory_hook.phase`): "forward" unless backward, a recomputation or an optimizer's step is running;
- the module (`memory_hook.module`, Module.__call__): the innermost module whose forward built the graph value;
  in backward, the module of the value being differentiated or recomputed;
- leaves (`node_made`): the data of a Parameter is a parameter, that of another leaf Tensor an input.

A block's category is settled by its phase and what it became (`CATEGORIES` below says how), some of it only later:
a forward value is "activation_kept" if it is still alive when backward starts (or when recording stops), else it
was a forward temporary ("workspace"); what an optimizer made and still holds when its step ends is its state.
"""
import contextlib
import gc
import itertools
import time
import weakref

from ... import memory_hook
from ...autograd import Value, infer_spec
from ...backend_ndarray import NDArray
from ...checkpoint import keep_reason
from ...nn import Parameter
from ...optim import Optimizer

# What each category means, in the words the plot's legend and the page's tooltip use.
CATEGORIES = {
    "parameter": "a Parameter's data",
    "gradient": "made by backward: a parameter's .grad, or a gradient on its way there",
    "optimizer_state": "what an optimizer keeps between steps (moments, master weights, quantized state)",
    "activation_kept": "a forward value still alive when backward starts: kept for backward (the reason says why), "
                       "or one offloaded to host memory and fetched back",
    "activation_recomputed": "a dropped value made again by backward (gradient checkpointing)",
    "workspace": "a temporary: made and given back within an op, a forward pass or an optimizer step",
    "input": "the data of a leaf Tensor that is not a Parameter (a batch, a constant)",
    "other": "anything else (made outside ops, or alive before recording began and not recognised)",
    "host": "an offloaded copy in host memory",
}
PHASES = ("forward", "backward", "recompute", "optimizer")


class Block:
    """One buffer of the device allocator, from its allocation to its free (event indices; `alloc` None: alive
    before recording began)."""

    __slots__ = ("id", "key", "bytes", "shape", "dtype", "category", "phase", "op", "module", "name", "reason",
                 "alloc", "free", "node", "ref", "forward_value")

    def __init__(self, number, buffer, array, phase, op, module, alloc):
        self.id, self.key, self.bytes = number, id(buffer), buffer.size * buffer.itemsize
        self.shape, self.dtype = tuple(array.shape), array.dtype
        self.phase, self.op, self.module, self.alloc = phase, op, module, alloc
        self.category, self.reason, self.free = "other", None, None
        self.name = None  # a parameter's dotted name ("blocks.0.attn.q.weight"), of its gradient or state
        self.node = None  # a weak reference to the graph value this buffer is the result of, if any
        self.ref = None  # the weak reference whose callback reports the free
        self.forward_value = False  # a forward op's result: its category is settled when backward starts


class RawBuffer:
    """A buffer held without an NDArray, described as one: its elements, flat."""

    __slots__ = ("buffer", "shape", "dtype")

    def __init__(self, buffer):
        self.buffer, self.shape, self.dtype = buffer, (buffer.size,), buffer.dtype


class HostCopy:
    """A parked value's host copy (offload.py), described as a buffer: its bytes, the value's shape and dtype."""

    __slots__ = ("buffer", "shape", "dtype", "size", "itemsize")

    def __init__(self, nbytes, node):
        self.buffer, self.size, self.itemsize = self, nbytes, 1
        self.shape, self.dtype = tuple(node.shape), node.dtype


class BufferRef(weakref.ref):
    """A weak reference to a buffer that knows its block (the callback gets only the reference)."""

    __slots__ = ("block",)


def buffers_of(value):
    """The ids of the device buffers behind `value`: a Tensor, an NDArray, or lists, tuples and dicts of them."""
    ids, stack = set(), [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Value):
            stack.append(item.cached_data)
        elif isinstance(item, NDArray):
            ids.add(id(item.buffer))
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return ids


class Recorder:
    """Collects the events of one `record()`; `Snapshot` reads `blocks`, `events` and `phase_changes`."""

    def __init__(self, device, check=False):
        self.device, self.check = device, check
        # events: (action, block, live bytes, seconds, backend's bytes or None, host bytes, reserved bytes or None)
        self.blocks, self.events = [], []
        self.live, self.live_bytes, self.baseline_bytes = {}, 0, 0  # live: id(buffer) -> Block
        self.phase, self.phase_changes = "forward", [("forward", 0)]  # (phase, index of the first event in it)
        self.op_node, self.op_blocks = None, []  # the value being computed, and the blocks made meanwhile
        self.modules, self.roots = [], {}  # the stack of modules whose forward runs; the outermost ones seen
        self.module_of = weakref.WeakKeyDictionary()  # graph value -> the module it belongs to
        self.backward_module = None  # in backward: the module of the value being differentiated
        self.parameters = weakref.WeakSet()
        self.active, self.start, self.backend_peak_bytes = False, None, None
        # Offloaded values' host copies (category "host", outside the device allocator): id(value) -> (a weak
        # reference to the value, its block); `host_bytes` is what they hold. live_bytes stays the device's.
        self.host, self.host_bytes = {}, 0
        # Whether the allocator reports what it holds resident (live + cached for reuse: "reserved_bytes"; the C++
        # and CUDA backends do): then every event reads it, so the timeline draws it above the live bands.
        self.reserved = "reserved_bytes" in device.memory_stats()

    # ----- on and off ----------------------------------------------------------------------------------------
    def begin(self):
        """Adopt what is alive, then switch on. The garbage collector is held off meanwhile: a collection between
        counting the allocator's bytes and switching on would free buffers no event reports. One recording at a
        time: a second inside it would take the allocator's events from the first (memory_hook has one recorder)."""
        if memory_hook.RECORDER is not None:
            raise RuntimeError("ndl.memory.record(): already recording (a record block inside another): the inner "
                               "block's events would be missing from the outer snapshot. Record one block at a time")
        self.start = time.perf_counter()
        gc.collect()  # earlier steps' garbage is given back now, not in the middle of the recorded one
        if self.check:  # the allocator's peak, from here, is the one the recorded peak must equal
            self.device.reset_peak_memory_stats()
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.adopt_existing_buffers()
            self.live_bytes = self.device.memory_stats()["current_bytes"]
            self.baseline_bytes = self.live_bytes - sum(b.bytes for b in self.blocks)
            self.previous = memory_hook.set_recorder(self)
            self.active = True
        finally:
            if collecting:
                gc.enable()

    def end(self):
        memory_hook.set_recorder(self.previous)
        self.active = False
        if self.host:
            self.settle_host()
        self.settle_parameters()
        for block in self.live.values():
            if block.forward_value:
                self.settle_forward_value(block, alive=True)
            block.ref = None  # no callback after the end: the snapshot is complete
        if self.check:
            self.backend_peak_bytes = self.device.memory_stats()["peak_bytes"]

    def adopt_existing_buffers(self):
        """Track the buffers alive before recording began, so that their frees are events too: found through the
        garbage collector's objects (NDArrays, and buffers held without one: a bucket, a flat shard), named where a
        Parameter, its gradient or an optimizer holds them. Bytes the allocator counts but nothing in Python holds
        stay in `baseline_bytes`."""
        names, arrays = {}, []
        objects = gc.get_objects()
        # What each type is, asked once per type (not isinstance per object: that would read __class__, which some
        # objects answer with a warning, and a program's heap holds tens of thousands of objects); the objects of
        # the types wanted are picked out in C (map and compress), not by a Python loop over every object.
        kinds = {t: next((k for k in (NDArray, Parameter, Optimizer) if issubclass(t, k)), None)
                 for t in set(map(type, objects))}
        kinds = {t: k for t, k in kinds.items() if k is not None}
        for obj in itertools.compress(objects, map(kinds.__contains__, map(type, objects))):
            kind = kinds[type(obj)]
            if kind is NDArray:
                arrays.append(obj)
            elif kind is Parameter:
                self.parameters.add(obj)
                names.update(dict.fromkeys(buffers_of(obj.grad), "gradient"))
            elif kind is Optimizer:
                for state in [obj.master] + [getattr(obj, slot) for slot in obj.slots]:
                    names.update(dict.fromkeys(buffers_of(state), "optimizer_state"))
        for p in self.parameters:
            names.update(dict.fromkeys(buffers_of(p), "parameter"))
        for array in arrays:
            if array.device == self.device and id(array.buffer) not in self.live:
                self.new_block(array, alloc=None).category = names.get(id(array.buffer), "other")
        if sum(b.bytes for b in self.blocks) < self.device.memory_stats()["current_bytes"]:
            self.adopt_held_buffers(objects)  # only when NDArrays do not account for every byte: it costs a scan

    def adopt_held_buffers(self, objects):
        """Buffers held without an NDArray (a bucket, a flat shard), among the objects' referents."""
        buffer_type = getattr(self.device.mod, "Array", None)  # the backend's buffer (None: not built)
        if buffer_type is None:
            return
        for buffer in gc.get_referents(*objects):
            if type(buffer) is buffer_type and id(buffer) not in self.live:
                self.new_block(RawBuffer(buffer), alloc=None)

    # ----- buffers made and given back ------------------------------------------------------------------------
    def new_block(self, array, alloc):
        node = self.op_node
        buffer = array.buffer
        block = Block(len(self.blocks), buffer, array, self.phase,
                      type(node.op).__name__ if node is not None else None, self.module_of_node(node), alloc)
        block.ref = BufferRef(buffer, self.freed)
        block.ref.block = block
        self.blocks.append(block)
        self.live[block.key] = block
        self.live_bytes += block.bytes
        return block

    def allocated(self, array):
        """An NDArray constructor made `array` with a fresh buffer."""
        if array.device != self.device:
            return
        block = self.new_block(array, alloc=len(self.events))
        if self.op_node is not None:
            block.category = "workspace"  # unless it is the op's result (`computed`)
            self.op_blocks.append(block)
        elif self.phase == "optimizer":
            block.category = "workspace"  # unless the optimizer still holds it when its step ends
        self.event("alloc", block)

    def freed(self, ref):
        """The callback of a buffer's weak reference: the backend has just given its bytes back."""
        block = ref.block
        if not self.active or self.live.get(block.key) is not block:
            return
        del self.live[block.key]
        self.live_bytes -= block.bytes
        node = block.node() if block.node is not None else None
        if node is not None and id(node) not in self.host and node.stored is not None:
            if node.store.kind == "compressed":  # its codes, on the device: made just before this free
                self.compressed(node)
            else:
                self.host_parked(node)  # the forward pass parked it just before giving its device buffer back
        block.free = len(self.events)
        if block.forward_value:
            self.settle_forward_value(block, alive=False)
        self.event("free", block)

    def event(self, action, block):
        if self.host:
            self.settle_host()
        self.append(action, block)

    def append(self, action, block):
        stats = self.device.memory_stats() if self.check or self.reserved else None
        self.events.append((action, block, self.live_bytes, time.perf_counter() - self.start,
                            stats["current_bytes"] if self.check else None, self.host_bytes,
                            stats["reserved_bytes"] if self.reserved else None))

    # ----- offloaded values' host copies (toolbox/offload.py) ------------------------------------------------
    def parked(self, node, nbytes):
        """offload.park has just copied `node` to the host, `nbytes` of it. (On a copy thread its device buffer is
        freed later, at the next park or fetch: the host copy is recorded now, when the host bytes are taken.)"""
        if self.active and id(node) not in self.host:
            self.host_parked(node, nbytes)

    def host_parked(self, node, nbytes=None):
        nbytes = node.store.host_bytes(infer_spec(node)) if nbytes is None else nbytes
        block = Block(len(self.blocks), HostCopy(nbytes, node), HostCopy(0, node), self.phase,
                      type(node.op).__name__, self.module_of.get(node), len(self.events))
        block.category, block.node = "host", weakref.ref(node)
        block.reason = "offloaded after its last forward use: the host copy backward fetches from"
        self.blocks.append(block)
        self.host[id(node)] = (block.node, block)
        self.host_bytes += block.bytes
        self.append("alloc", block)

    def compressed(self, node):
        """The forward pass kept `node` as k-bit codes (compress.py) before giving its buffer back: those device
        buffers are a kept activation, named after it."""
        for key in buffers_of(node.stored):
            block = self.live.get(key)
            if block is not None:
                block.category, block.node = "activation_kept", weakref.ref(node)
                block.op, block.module = type(node.op).__name__, self.module_of.get(node)
                block.reason = "compressed after its last forward use: the codes backward rebuilds it from"

    def settle_host(self):
        """Host copies given back since the last event (after their last use in backward, or with their graph)
        are recorded now: offload.py gives them back without a device event, so at most one event late."""
        for key, (ref, block) in list(self.host.items()):
            node = ref()
            if node is None or node.stored is None:
                del self.host[key]
                self.host_bytes -= block.bytes
                block.free = len(self.events)
                self.append("free", block)

    # ----- what a buffer is: graph values, ops, modules -------------------------------------------------------
    def node_made(self, node):
        """A graph value was built: an op's result belongs to the module running (in backward: the one of the
        value differentiated); a leaf's data is a parameter or an input."""
        if node.op is not None:
            module = self.modules[-1] if self.modules else self.backward_module
            if module is not None:
                self.module_of[node] = module
            return
        if isinstance(node, Parameter):
            self.parameters.add(node)
        for key in buffers_of(node.cached_data):
            block = self.live.get(key)
            if block is not None and isinstance(node, Parameter):
                block.category = "parameter"
            elif block is not None and self.phase == "backward" and block.category in ("other", "input"):
                block.category = "gradient"  # backward's leaf: the seed of the gradients (out_grad)
            elif block is not None and block.category == "other":
                block.category = "input"

    def computing(self, node):
        self.op_node, self.op_blocks = node, []

    def computed(self, node, value):
        """`node`'s op returned `value`: the buffers it made for `value` are its result, the others workspace."""
        if not self.op_blocks:  # a view, or nothing made (most ops of a step make one buffer or none)
            self.op_node = None
            return
        results = {id(value.buffer)} if type(value) is NDArray else buffers_of(value)
        for block in self.op_blocks:
            if block.key in results and self.live.get(block.key) is block:  # (a freed block's id may be reused)
                block.node = weakref.ref(node)
                if self.phase == "forward":
                    block.forward_value, block.category = True, "activation_kept"
                elif self.phase == "recompute":
                    block.category, block.reason = "activation_recomputed", "dropped in forward, recomputed"
                elif self.phase == "backward":
                    block.category = "gradient"
        self.op_node, self.op_blocks = None, []

    def brought_back(self, node):
        """backward brought `node`'s value back from its store (store.py): a kept activation."""
        for key in buffers_of(node.cached_data):
            block = self.live.get(key)
            if block is not None:
                block.category, block.node = "activation_kept", weakref.ref(node)
                block.op, block.module = type(node.op).__name__, self.module_of.get(node)
                block.reason = ("offloaded after its last forward use, fetched back for backward"
                                if node.store.kind == "offloaded" else
                                f"{node.store.kind} after its last forward use, brought back for backward")

    def module_of_node(self, node):
        return None if node is None else self.module_of.get(node, self.backward_module)

    def in_module(self, module):
        """The context of Module.__call__: values built inside belong to `module`."""
        return ModuleScope(self, module)

    def differentiating(self, node):
        """backward.run_backward's step for `node`: the gradients it builds belong to `node`'s module."""
        self.backward_module = self.module_of.get(node)

    # ----- phases and what they settle ------------------------------------------------------------------------
    def enter_phase(self, name, owner=None):
        previous = (self.phase, len(self.blocks))
        if name == "backward" and self.phase == "forward":
            for block in self.live.values():
                if block.forward_value:
                    self.settle_forward_value(block, alive=True)
        self.set_phase(name)
        return previous

    def exit_phase(self, previous, owner=None):
        phase, first_block = previous
        if self.phase == "optimizer" and owner is not None:
            self.settle_optimizer_step(owner, self.blocks[first_block:])
        if self.phase == "backward":
            self.backward_module = None
        self.set_phase(phase)

    def set_phase(self, name):
        if name != self.phase:
            self.phase = name
            self.phase_changes.append((name, len(self.events)))

    def settle_forward_value(self, block, alive):
        """A forward result alive when backward starts was kept for it, and says why; one freed before was a
        temporary of the forward pass (a dropped value, or one no gradient reads)."""
        block.forward_value = False
        node = block.node() if block.node is not None else None
        if not alive:
            block.category = "workspace"
            block.reason = "freed before backward" + (" (dropped by checkpointing)" if node is not None and
                                                      node.drop else "")
            return
        block.category = "activation_kept"
        block.reason = KEPT_BECAUSE.get(keep_reason(node), "kept") if node is not None else "kept"

    @contextlib.contextmanager
    def allocating_state(self, optimizer):
        """Optimizer.allocate_state: what it makes and holds is its state, as what a step makes and holds is."""
        first = len(self.blocks)
        yield
        self.settle_optimizer_step(optimizer, self.blocks[first:])

    def settle_optimizer_step(self, optimizer, made):
        """What an optimizer's step made and still holds when it ends is a parameter (its new data) or its state
        (named after its parameter and slot)."""
        params = buffers_of(optimizer.params)
        for block in made:
            if block.free is None and block.alloc is not None:
                block.category = "parameter" if block.key in params else "optimizer_state"
        for slot in ("master",) + tuple(optimizer.slots):
            for p, state in getattr(optimizer, slot).items():
                self.name_blocks(state, f"{parameter_name(p)}: {slot}")
        self.settle_parameters()

    def settle_parameters(self):
        """The current data of every Parameter seen is a parameter's; its .grad a gradient; both get its name."""
        for p in list(self.parameters):
            for key in buffers_of(p):
                if key in self.live:
                    self.live[key].category = "parameter"
            self.name_blocks(p, parameter_name(p))
            self.name_blocks(p.grad, f"{parameter_name(p)}.grad")

    def name_blocks(self, value, name):
        for key in buffers_of(value):
            block = self.live.get(key)
            if block is not None:
                block.name = name


# keep_reason (checkpoint.py) -> why a forward value was alive when backward started, in the page's words.
KEPT_BECAUSE = {
    "checkpoint": "kept by the checkpoint policy (a checkpoint)",
    "boundary": "kept: the output of a checkpointed region",
    "not annotated": "kept: not in a checkpointed region (gc off keeps every value a gradient may read)",
    "dropped": "dropped by checkpointing, not yet released",
}


class ModuleScope:
    """Module.__call__'s context while recording: pushes the module on the recorder's stack."""

    def __init__(self, recorder, module):
        self.recorder, self.module = recorder, module

    def __enter__(self):
        if not self.recorder.modules:
            self.recorder.roots.setdefault(id(self.module), self.module)
        self.recorder.modules.append(self.module)

    def __exit__(self, *exc):
        self.recorder.modules.pop()
        return False


def parameter_name(p):
    return p.name or f"a Parameter of shape {tuple(p.shape)}"


def module_names(roots):
    """id(module) -> its name: the dotted path from the model (`seq_model.layers.1.attention`). A module whose
    forward ran outermost (a root) may sit inside the model (`model.loss` calls `model.seq_model` itself): its
    parameters' names, given by the model's named_parameters, say where; a root with none goes by its class name."""
    names = {}
    for root in roots:
        prefix = path_in_model(root)
        for name, module in root.named_modules():
            full = ".".join(part for part in (prefix, name) if part)
            names.setdefault(id(module), full or type(root).__name__)
    return names


def path_in_model(module):
    """The dotted path of `module` in the model its parameters were named from ("" if it is the model, or unnamed)."""
    for local, p in module.named_parameters():
        if p.name and p.name != local and p.name.endswith("." + local):
            return p.name[:-len(local) - 1]
    return ""
