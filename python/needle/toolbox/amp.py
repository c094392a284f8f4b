"""Mixed precision: `autocast` runs the heavy ops in 16 bits, `GradScaler` keeps float16 gradients from underflowing.

    model, opt = ..., ndl.optim.Adam(model.parameters())       # parameters stay float32 (the master weights)
    scaler = ndl.amp.GradScaler()                               # float16 only; bfloat16 needs no scaling
    with ndl.amp.autocast("float16"):
        loss = loss_fn(model(x), y)                             # matmuls and element-wise ops in float16
    scaler.scale(loss).backward()
    scaler.step(opt)                                            # unscales; skips the step on inf/NaN
    scaler.update()                                             # halves the scale after a skip, grows it later

Micikevicius et al. (2017), "Mixed Precision Training": 16-bit activations and gradients, float32 master weights,
loss scaling. Which op runs in which dtype is declared on the op (`Op.autocast`, see autograd.py): "low" ops
(matmul, convolution, element-wise arithmetic, exp/tanh/relu/sigmoid) get 16-bit inputs; "float32" ops (sums and
means, so layer norm's statistics; log, log-sum-exp, log-softmax; the losses) get float32 inputs; all others run
in their inputs' dtype. Every kernel computes in float32 and rounds once on store, whatever the storage.

The casts are graph nodes. A cast of a parameter is made once per `autocast` block and kept (the 16-bit weight
copy that mixed precision costs), and made again once the parameter was written (an optimizer step inside the
block: the old copy holds the old weights); a cast of an activation is marked `drop` and recomputed if a
backward step needs it, so the float32 input it came from and the 16-bit result are never both held. The active
context lives in autograd (entered and left through `autograd.set_autocast`); `TensorOp` and `TensorTupleOp`
apply it.
"""
import math

import numpy

from ..autograd import Tensor, active_autocast, find_topo_sort, lazy_mode, set_autocast
from ..backend_selection import array_api
from ..ops import Cast
from ..regions import apply_decision
from ..specs import dtype_named

__all__ = ["GradScaler", "autocast", "is_autocast_enabled"]

_LOW = ("float16", "bfloat16")
_FLOATS = ("float32", "float16", "bfloat16")


def _name(dtype):
    return str(numpy.dtype(dtype))


def is_autocast_enabled():
    return active_autocast() is not None


class autocast:
    """`with autocast("bfloat16"):` (or "float16") — ops applied inside run in the 16-bit dtype where their
    `Op.autocast` says "low" and in float32 where it says "float32". `enabled=False` turns it off (nests)."""

    def __init__(self, dtype="bfloat16", enabled=True):
        name = dtype_named(dtype, "autocast") if dtype not in _LOW else dtype
        if name not in _LOW:
            raise ValueError(f"autocast: dtype must be 'bfloat16' or 'float16' (or 'bf16', 'fp16'), got {dtype!r}")
        dtype = name
        self.dtype = dtype
        self.enabled = enabled
        self._weights = {}  # (id(parameter), dtype) -> (parameter, its version, its cast): one copy per version
        self._previous = []

    def __enter__(self):
        self._previous.append(set_autocast(self if self.enabled else None))
        return self

    def __exit__(self, *exc):
        set_autocast(self._previous.pop())
        if not self._previous:
            self._weights.clear()
        return False

    def cast_inputs(self, op, inputs):
        """`inputs` of `op`, the floating ones cast to the dtype `op.autocast` asks for."""
        target = self.dtype if op.autocast == "low" else "float32"
        return tuple(self._cast(x, target) if isinstance(x, Tensor) and _name(x.dtype) in _FLOATS
                     and _name(x.dtype) != target else x for x in inputs)

    def _cast(self, x, dtype):
        if x.op is None and x.requires_grad:  # a parameter: cast once per block and version, kept
            key = (id(x), dtype)
            if key not in self._weights or self._weights[key][1] != x.version:
                self._weights[key] = (x, x.version, Cast(dtype)(x))
            return self._weights[key][2]
        with lazy_mode(True):  # built unrealized, so that it is marked before anything computes it
            out = Cast(dtype)(x)
        apply_decision(out, False)  # dropped: recomputed from the parameter where backward needs it
        return out


class GradScaler:
    """Dynamic loss scaling for float16 (PyTorch's `torch.amp.GradScaler` semantics).

    The loss is multiplied by `scale` before backward, so small gradients stay representable in float16; `step`
    divides the gradients by it again and skips the optimizer step if any is inf or NaN; `update` then halves
    the scale (after a skip) or doubles it after `growth_interval` clean steps in a row.
    """

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 enabled=True):
        # Written so that NaN fails every test (NaN <= 0 is False: `init_scale=nan` used to be accepted).
        if not (0 < init_scale < math.inf and 1.0 < growth_factor < math.inf and 0.0 < backoff_factor < 1.0
                and growth_interval >= 1):
            raise ValueError("GradScaler: need a finite init_scale > 0, a finite growth_factor > 1, "
                             f"0 < backoff_factor < 1 and growth_interval >= 1, got {init_scale}, {growth_factor}, "
                             f"{backoff_factor}, {growth_interval}")
        self.enabled = enabled
        self._scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._clean_steps = 0
        self._unscaled = set()  # ids of optimizers unscaled since the last update
        self._found_inf = None

    def get_scale(self):
        return self._scale if self.enabled else 1.0

    def scale(self, loss):
        """The loss times the scale (a Tensor; call .backward() on it)."""
        if not self.enabled:
            return loss
        updated = next((n.optimizer for n in find_topo_sort([loss]) if n.optimizer is not None), None)
        if updated is not None:  # (before backward: afterwards the parameters would have taken the step)
            raise ValueError(f"GradScaler: {type(updated).__name__}(in_backward=True) updates the parameters inside "
                             "backward, so a step whose gradients overflow could not be skipped; use bfloat16 "
                             "autocast (it needs no scaler) or in_backward=False")
        return loss * self._scale

    def unscale_(self, optimizer):
        """Divide the gradients of `optimizer`'s parameters by the scale, in place (once per step), and note
        whether any is inf or NaN. Call it before clipping gradients."""
        if not self.enabled or id(optimizer) in self._unscaled:
            return
        self._unscaled.add(id(optimizer))
        inv = 1.0 / self._scale
        found = False
        for p in optimizer.params:
            if p.grad is None:
                continue
            g = p.grad.realize_cached_data()
            values = array_api.to_numpy(g)
            if not numpy.isfinite(values.astype(numpy.float32)).all():
                found = True
            p.grad = Tensor(g * inv, device=p.grad.device, requires_grad=False)
        self._found_inf = bool(found or self._found_inf)

    def step(self, optimizer):
        """Unscale (if not done yet), then `optimizer.step()` unless a gradient was inf or NaN. Returns whether
        the step was taken."""
        if not self.enabled:
            optimizer.step()
            return True
        self.unscale_(optimizer)
        if self._found_inf:
            return False
        optimizer.step()
        return True

    def update(self):
        """Adjust the scale after a step: backoff after inf/NaN, growth after `growth_interval` clean steps."""
        if not self.enabled:
            return
        if self._found_inf:
            self._scale *= self.backoff_factor
            self._clean_steps = 0
        else:
            self._clean_steps += 1
            if self._clean_steps >= self.growth_interval:
                self._scale *= self.growth_factor
                self._clean_steps = 0
        if not math.isfinite(self._scale) or self._scale <= 0:
            raise FloatingPointError(f"GradScaler: the scale became {self._scale}")
        self._unscaled.clear()
        self._found_inf = None

    def state_dict(self):
        """What decides the scaler's future steps: the scale, the clean steps counted toward its next growth (PyTorch
        calls them _growth_tracker) and the growth and backoff settings. Call it after `update()`."""
        if self._unscaled:
            raise RuntimeError("GradScaler.state_dict(): called between step() and update(); the step's outcome "
                               "would be lost (save after update())")
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "clean_steps": self._clean_steps}

    def load_state_dict(self, state):
        """Restore `state_dict()`'s result; ValueError naming a missing or invalid entry (nothing changed then)."""
        keys = ("scale", "growth_factor", "backoff_factor", "growth_interval", "clean_steps")
        missing = [k for k in keys if not isinstance(state, dict) or k not in state]
        if missing:
            raise ValueError(f"GradScaler.load_state_dict: the state lacks {', '.join(missing)}")
        scale, growth, backoff = (float(state[k]) for k in keys[:3])
        interval, clean = int(state["growth_interval"]), int(state["clean_steps"])
        if not (math.isfinite(scale) and scale > 0 and growth > 1 and 0 < backoff < 1 and interval >= 1
                and 0 <= clean < interval):
            raise ValueError("GradScaler.load_state_dict: need a finite scale > 0, growth_factor > 1, 0 < "
                             "backoff_factor < 1, growth_interval >= 1 and 0 <= clean_steps < growth_interval, got "
                             f"{scale}, {growth}, {backoff}, {interval}, {clean}")
        self._scale, self.growth_factor, self.backoff_factor = scale, growth, backoff
        self.growth_interval, self._clean_steps = interval, clean
