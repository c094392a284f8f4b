"""ndl.jit.capture: a training step run once through a recorder, then replayed as the list of backend calls it made.

A step's Python (building nodes, inferring specs, asking the checkpointing policy, planning backward) costs the
same every step, and on a small model it costs more than the kernels. Capture runs the step with the device's
backend module swapped for a recorder (BackendDevice.calls_through), which notes every call and every buffer
made; the program is that list. A replay writes the new inputs into the recorded input buffers and calls the
kernels again, on the same buffers, in the same order (tinygrad's TinyJit and PyTorch's CUDA graphs do this).

    step = ndl.jit.capture(step)    # step(X, y): reset_grad, forward, loss, backward, opt.step(); returns the loss
    step(X0, y0)                    # runs normally, recorded
    step(X1, y1)                    # runs normally, recorded again: the two programs must agree
    step(X2, y2)                    # replayed: no Python of the step runs, no buffer is allocated

The second call checks that the step's program is stable: the first step of an optimizer or of a Budget differs
from the ones after it. What a replay does not re-run is frozen: the step's Python numbers (a dropout rate), the
checkpointing policy, autocast, lazy mode, the branch a value read into Python chose. The optimizer's update is
the exception: it runs live at every replay (memory_hook.CAPTURE), so a new `lr` and the step count are read.
"""
import functools
import gc as python_gc
import sys

import numpy as np

from ... import autograd, memory_hook
from ...autograd import Tensor, TensorTuple, active_autocast
from ...backend_selection import default_device
from .plan import PlannedBuffer, place

RECORDINGS = 3  # calls recorded, at most, before a step's program must have repeated itself


class StaleCapture(RuntimeError):
    """A replay refused: something the captured program depends on changed since it was recorded."""


class Recording:
    """One call of the step as it ran: its program entries, the buffers it made, the modules and optimizers it met.

    An entry is ("call", function, args, kwargs) for a kernel, ("read", name) for a call whose result Python took
    (to_numpy, memory_stats: not replayed), or ("live", optimizer, update) for an optimizer's step."""

    def __init__(self, device, inputs):
        self.device, self.inputs = device, inputs  # inputs: the recorded input buffers (handles), in order
        self.array_type = device.mod.Array
        self.entries, self.made, self.modules, self.optimizers = [], [], {}, []
        self.role = {id(h): ("in", k) for k, h in enumerate(inputs)}
        self.kept = {}  # id -> a handle made before the step (a parameter, a state buffer): held, so ids stay unique

    # ----- what the router and memory_hook report ------------------------------------------------------------
    def backend_call(self, name, function, args, kwargs):
        if name == "Array":
            handle = function(*args)
            self.role[id(handle)] = ("made", len(self.made))
            self.made.append(handle)
            return handle
        if name.startswith("copy_thread"):
            raise NotImplementedError(f"ndl.jit.capture: the step calls the backend's {name} (offloading), which a "
                                      "replay cannot repeat yet; capture a step without offload")
        result = function(*args, **kwargs)
        if result is None:
            self.entries.append(("call", function, _frozen(args), kwargs))
        elif isinstance(result, self.array_type):
            raise NotImplementedError(f"ndl.jit.capture: the backend's {name} returned a new buffer, which a replay "
                                      "cannot track")
        else:
            self.entries.append(("read", name))
        return result

    def module_called(self, module):
        self.modules[id(module)] = (module, module.training, module.checkpoint_policy)

    def run_live(self, optimizer, update):
        if optimizer.in_backward:
            raise NotImplementedError(f"ndl.jit.capture: {type(optimizer).__name__}(in_backward=True) updates inside "
                                      "backward, which capture does not record yet; build it with in_backward=False")
        self.entries.append(("live", optimizer, update))
        if all(o is not optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
        previous = memory_hook.set_capture(None)
        try:
            with self.paused():
                return update()
        finally:
            memory_hook.set_capture(previous)

    def paused(self):
        return self.device.calls_through(self.router.mod)

    # ----- comparing two recordings --------------------------------------------------------------------------
    def shape(self):
        """The program with every buffer named by its role (input k, k-th made, or a kept one by identity): two
        recordings of a stable step have the same shape."""
        out = []
        for entry in self.entries:
            if entry[0] == "call":
                out.append((entry[1], self._canonical(entry[2]), self._canonical(sorted(entry[3].items()))))
            else:
                out.append(entry[:2])
        return out

    def _canonical(self, value):
        if isinstance(value, self.array_type):
            role = self.role.get(id(value))
            if role is None:
                self.kept[id(value)] = value
                role = ("kept", id(value))
            return role
        if isinstance(value, (tuple, list)):
            return tuple(self._canonical(v) for v in value)
        if isinstance(value, np.ndarray):
            return ("host data", value.shape, str(value.dtype), value.tobytes())
        return value


def _frozen(args):
    """The call's arguments as the program keeps them: host arrays copied (the caller may reuse its own)."""
    return tuple(np.array(a) if isinstance(a, np.ndarray) else a for a in args)


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
        self.steps = [(functools.partial(e[1], **e[3]) if e[3] else e[1], e[2]) if e[0] == "call" else (e[2], ())
                      for e in recording.entries if e[0] != "read"]
        self.reads = [e[1] for e in recording.entries if e[0] == "read"]
        self.modules = list(recording.modules.values())
        self.parameters = [(p, p.cached_data) for o in recording.optimizers for p in o.params]
        # the gradients the live updates read: another program of the same step (other shapes) rebinds p.grad
        self.gradients = [(p, p.grad) for o in recording.optimizers for p in o.params]
        self.modes = (autograd.LAZY_MODE, active_autocast())
        self.memory_plan = plan_memory(recording)

    def replay(self, tensors):
        self.check_unchanged()
        mod = self.device.mod
        for handle, t in zip(self.inputs, tensors):
            a = t.realize_cached_data()
            mod.compact(a.buffer, handle, list(a.shape), list(a.strides), a.offset)
        for p, grad in self.gradients:
            p.grad = grad
        for function, args in self.steps:
            function(*args)
        return self.result

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
        if (autograd.LAZY_MODE, active_autocast()) != self.modes:
            raise StaleCapture("ndl.jit.capture: lazy mode or autocast around the call differs from the capture's")


def plan_memory(recording):
    """Alias every buffer the step made into one arena at the offsets `place` chooses (CPU backend: Array.alias_into);
    the MemoryPlan, or None where the backend cannot alias."""
    made = recording.made
    if not made or not hasattr(made[0], "alias_into"):
        return None
    first, last, references = {}, {}, {}  # per buffer id: its first and last entry, its references from them
    for i, entry in enumerate(recording.entries):
        for handle in _handles(entry[2] if entry[0] == "call" else (), recording.array_type):
            first.setdefault(id(handle), i)
            last[id(handle)] = i
            references[id(handle)] = references.get(id(handle), 0) + 1
    python_gc.collect()  # (what the step dropped goes now, so a reference left is a real one)
    end = len(recording.entries)
    buffers, used = [], []
    for handle in made:
        if id(handle) not in first:
            continue  # made and never used by a kernel: keeps its own block
        # held by `made`, by `handle` and by getrefcount's argument, and by the program: any more, by the caller
        escapes = sys.getrefcount(handle) > 3 + references[id(handle)]
        buffers.append(PlannedBuffer(handle.size * handle.itemsize, first[id(handle)],
                                     end if escapes else last[id(handle)], escapes))
        used.append(handle)
    plan = place(buffers)
    arena = recording.router.mod.Array(-(-plan.arena_bytes // 4))
    for handle, b in zip(used, buffers):
        handle.alias_into(arena, b.offset, b.escapes)
    plan.arena = arena
    return plan


def _handles(args, array_type):
    for a in args:
        if isinstance(a, array_type):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from _handles(a, array_type)


class capture:
    """`fn(*tensors)` captured: recorded on its first calls, replayed after (see the module docstring).

    A call with other shapes or dtypes records a program of its own (a cache keyed by them). `memory_plan` is the
    latest program's MemoryPlan (None before a program is ready, or where the backend cannot alias buffers)."""

    def __init__(self, fn):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.programs = {}  # key -> Program
        self.pending = {}  # key -> (the last Recording's shape, how many calls were recorded)
        self.latest = None

    @property
    def memory_plan(self):
        return None if self.latest is None else self.latest.memory_plan

    def __call__(self, *tensors):
        for i, t in enumerate(tensors):
            if not isinstance(t, Tensor):
                raise TypeError(f"ndl.jit.capture({getattr(self.fn, '__name__', 'fn')}): argument {i} is a "
                                f"{type(t).__name__}; a captured step takes Tensors only")
        key = tuple((tuple(t.shape), str(t.dtype), str(t.device), t.requires_grad) for t in tensors)
        program = self.programs.get(key)
        if program is not None:
            self.latest = program
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
