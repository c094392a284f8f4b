"""ndl.jit.capture: a training step run once through a recorder, then replayed as the list of backend calls it made.

A step's Python (building nodes, inferring specs, asking the checkpointing policy, planning backward) costs the
same every step, and on a small model it costs more than the kernels. Capture runs the step with the device's
backend module swapped for a recorder (BackendDevice.calls_through), which notes every call and every buffer
made; the program is that list. A replay writes the new inputs into the recorded input buffers and calls the
kernels again, on the same buffers, in the same order (tinygrad's TinyJit and PyTorch's CUDA graphs do this).

    step = ndl.jit.capture(step)    # step(X, y): reset_grad, forward, loss, backward, opt.step(); returns the loss
    step(X0, y0)                    # runs normally, recorded
    step(X1, y1)                    # runs normally, recorded again: the two programs must agree (Adam: a third)
    step(X2, y2)                    # replayed: no Python of the step runs, no buffer is allocated

The second call checks that the step's program is stable: the first step of an optimizer or of a Budget differs
from the ones after it. What a replay does not re-run is frozen: the step's Python numbers (a dropout rate), the
checkpointing policy, autocast, lazy mode, the branch a value read into Python chose. The optimizer's update is
the exception (memory_hook.CAPTURE hands it over): a replay begins its step and passes its kernels the `lr` and
bias corrections of now (STEP_NUMBERS), or runs it in Python where those cannot be told apart.
"""
import functools
import gc as python_gc
import weakref

import numpy as np

from ... import autograd, memory_hook, optim
from ...autograd import Tensor, TensorTuple, active_autocast
from ...backend_ndarray.ndarray import DTYPES
from ...backend_selection import default_device
from .plan import PlannedBuffer, place

RECORDINGS = 3  # calls recorded, at most, before a step's program must have repeated itself
# The numbers an optimizer's update kernels read that change between steps, as the optimizer has them after
# begin_step(): a replay begins the step and passes these (a new lr, Adam's bias corrections for the new t). Its
# other hyperparameters (betas, eps, momentum, weight_decay) are frozen, and checked unchanged at each replay.
STEP_NUMBERS = {
    optim.Adam: lambda o: (o.lr,) + tuple(o.corrections),
    optim.SGD: lambda o: (o.lr,),
}


class StaleCapture(RuntimeError):
    """A replay refused: something the captured program depends on changed since it was recorded."""


class Buffer:
    """A buffer as a recorded program names it: the k-th input ("in", k), the k-th buffer the step made ("made",
    k), or one that was there before (a parameter, a state buffer: "kept", its id)."""

    __slots__ = ("kind", "key")

    def __init__(self, kind, key):
        self.kind, self.key = kind, key

    def __eq__(self, other):
        return type(other) is Buffer and self.kind == other.kind and self.key == other.key

    def __hash__(self):
        return hash((self.kind, self.key))

    def __repr__(self):
        return f"{self.kind}{self.key if self.kind != 'kept' else ''}"


class Recording:
    """One call of the step as it ran: its program entries, the buffers it made, the modules and optimizers it met.

    An entry is ("call", function, args, kwargs, numbers) for a kernel, its buffers named by Buffer (numbers: None,
    or (optimizer, ((argument position, index in its STEP_NUMBERS), ...)) for an update kernel whose lr and step
    count a replay reads anew), ("read", name) for a call whose result Python took (to_numpy, memory_stats: not
    replayed), or ("live", optimizer, update) for an optimizer's step that a replay runs in Python. The buffers
    the step makes are held weakly: they are freed as the uncaptured step frees them."""

    def __init__(self, device, inputs):
        self.device, self.inputs = device, inputs  # inputs: the recorded input buffers (handles), in order
        self.array_type = device.mod.Array
        self.walked = {self.array_type, tuple, list, dict, np.ndarray}  # the argument types _named looks inside
        self.entries, self.made, self.modules, self.optimizers = [], [], {}, []
        self.names = {id(h): Buffer("in", k) for k, h in enumerate(inputs)}
        self.kept = {}  # id -> a handle made before the step (a parameter, a state buffer): held, so ids stay unique

    # ----- what the router and memory_hook report ------------------------------------------------------------
    def backend_call(self, name, function, args, kwargs):
        if name == "Array":
            handle = function(*args)
            self.names[id(handle)] = Buffer("made", len(self.made))
            self.made.append((weakref.ref(handle), handle.size, handle.dtype))
            return handle
        if name.startswith("copy_thread"):
            raise NotImplementedError(f"ndl.jit.capture: the step calls the backend's {name} (offloading), which a "
                                      "replay cannot repeat yet; capture a step without offload")
        result = function(*args, **kwargs)
        if result is None:
            self.entries.append(("call", function, self._named(args), self._named(kwargs), None))
        elif isinstance(result, self.array_type):
            raise NotImplementedError(f"ndl.jit.capture: the backend's {name} returned a new buffer, which a replay "
                                      "cannot track")
        else:
            self.entries.append(("read", name))
        return result

    def _named(self, value):
        """`value` (a call's arguments) with each buffer replaced by its Buffer name; host arrays copied."""
        kind = type(value)
        if kind is self.array_type:
            name = self.names.get(id(value))
            if name is None:
                self.kept[id(value)] = value
                name = self.names[id(value)] = Buffer("kept", id(value))
            return name
        if kind is tuple or kind is list:  # (the common case, shapes and strides, walked without a call per int)
            return kind(self._named(v) if type(v) in self.walked else v for v in value)
        if kind is dict:
            return {k: self._named(v) for k, v in value.items()}
        if kind is np.ndarray:
            return np.array(value)  # (the caller may reuse its own)
        return value

    def module_called(self, module):
        self.modules[id(module)] = (module, module.training, module.checkpoint_policy)
    def optimizer_step(self, optimizer, update):
        """An optimizer's step: its kernels recorded, their per-step numbers (STEP_NUMBERS) marked to be read at
        each replay; where that cannot be told apart (no STEP_NUMBERS, two numbers equal), the whole step runs in
        Python at each replay."""
        if optimizer.in_backward:
            raise NotImplementedError(f"ndl.jit.capture: {type(optimizer).__name__}(in_backward=True) updates inside "
                                      "backward, which capture does not record yet; build it with in_backward=False")
        if all(o is not optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
        numbers, start = STEP_NUMBERS.get(type(optimizer)), len(self.entries)
        recorded = numbers is not None and not optimizer.stochastic_rounding and not optimizer.offload_state
        previous = memory_hook.set_capture(None)
        try:
            if not recorded:
                with self.paused():
                    result = update()
            else:
                result = update()
        finally:
            memory_hook.set_capture(previous)
        if recorded and self._mark_numbers(optimizer, start, numbers(optimizer)):
            return result
        del self.entries[start:]
        self.entries.append(("live", optimizer, update))
        return result

    def _mark_numbers(self, optimizer, start, now):
        """Mark each float argument of the update's kernels (entries from `start`) equal to one of `now`; False if
        one equals two of them (which one it is cannot be told) or the update did anything but kernel calls."""
        for i in range(start, len(self.entries)):
            kind, function, args, kwargs, _ = (self.entries[i] + (None,) * 5)[:5]
            if kind != "call" or kwargs:
                return False
            slots = []
            for position, a in enumerate(args):
                if type(a) is float:
                    which = [j for j, x in enumerate(now) if x == a]
                    if len(which) > 1:
                        return False
                    slots.extend((position, j) for j in which)
            self.entries[i] = ("call", function, args, kwargs, (optimizer, tuple(slots)) if slots else None)
        return True

    def paused(self):
        return self.device.calls_through(self.router.mod)

    # ----- comparing two recordings --------------------------------------------------------------------------
    def shape(self):
        """The program as two recordings of a stable step have it alike: buffers by name, the update kernels'
        step numbers by their index (Adam's bias corrections change every step), host data by its bytes."""
        out = []
        for entry in self.entries:
            if entry[0] == "call":
                args = list(entry[2])
                for position, j in entry[4][1] if entry[4] else ():
                    args[position] = ("step number", j)
                out.append((entry[1], _comparable(args), _comparable(sorted(entry[3].items()))))
            else:
                out.append(entry[:2])
        return out


class _Text(str):
    def __repr__(self):
        return str(self)


def _shown(value, kept):
    """An argument as listing() prints it: buffers by name (kept ones numbered as they first appear)."""
    if type(value) is Buffer:
        if value.kind == "kept":
            return f"p{kept.setdefault(value.key, len(kept))}"
        return f"{'in' if value.kind == 'in' else 't'}{value.key}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_shown(v, kept) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, np.ndarray):
        return f"host{value.shape}"
    if isinstance(value, float):
        return f"{value:g}"
    return repr(value)


def _comparable(value):
    if isinstance(value, (tuple, list)):
        return tuple(_comparable(v) for v in value)
    if isinstance(value, np.ndarray):
        return ("host data", value.shape, str(value.dtype), value.tobytes())
    return value


class Router:
    """The backend module as the recorder shows it to the step: each function reached through `Recording`."""

    def __init__(self, mod, recording):
        self.mod, self.recording = mod, recording

    def __getattr__(self, name):
        function = getattr(self.mod, name)
        if not callable(function):
            return function
        recording = self.recording

        def call(*args, **kwargs):
            return recording.backend_call(name, function, args, kwargs)
        self.__dict__[name] = call  # looked up once per name
        return call


class Program:
    """A recorded step, ready to replay: its kernel list, its input buffers, its result, and what it must find."""

    def __init__(self, recording, result):
        self.device, self.inputs, self.result = recording.device, recording.inputs, result
        entries = [e for e in recording.entries if e[0] != "read"]
        self.memory_plan, handles, self.placements = place_buffers(recording, entries)
        self.steps = [(e[2], ()) if e[0] == "live" else
                      (functools.partial(e[1], **_real(e[3], handles)) if e[3] else e[1], _real(e[2], handles))
                      for e in entries]
        # the update kernels' per-step numbers: (their arguments, a list written in place at each replay, the
        # optimizer, (position, number index) pairs)
        self.numbered = []
        for i, e in enumerate(entries):
            if e[0] == "call" and e[4]:
                self.steps[i] = (self.steps[i][0], list(self.steps[i][1]))
                self.numbered.append((self.steps[i][1], e[4][0], e[4][1]))
        self.updates = [o for o in recording.optimizers if any(n[1] is o for n in self.numbered)]
        self.reads = [e[1] for e in recording.entries if e[0] == "read"]
        self.modules = list(recording.modules.values())
        self.parameters = [(p, p.cached_data) for o in recording.optimizers for p in o.params]
        self.hyperparameters = [(o, _frozen_hyperparameters(o)) for o in self.updates]
        # the gradients the live updates read: another program of the same step (other shapes) rebinds p.grad
        self.gradients = [(p, p.grad) for o in recording.optimizers for p in o.params]
        self.modes = (autograd.LAZY_MODE, active_autocast())
        self.entries = entries  # (as recorded, buffers by name: listing() prints them)
        self.result_entry = _first_use(entries, handles, _tensors(result))

    def result_bytes(self):
        """The arena's bytes alive at the entry that computes the step's (first) result, the loss: what the
        forward pass holds when backward begins (gc.py's M_act); None without a plan or a Tensor result."""
        if self.memory_plan is None or self.result_entry is None:
            return None
        return self.memory_plan.alive_bytes(self.result_entry)

    def listing(self):
        """The program as text, one line an entry: `matmul(in0, p1, t0, 8, 4, 16)` — in: an input, p: a buffer
        there before the step (a parameter, optimizer state), t: one the step made (in the arena), #j: the
        optimizer's j-th step number, read anew at each replay."""
        kept, lines = {}, []
        for entry in self.entries:
            if entry[0] == "live":
                lines.append(f"{type(entry[1]).__name__}.step()  (runs in Python at each replay)")
                continue
            args = list(entry[2])
            for position, j in entry[4][1] if entry[4] else ():
                args[position] = _Text(f"#{j}")
            text = ", ".join([_shown(a, kept) for a in args] + [f"{k}={_shown(v, kept)}" for k, v in entry[3].items()])
            lines.append(f"{getattr(entry[1], '__name__', entry[1])}({text})")
        return lines

    def replay(self, tensors):
        self.check_unchanged()
        mod = self.device.mod
        for handle, t in zip(self.inputs, tensors):
            a = t.realize_cached_data()
            mod.compact(a.buffer, handle, list(a.shape), list(a.strides), a.offset)
        for p, grad in self.gradients:
            p.grad = grad
        if self.placements:  # the first replay: the arena made, every buffer placed in it
            self.memory_plan.arena = mod.place_in_arena(self.memory_plan.arena_bytes, self.placements)
            self.placements = []
            # From here the step allocates nothing, so the freed blocks the allocator keeps for reuse serve it no
            # longer: they go back now, not a few replays later, when resident memory would move under a replay.
            mod.empty_cache()
        self.renumber()
        for function, args in self.steps:
            function(*args)
        return self.result

    def renumber(self):
        """Begin each recorded optimizer's step (Adam: t += 1) and write its numbers into its kernels' arguments."""
        now = {}
        for optimizer in self.updates:
            optimizer.begin_step()
            now[id(optimizer)] = STEP_NUMBERS[type(optimizer)](optimizer)
        for args, optimizer, slots in self.numbered:
            numbers = now[id(optimizer)]
            for position, j in slots:
                args[position] = numbers[j]

    def check_unchanged(self):
        """StaleCapture unless the modules, parameters and modes the program was recorded with are as they were."""
        for module, training, policy in self.modules:
            if module.training is not training or module.checkpoint_policy is not policy:
                what = "switched to eval" if training and not module.training else \
                    "switched to train" if module.training is not training else "had its checkpointing changed"
                raise StaleCapture(f"ndl.jit.capture: {type(module).__name__} {what} since the step was captured; "
                                   "its recorded program would be stale (capture the step again)")
        for p, data in self.parameters:
            if p.cached_data is not data:
                raise StaleCapture(f"ndl.jit.capture: a parameter of shape {tuple(p.shape)} was replaced since the "
                                   "step was captured (its new array is not the one the program updates)")
        for optimizer, values in self.hyperparameters:
            if _frozen_hyperparameters(optimizer) != values:
                raise StaleCapture(f"ndl.jit.capture: {type(optimizer).__name__}'s hyperparameters changed since the "
                                   f"step was captured ({values} then); only lr is read anew at each replay")
        if (autograd.LAZY_MODE, active_autocast()) != self.modes:
            raise StaleCapture("ndl.jit.capture: lazy mode or autocast around the call differs from the capture's")


def _frozen_hyperparameters(optimizer):
    return {h: getattr(optimizer, h) for h in optimizer.hyperparameters if h not in ("lr", "t")}


def place_buffers(recording, entries):
    """(the MemoryPlan or None, {Buffer: its handle}, the placements left): every buffer the step made placed in
    one arena at the offsets `place` chooses, where the backend can (CPU: unplaced_array, place_in_arena);
    elsewhere each gets a buffer of its own. The arena is made when the first replay begins, once the buffers the
    step left alive (an output, a gradient p.grad holds: they escape the step) have given their blocks back, which
    that replay writes before it reads: nothing is held twice, and no page is faulted in before it is used."""
    handles = {Buffer("in", k): h for k, h in enumerate(recording.inputs)}
    handles.update((Buffer("kept", key), h) for key, h in recording.kept.items())
    first, last = {}, {}  # per made buffer: its first and last entry
    for i, entry in enumerate(entries):
        for name in _names(entry[2:4] if entry[0] == "call" else ()):
            if name.kind == "made":
                first.setdefault(name.key, i)
                last[name.key] = i
    python_gc.collect(1)  # (the step's garbage goes now: a buffer still alive is held by the caller, or escapes)
    alive = {k: ref() for k, (ref, _, _) in enumerate(recording.made) if k in first}
    handles.update((Buffer("made", k), h) for k, h in alive.items() if h is not None)
    mod = recording.router.mod
    if not hasattr(mod, "place_in_arena"):
        handles.update((Buffer("made", k), mod.Array(*recording.made[k][1:])) for k in first if alive[k] is None)
        return None, handles, []
    keys = sorted(first)
    buffers = [PlannedBuffer(recording.made[k][1] * _itemsize(recording.made[k][2]), first[k],
                             len(entries) if alive[k] is not None else last[k], alive[k] is not None) for k in keys]
    plan = place(buffers)
    for k in keys:
        if alive[k] is None:
            handles[Buffer("made", k)] = mod.unplaced_array(*recording.made[k][1:])
    return plan, handles, [(handles[Buffer("made", k)], b.offset) for k, b in zip(keys, buffers)]


def _first_use(entries, handles, tensors):
    """The first entry that writes the first of `tensors` (its buffer), or None."""
    if not tensors:
        return None
    buffer = tensors[0].realize_cached_data().buffer
    name = next((n for n, h in handles.items() if h is buffer), None)
    return next((i for i, e in enumerate(entries) if e[0] == "call" and name in set(_names(e[2:4]))), None)


def _itemsize(dtype):
    return np.dtype(DTYPES[dtype]).itemsize


def _names(value):
    for v in value:
        if type(v) is Buffer:
            yield v
        elif isinstance(v, (tuple, list)):
            yield from _names(v)
        elif isinstance(v, dict):
            yield from _names(v.values())


def _real(value, handles):
    """`value` (recorded arguments) with each Buffer name replaced by its handle."""
    if type(value) is Buffer:
        return handles[value]
    if isinstance(value, (tuple, list)):
        return type(value)(_real(v, handles) for v in value)
    if isinstance(value, dict):
        return {k: _real(v, handles) for k, v in value.items()}
    return value


class capture:
    """`fn(*tensors)` captured: recorded on its first calls, replayed after (see the module docstring).

    A call with other shapes or dtypes records a program of its own (a cache keyed by them, of at most
    `max_programs`: each holds an arena, and the least recently used goes first, as torch.compile's cache does).
    `memory_plan` is the latest program's MemoryPlan (None before a program is ready, or where the backend cannot
    alias buffers)."""

    def __init__(self, fn, max_programs=8):
        if isinstance(max_programs, bool) or not isinstance(max_programs, int) or max_programs < 1:
            raise ValueError(f"ndl.jit.capture: max_programs must be a positive int, got {max_programs!r}")
        functools.update_wrapper(self, fn)
        self.fn, self.max_programs = fn, max_programs
        self.programs = {}  # key -> Program, the most recently used last
        self.pending = {}  # key -> (the last Recording's shape, how many calls were recorded)
        self.latest = None

    @property
    def memory_plan(self):
        return None if self.latest is None else self.latest.memory_plan

    def listing(self):
        """The latest program as text, one line a backend call (Program.listing); [] before one is ready."""
        return [] if self.latest is None else self.latest.listing()

    def __call__(self, *tensors):
        for i, t in enumerate(tensors):
            if not isinstance(t, Tensor):
                raise TypeError(f"ndl.jit.capture({getattr(self.fn, '__name__', 'fn')}): argument {i} is a "
                                f"{type(t).__name__}; a captured step takes Tensors only")
        key = tuple((tuple(t.shape), str(t.dtype), str(t.device), t.requires_grad) for t in tensors)
        program = self.programs.pop(key, None)
        if program is not None:
            self.programs[key] = self.latest = program
            return program.replay(tensors)
        return self._record(key, tensors)

    def _record(self, key, tensors):
        device = tensors[0].device if tensors else default_device()
        if any(t.device != device for t in tensors):
            raise ValueError("ndl.jit.capture: the step's tensors are on different devices")
        inputs = [t.realize_cached_data().copy() for t in tensors]  # the step reads its own copies: replays refill
        recording = Recording(device, [a.buffer for a in inputs])
        recording.router = Router(device.mod, recording)
        previous = memory_hook.set_capture(recording)
        try:
            with device.calls_through(recording.router):
                result = self.fn(*[Tensor.make_const(a, requires_grad=t.requires_grad)
                                   for a, t in zip(inputs, tensors)])
                for t in _tensors(result):
                    t.realize_cached_data()  # (lazy mode: the result's values are part of the program)
        finally:
            memory_hook.set_capture(previous)
        result = _detached(result)  # (the step's graph is not kept alive by what it returns)
        shape, (before, count, _) = recording.shape(), self.pending.get(key, (None, 0, None))
        if shape == before:
            del self.pending[key]
            self.programs[key] = self.latest = Program(recording, result)
            while len(self.programs) > self.max_programs:
                del self.programs[next(iter(self.programs))]
        elif count + 1 >= RECORDINGS:
            raise RuntimeError(f"ndl.jit.capture: the step's program changed on each of {RECORDINGS} calls "
                               f"({_first_difference(before, shape)}); a captured step must run the same kernels on "
                               "the same buffers every call (a gradient accumulated across calls? a random draw?)")
        else:
            self.pending[key] = (shape, count + 1, recording.kept)  # (its kept buffers held: their ids stay theirs)
        return result


def _detached(result):
    if isinstance(result, Tensor):
        return result.detach()
    if isinstance(result, (tuple, list)):
        return type(result)(_detached(r) for r in result)
    return result


def _tensors(result):
    if isinstance(result, Tensor):
        return [result]
    if isinstance(result, (tuple, list, TensorTuple)):
        return [t for r in result for t in _tensors(r)]
    return []


def _first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"entry {i}: {_name(x)} then {_name(y)}"
    return f"{len(a)} entries, then {len(b)}"


def _name(entry):
    return entry[1] if entry[0] in ("read", "live") else getattr(entry[0], "__name__", str(entry[0]))
