"""The optimizer base class: parameters, master weights, stochastic rounding, state accounting.

Updates work on raw arrays (a parameter's `cached_data`), so a step never grows the graph; it never writes into
`param.grad` and keeps the parameter's dtype. Parameters without a gradient are skipped.

16-bit parameters (float16, bfloat16): the update is always computed in float32. With `master_weights=True`
(the default for them) the optimizer keeps a float32 copy of each such parameter, updates it and rounds it into
the parameter, so updates smaller than a 16-bit step accumulate (Micikevicius et al. 2017). With
`master_weights=False` ("pure bf16") parameters and state stay 16-bit, and `stochastic_rounding=True` rounds each
new weight up or down with probability given by the dropped fraction (Kalamkar et al. 2019; Zamirai et al. 2020).

State: each optimizer names its per-parameter state in `slots` (Adam: "m", "v"); `self.<slot>` maps a parameter
to its stored state (float32, 16-bit, or 8-bit for Adam8bit), which `_fetch` hands to the update and `_keep`
stores back. It is allocated when the optimizer is built (`allocate_state`, as optax's `init`): the first step's
peak is every later step's, and state that cannot fit fails at construction, not after a step's work. With
`offload_state=True` it lives in host memory instead (outside the allocator `memory_stats` counts), made by each
parameter's first update, and each parameter's state comes to the device for its own update only, the next one's
already on its way (on cuda: page-locked memory and a copy stream); `state_bytes()` counts what stays on the
device, `host_state_bytes()` what was offloaded.
"""
import functools
import math

import numpy as np

from .. import memory_hook
from ..autograd import Tensor, release
from ..backend_selection import array_api

_LOW = ("float16", "bfloat16")
CHUNK = 1 << 15  # elements an update works on at once: each of its float32 temporaries is at most 128 KB
CHUNK_TEMPORARIES = 8  # float32 chunk-sized temporaries an update holds at once, at most (the ledger's bound)


def as_dtype(array, like):
    """`array` in the dtype of `like` (arithmetic with Python floats may have promoted a numpy array)."""
    return array_api.cast_like(array, like)


def _is_low(array):
    dtype = array.dtype  # a name on NDArrays, a numpy dtype on numpy arrays (ml_dtypes names bfloat16 "bfloat16")
    return (dtype if isinstance(dtype, str) else dtype.name) in _LOW


def widen(array):
    """A 16-bit array as float32 (any other array as it is): optimizer arithmetic is float32."""
    return array_api.astype(array, "float32") if _is_low(array) else array


def flat_view(array):
    """A 1-D view of `array` (of a compact copy of an NDArray view that is not compact): its slices are views."""
    compact = getattr(array, "compact", None)  # NDArray reshapes compact arrays only; NumPy any
    return array_api.reshape(array if compact is None else compact(), (array.size,))


def _to_host(stored, previous=None):
    """Stored state (an array or a tuple of arrays) as NumPy copies: host memory the device allocator never sees
    (on cuda page-locked, reusing `previous`, the parameter's last host copy, and written asynchronously)."""
    if isinstance(stored, tuple):
        return tuple(_to_host(a, b) for a, b in zip(stored, previous or (None,) * len(stored)))
    return array_api.to_host(stored, previous)


def _to_device(stored, device):
    """Offloaded state back on `device`, in its stored dtype: (arrays, ready), `ready()` before first use (on
    cuda the copy is queued on a copy stream and overlaps the device's work until then)."""
    if isinstance(stored, tuple):
        pairs = [_to_device(a, device) for a in stored]

        def ready():
            for _, wait in pairs:
                wait()

        return tuple(a for a, _ in pairs), ready
    return array_api.from_host_async(stored, device)


def _nbytes(stored):
    if isinstance(stored, tuple):
        return sum(_nbytes(a) for a in stored)
    return int(stored.size * np.dtype(stored.dtype).itemsize)


def _new_state(layout, device):
    """Arrays of a state layout [(shape, dtype)], zero-filled so that their pages are resident from the start (the
    operating system counts the state where the allocator does): one array, or a tuple for a pair."""
    arrays = tuple(array_api.zeros(shape, dtype=dtype, device=device) for shape, dtype in layout)
    return arrays if len(arrays) > 1 else arrays[0]


def _dtype_name(dtype):
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def _host_copy(stored):
    """Stored state (an array on the device or the host, or a tuple of them) as NumPy copies."""
    if isinstance(stored, tuple):
        return tuple(_host_copy(a) for a in stored)
    return np.array(stored if isinstance(stored, np.ndarray) else array_api.to_numpy(stored), copy=True)


def _the_group(owner, state_dict, keys):
    """The one parameter group of a state dict, with `keys` (and the counters) in it, or ValueError."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) or \
            not isinstance(state_dict.get("param_groups"), (list, tuple)):
        raise ValueError(f"{owner}: expected a dict with 'state' (a dict) and 'param_groups' (a list), as "
                         "state_dict() returns")
    if len(state_dict["param_groups"]) != 1 or not isinstance(state_dict["param_groups"][0], dict):
        raise ValueError(f"{owner}: expected one parameter group, got {len(state_dict['param_groups'])}")
    group = state_dict["param_groups"][0]
    missing = [k for k in keys + ["rounding_steps", "params"] if k not in group]
    if missing:
        raise ValueError(f"{owner}: the parameter group lacks {', '.join(missing)}")
    return group


def _restore(current, saved):
    """A saved hyper-parameter in the type the optimizer keeps it (ndl.load may give NumPy scalars or lists)."""
    if saved is None or isinstance(saved, str):
        return saved
    if isinstance(saved, (list, tuple)):
        return tuple(float(x) for x in saved)  # Adafactor's eps pair
    if isinstance(current, bool) or isinstance(saved, (bool, np.bool_)):
        return bool(saved)
    if isinstance(current, int) and not isinstance(saved, (float, np.floating)):
        return int(saved)
    return float(saved)  # (a count saved as 2.5 stays 2.5, for check_hyperparameters to refuse)


def check_range(owner, name, value, low, high, high_open=True, low_open=False):
    """A hyper-parameter as a float, or ValueError naming the optimizer, the argument and the allowed range (NaN is
    in none)."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{owner}: {name} must be a number, got {value!r}") from None
    if not ((low < value if low_open else low <= value) and (value < high if high_open else value <= high)):
        raise ValueError(f"{owner}: {name} must be in {'(' if low_open else '['}{low:g}, {high:g}"
                         f"{')' if high_open else ']'}, got {value:g}")
    return value


def check_count(owner, name, value):
    """A step count as an int: a whole number >= 0, or ValueError naming the optimizer and the argument."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not float(value).is_integer() or value < 0:
        raise ValueError(f"{owner}: {name} must be a whole number >= 0, got {value!r}")
    return int(value)


def _check_distinct(name, params):
    """A Parameter listed twice would be updated twice a step, silently: an error, as in PyTorch."""
    first = {}
    for i, p in enumerate(params):
        j = first.setdefault(id(p), i)
        if j != i:
            raise ValueError(f"{name}: the same Parameter (shape {tuple(p.shape)}) is listed twice, at positions {j} "
                             f"and {i} of params; list each parameter once")


def in_optimizer_phase(step):
    """`step` run in needle.memory's "optimizer" phase."""
    @functools.wraps(step)
    def step_in_phase(self, *args, **kwargs):
        if memory_hook.PREDICTOR is not None:  # ndl.memory.predict: the update counted, not made
            return memory_hook.PREDICTOR.optimizer_step(self)
        if memory_hook.CAPTURE is not None:  # ndl.jit.capture: recorded, its lr and step count read at each replay
            return memory_hook.CAPTURE.optimizer_step(self, functools.partial(step_in_phase, self, *args, **kwargs))
        with memory_hook.phase("optimizer", self):
            return step(self, *args, **kwargs)
    return step_in_phase


class AllocatesState(type):
    """Optimizer's metaclass: once the outermost constructor returns (a subclass sets what the state's layout reads,
    Adam8bit's block_size, after its parent's __init__), the state is allocated."""

    def __call__(cls, *args, **kwargs):
        optimizer = super().__call__(*args, **kwargs)
        with memory_hook.allocating_state(optimizer):
            optimizer.allocate_state()
        return optimizer


class Optimizer(metaclass=AllocatesState):
    """Holds the parameters; `step()` updates them from their `.grad`, `reset_grad()` clears the gradients."""

    slots = ()  # the names of the per-parameter state dicts, e.g. ("m", "v")
    hyperparameters = ()  # attributes the update reads besides the state (lr, betas, step count t): saved, restored

    def __init__(self, params, master_weights=None, stochastic_rounding=False, offload_state=False,
                 in_backward=False):
        self.params = list(params)
        for i, p in enumerate(self.params):
            if not isinstance(p, Tensor):
                raise TypeError(f"{type(self).__name__}: params must be Tensors (a model's parameters()), got "
                                f"{type(p).__name__} at position {i}")
        _check_distinct(type(self).__name__, self.params)
        if stochastic_rounding and master_weights is None:
            master_weights = False  # stochastic rounding is how pure 16-bit training keeps tiny updates
        self.master_weights = master_weights
        self.stochastic_rounding = bool(stochastic_rounding)
        self.offload_state = bool(offload_state)
        self.master = {}  # 16-bit parameter -> its float32 master copy
        self._incoming = {}  # (parameter, slot) -> offloaded state on its way to the device, during a step
        for slot in self.slots:
            setattr(self, slot, {})
        self._unwritten = set()  # (slot, id(parameter)) of state allocated but not yet written by an update
        self._rounding_steps = 0
        self._position = {id(p): i for i, p in enumerate(self.params)}  # a parameter's stochastic-rounding seed
        # The optimizer in backward: backward updates each parameter the moment its gradient is final (backward.py's
        # update steps), so all the gradients never exist at once (LOMO, Lv et al. 2024). The last optimizer built
        # over a parameter decides whether it is updated there.
        self.in_backward = bool(in_backward)
        self._backward_pass = None  # the backward pass whose updates ran since the last step()
        for p in self.params:
            p.optimizer = self if self.in_backward else None
        if self.stochastic_rounding:
            if master_weights:
                raise ValueError(f"{type(self).__name__}: stochastic_rounding is for pure 16-bit training "
                                 "(master_weights=False); master weights round to nearest")
            bad = sorted({str(np.dtype(p.dtype)) for p in self.params} - {"bfloat16"})
            if bad:
                raise ValueError(f"{type(self).__name__}: stochastic_rounding needs bfloat16 parameters, got "
                                 f"{', '.join(bad)}")

    def __init_subclass__(cls, **kwargs):
        # needle.memory: every optimizer's step runs in the "optimizer" phase, and what it still holds when the
        # step ends is its state (or its parameters' new data). Wrapped here so an optimizer written for the course
        # (a subclass with its own `step`) is recorded the same way.
        super().__init_subclass__(**kwargs)
        if "step" in cls.__dict__:
            cls.step = in_optimizer_phase(cls.__dict__["step"])

    @in_optimizer_phase
    def step(self):
        """Update every parameter that has a gradient (nothing to do if backward updated them: `in_backward`)."""
        if self.in_backward:
            self._backward_pass = None  # the step backward made is complete: the next backward may start one
            return
        self.begin_step()
        for p, theta, grad in self._with_grads():
            self.update_parameter(p, theta, grad)
        self.end_step()

    # What an optimizer defines: the step's shared numbers, one parameter's update, and what ends a step.
    l2_weight_decay = True  # the course's coupled weight decay: weight_decay * theta added to the gradient

    def begin_step(self):
        """Once per step, before any parameter's update (Adam: the step count and its bias corrections)."""
        self._rounding_base, self._rounding_steps = self._rounding_steps, self._rounding_steps + len(self.params)

    def update_parameter(self, p, theta, grad):
        """Update parameter p from its value `theta` and gradient `grad` (`_value_and_grad`), in place: chunk by
        chunk (`_chunks` gives them in float32, `_update` stores each result), then `_finish`."""
        raise NotImplementedError()

    def end_step(self):
        """Once per step, after the last update."""

    def update_bytes(self, p):
        """(device bytes of state p's update creates — all of it before p's first update, unless offloaded —, bytes
        of workspace it allocates and frees): what the Budget's ledger counts for an update in backward."""
        def layout_bytes(slots):
            return sum(math.prod(shape) * np.dtype(dtype).itemsize for slot in slots
                       for shape, dtype in self._state_layout(p, slot) or ())
        slots = ("master",) + tuple(self.slots_of(p))
        if self.offload_state:  # on the device only for the update: workspace
            return 0, layout_bytes(slots) + self.workspace_bytes(p)
        return layout_bytes([s for s in slots if getattr(self, s).get(p) is None]), self.workspace_bytes(p)

    def slots_of(self, p):
        """The slots parameter p's update keeps (Adafactor without beta1 keeps no first moment)."""
        return self.slots

    def workspace_bytes(self, p):
        """Bytes parameter p's update allocates besides its state and frees again, at most: nothing for a fused
        kernel that writes in place, else CHUNK_TEMPORARIES float32 chunks (1 MiB: the updates hold fewer)."""
        return 0 if self.fused_in_place(p) else CHUNK_TEMPORARIES * min(p.realize_cached_data().size, CHUNK) * 4

    def fused_in_place(self, p):
        """Whether p's update is one backend kernel over the whole arrays, written in place (Adam's adam_step)."""
        return False

    def update_in_backward(self, p, backward_pass):
        """Backward's update step (backward.py): p's gradient is final, read by nothing after; update p now. The
        arithmetic is step()'s, so the parameters are bit-identical to the ordinary loop's."""
        if self._backward_pass is not backward_pass:
            if self._backward_pass is not None:
                raise RuntimeError(
                    f"{type(self).__name__}(in_backward=True): backward() ran again before step(), but this optimizer "
                    "updated the parameters in the last backward: gradients cannot accumulate over micro-batches. "
                    "Call step() after each backward(), or build the optimizer with in_backward=False")
            hooked = next((q for q in self.params if q._grad_hooks), None)  # checked before any update
            if hooked is not None:
                raise RuntimeError(f"{type(self).__name__}(in_backward=True): a grad hook waits for the gradient of "
                                   f"a parameter of shape {tuple(hooked.shape)} (register_grad_hook: data "
                                   "parallelism, say), so its update cannot come first; use in_backward=False")
            self._backward_pass = backward_pass
            self.begin_step()
        self.update_parameter(p, *self._value_and_grad(p))

    def check_hyperparameters(self, values):
        """`values` ({name: value} of `hyperparameters`), checked: the values as the update reads them, or
        ValueError naming the optimizer and the first bad one (the constructor and load_state_dict both ask)."""
        checked = dict(values)
        if "t" in checked:
            checked["t"] = check_count(type(self).__name__, "t", checked["t"])
        return checked

    def reset_grad(self):
        if memory_hook.PREDICTOR is not None:  # ndl.memory.predict: the gradients counted as freed, kept
            return memory_hook.PREDICTOR.reset_grad(self)
        for p in self.params:  # (in backward, no parameter holds a gradient when backward returns)
            p.grad = None

    # ----- state: stored per parameter and slot, loaded as float32 for the update ---------------------------------
    def allocate_state(self):
        """Allocate the state (zeros, read as unwritten until an update writes it) of every parameter that takes
        gradients, on its device: done once the optimizer is built, and again after load_state_dict for what the
        state dict did not hold."""
        if self.offload_state:  # host memory, made by each parameter's first update
            return
        for p in self.params:
            if not p.requires_grad:
                continue
            for slot in ("master",) + tuple(self.slots_of(p)):
                layout = self._state_layout(p, slot)
                if layout is not None and getattr(self, slot).get(p) is None:
                    getattr(self, slot)[p] = _new_state(layout, p.device)
                    self._unwritten.add((slot, id(p)))

    def _fetch(self, p, slot):
        """Parameter p's state `slot` as stored (encoded), on p's device; None before its first update."""
        stored = getattr(self, slot).get(p)
        if stored is None or (slot, id(p)) in self._unwritten:
            return None
        if not self.offload_state:
            return stored
        stored, ready = self._incoming.pop((p, slot), None) or _to_device(stored, p.device)
        ready()
        return stored

    def _keep(self, p, slot, stored):
        """Keep encoded state `stored` as parameter p's `slot` (on the host when offloading)."""
        state = getattr(self, slot)
        state[p] = _to_host(stored, state.get(p)) if self.offload_state else stored
        self._unwritten.discard((slot, id(p)))

    def _prefetch(self, p):
        """Start bringing parameter p's offloaded state to its device, to overlap the update before p's."""
        for slot in ("master",) + tuple(self.slots):
            stored = getattr(self, slot).get(p)
            if stored is not None:
                self._incoming[(p, slot)] = _to_device(stored, p.device)

    def _stored(self):
        for slot in ("master",) + tuple(self.slots):
            yield from getattr(self, slot).values()

    def state_bytes(self):
        """Bytes of optimizer state (moments, master copies) held on the device: exactly what the device allocator
        holds for it between steps; 0 with offload_state=True."""
        return 0 if self.offload_state else sum(_nbytes(s) for s in self._stored())

    def host_state_bytes(self):
        """Bytes of optimizer state offloaded to host memory (0 unless offload_state=True)."""
        return sum(_nbytes(s) for s in self._stored()) if self.offload_state else 0

    # ----- saving and resuming: PyTorch's state_dict() / load_state_dict() ------------------------------------------
    def options(self):
        """The choices made at construction that fix the layout of the state. `load_state_dict` checks that a
        state dict was saved with the same ones (it does not change them: build the optimizer with them)."""
        return {"master_weights": self.master_weights, "stochastic_rounding": self.stochastic_rounding}

    def state_dict(self):
        """Everything a resumed run needs to continue bit for bit, in PyTorch's layout (NumPy copies, for ndl.save):

            {"state": {i: {slot: array, ...}},   # parameter i's stored state, slots that have a value (+ "master")
             "param_groups": [{<hyperparameters>, <options()>, "rounding_steps": n, "params": [0, 1, ...]}]}

        i is the parameter's position in the list given to the constructor. The hyper-parameters include the step
        count t where the update reads one; "rounding_steps" seeds stochastic rounding. An 8-bit moment is the pair
        (uint8 codes, float32 absmax per block). Offloaded state is saved alike: where the state lives is the
        loading optimizer's own choice (offload_state)."""
        state = {}
        for i, p in enumerate(self.params):
            entry = {slot: _host_copy(getattr(self, slot)[p]) for slot in ("master",) + tuple(self.slots)
                     if getattr(self, slot).get(p) is not None and (slot, id(p)) not in self._unwritten}
            if entry:
                state[i] = entry
        group = {name: getattr(self, name) for name in self.hyperparameters}
        group.update(self.options(), rounding_steps=self._rounding_steps, params=list(range(len(self.params))))
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict):
        """Restore `state_dict()`'s result (or what ndl.load gave back for it): each parameter's state on the
        parameter's device (in host memory with offload_state=True), the hyper-parameters and step counts.

        The parameter count, the options and every state array's shape and dtype are checked before anything is
        changed: a mismatch raises ValueError naming it, and leaves the optimizer as it was."""
        owner = f"{type(self).__name__}.load_state_dict"
        group = _the_group(owner, state_dict, list(self.hyperparameters) + list(self.options()))
        if len(group["params"]) != len(self.params):
            raise ValueError(f"{owner}: the state dict is for {len(group['params'])} parameters, this optimizer "
                             f"has {len(self.params)}")
        for key, value in self.options().items():
            if group[key] != value:
                raise ValueError(f"{owner}: the state dict was saved with {key}={group[key]!r}, this optimizer has "
                                 f"{key}={value!r}")
        restored = {slot: {} for slot in ("master",) + tuple(self.slots)}
        for key, entry in state_dict["state"].items():
            i = int(key) if isinstance(key, int) or (isinstance(key, str) and key.isdigit()) else -1
            if not 0 <= i < len(self.params) or not isinstance(entry, dict):
                raise ValueError(f"{owner}: state key {key!r} is not a parameter index below {len(self.params)} "
                                 "with a dict of slots")
            for slot, saved in entry.items():
                restored_slot = restored.get(slot)
                if restored_slot is None:
                    raise ValueError(f"{owner}: parameter {i} has state {slot!r} in the state dict; this "
                                     f"optimizer's state is {', '.join(restored)}")
                restored_slot[self.params[i]] = self._restored(owner, i, slot, saved)
        values = self.check_hyperparameters({name: _restore(getattr(self, name), group[name])
                                             for name in self.hyperparameters})
        rounding_steps = check_count(owner, "rounding_steps", group["rounding_steps"])
        for name, value in values.items():  # all checked: now change the optimizer
            setattr(self, name, value)
        self._rounding_steps = rounding_steps
        self._unwritten.clear()
        for slot, values in restored.items():
            getattr(self, slot).clear()
            for p, stored in values.items():
                self._keep(p, slot, stored)
        self.allocate_state()  # what the state dict did not hold: written by its first update, as in a new optimizer
        if self.offload_state:  # the host copies complete before anything reads them
            for device in {str(p.device): p.device for p in self.params}.values():
                array_api.wait_for_copies(device)

    def _restored(self, owner, i, slot, saved):
        """Saved state `slot` of parameter i as the optimizer stores it (arrays on the parameter's device), or
        ValueError if it is not of the shape and dtype the update expects."""
        p = self.params[i]
        layout = self._state_layout(p, slot)
        if layout is None:
            raise ValueError(f"{owner}: parameter {i} has state {slot!r} in the state dict, but this optimizer "
                             f"keeps none for it (shape {tuple(p.shape)}, dtype {_dtype_name(p.dtype)})")
        arrays = tuple(saved) if isinstance(saved, (tuple, list)) else (saved,)
        got = [np.asarray(a.numpy() if hasattr(a, "numpy") else a) for a in arrays]
        if [(a.shape, _dtype_name(a.dtype)) for a in got] != layout:
            raise ValueError(f"{owner}: parameter {i}'s state {slot!r} is "
                             f"{[(a.shape, _dtype_name(a.dtype)) for a in got]} (shape, dtype) in the state dict, "
                             f"but this optimizer needs {layout}")
        out = tuple(array_api.array(a, dtype=dtype, device=p.device) for a, (_, dtype) in zip(got, layout))
        return out if isinstance(saved, (tuple, list)) else out[0]

    def _state_layout(self, p, slot):
        """[(shape, dtype)] of parameter p's stored state `slot` (two entries for a pair such as an 8-bit moment),
        or None if p has no such state here."""
        dtype = _dtype_name(p.dtype)
        if slot == "master":
            return [(tuple(p.shape), "float32")] if self._keeps_master(p) else None
        shape = self._state_shape(p, slot)
        if shape is None:
            return None
        return [(shape, dtype if dtype not in _LOW or self.master_weights is False else "float32")]

    def _state_shape(self, p, slot):
        """The shape of parameter p's state `slot`: p's own (Adafactor's factored moments differ)."""
        return tuple(p.shape)

    # ----- the parameters and their gradients, in float32 -----------------------------------------------------------
    def _keeps_master(self, p):
        return self.master_weights is not False and _is_low(p.realize_cached_data())

    def _with_grads(self):
        """(parameter, its value, its gradient) for every parameter that has a grad (`_value_and_grad`)."""
        params = [p for p in self.params if p.grad is not None]
        try:
            for k, p in enumerate(params):
                if self.offload_state:  # p's state is on its way (prefetched), start the next parameter's
                    if k == 0:
                        self._prefetch(p)
                    if k + 1 < len(params):
                        self._prefetch(params[k + 1])
                yield (p, *self._value_and_grad(p))
                if p.grad.stored is not None:  # a gradient a store holds came back for this update only
                    release(p.grad)
        finally:
            if self.offload_state:  # every copy complete (the host's new state too) before anything is dropped
                for device in {str(p.device): p.device for p in params}.values():
                    array_api.wait_for_copies(device)
                self._incoming.clear()

    def _value_and_grad(self, p):
        """p's value for the update, the float32 master copy of a 16-bit parameter (made on first use) or p's own
        array, and its gradient as it is: `_chunks` widens both to float32 a chunk at a time (issue 47)."""
        theta = p.realize_cached_data()
        if self._keeps_master(p):
            master, new = self._open(p, "master")
            if new:  # the first update: the master copy is the parameter's value, widened
                flat_view(master)[:] = flat_view(theta)
            theta = master
        return theta, p.grad.realize_cached_data()

    # ----- an update in place, a chunk at a time: its temporaries are chunk-sized ---------------------------------
    def _chunks(self, theta, grad, align=1):
        """(start, theta, grad) for the chunks of at most CHUNK elements (a multiple of `align`) of the flat value
        and gradient, in float32, with weight_decay * theta added to the gradient (the course's coupled decay)."""
        theta, grad, n = flat_view(theta), flat_view(grad), theta.size
        step = max(align, CHUNK // align * align)
        for start in range(0, n, step):
            th, g = widen(theta[start:start + step]), widen(grad[start:start + step])
            if self.l2_weight_decay and self.weight_decay:
                g = g + th * self.weight_decay
            yield start, th, g

    def _open(self, p, slot):
        """(p's stored state `slot`, whether it is new): a new one (allocated by `allocate_state`, or here when
        offloaded; zeros of the stored layout, read as unwritten) is written in place by the update, chunk by
        chunk, as an old one is; `_finish` keeps both."""
        stored = self._fetch(p, slot)
        if stored is not None:
            return stored, False
        allocated = getattr(self, slot).get(p) if (slot, id(p)) in self._unwritten else None
        return (_new_state(self._state_layout(p, slot), p.device) if allocated is None else allocated), True

    def _update(self, p, theta, new, start=0):
        """Store new float32 values of p's flat elements [start, start + new.size): into its master copy `theta`
        if it keeps one, and (rounded) into the parameter's own array, in place."""
        stop, data = start + new.size, flat_view(p.realize_cached_data())
        if self._keeps_master(p):
            flat_view(theta)[start:stop] = new
        if self.stochastic_rounding:
            data[start:stop] = array_api.round_stochastic(new, self.rounding_seed(p), start)
        else:
            data[start:stop] = new  # (converted on the way to a 16-bit parameter's dtype: rounded to nearest)

    def rounding_seed(self, p):
        """The stochastic-rounding seed of p's update this step, a fresh one per parameter and step whatever order
        they are updated in (`_update`'s round_stochastic, a fused kernel's rounding_seed); None: to nearest."""
        return self._rounding_base + self._position[id(p)] + 1 if self.stochastic_rounding else None

    def _finish(self, p, theta, **state):
        """After p's update: its master copy and `state` (slot=stored) kept (back to the host when offloaded), and
        p's version counts the write (rule 4c: its array was written in place)."""
        if self._keeps_master(p):
            self._keep(p, "master", theta)
        for slot, stored in state.items():
            self._keep(p, slot, stored)
        p.version += 1
