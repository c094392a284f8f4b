"""The optimizer base class: parameters, master weights, stochastic rounding, state accounting.

Updates work on raw arrays (a parameter's `cached_data`), so a step never grows the graph. A step replaces a
parameter's array by a new one, never writes into `param.grad`, and keeps the parameter's dtype (hyper-parameters
are plain Python floats, so float32 stays float32 under NEEDLE_BACKEND=np as well). Parameters without a
gradient are skipped.

16-bit parameters (float16, bfloat16): the update is always computed in float32. With `master_weights=True`
(the default for them) the optimizer keeps a float32 copy of each such parameter, updates the copy and rounds it
into the parameter, so updates smaller than a 16-bit step accumulate instead of vanishing (Micikevicius et al.
2017). With `master_weights=False` ("pure bf16") the parameters and the optimizer's state stay 16-bit, and
`stochastic_rounding=True` rounds each new bfloat16 weight up or down with probability given by the dropped
fraction, so that small updates survive on average (Kalamkar et al. 2019; Zamirai et al. 2020).
"""
import numpy as np

from ..backend_selection import array_api

_LOW = ("float16", "bfloat16")


def _as_dtype(array, like):
    """`array` in the dtype of `like` (arithmetic with Python floats may have promoted a numpy array)."""
    return array_api.cast_like(array, like)


def _is_low(array):
    return str(np.dtype(array.dtype)) in _LOW


def _widen(array):
    """A 16-bit array as float32 (any other array as it is): optimizer arithmetic is float32."""
    return array_api.astype(array, "float32") if _is_low(array) else array


class Optimizer:
    """Holds the parameters; `step()` updates them from their `.grad`, `reset_grad()` clears the gradients."""

    def __init__(self, params, master_weights=None, stochastic_rounding=False):
        self.params = list(params)
        if stochastic_rounding and master_weights is None:
            master_weights = False  # stochastic rounding is how pure 16-bit training keeps tiny updates
        self.master_weights = master_weights
        self.stochastic_rounding = bool(stochastic_rounding)
        self.master = {}  # 16-bit parameter -> its float32 master copy
        self._rounding_steps = 0
        if self.stochastic_rounding:
            if master_weights:
                raise ValueError(f"{type(self).__name__}: stochastic_rounding is for pure 16-bit training "
                                 "(master_weights=False); master weights round to nearest")
            bad = sorted({str(np.dtype(p.dtype)) for p in self.params} - {"bfloat16"})
            if bad:
                raise ValueError(f"{type(self).__name__}: stochastic_rounding needs bfloat16 parameters, got "
                                 f"{', '.join(bad)}")

    def step(self):
        raise NotImplementedError()

    def reset_grad(self):
        for p in self.params:
            p.grad = None

    def _keeps_master(self, p):
        return self.master_weights is not False and _is_low(p.realize_cached_data())

    def _with_grads(self):
        """(parameter, its value, its gradient with weight decay added) for every parameter that has a grad; for a
        16-bit parameter the value is its float32 master copy (or the widened value) and the gradient float32."""
        for p in self.params:
            if p.grad is None:
                continue
            theta = p.realize_cached_data()
            if self._keeps_master(p):
                if p not in self.master:
                    self.master[p] = _widen(theta)
                theta = self.master[p]
            else:
                theta = _widen(theta)
            grad = _widen(p.grad.realize_cached_data())
            if self.weight_decay:
                grad = grad + theta * self.weight_decay
            yield p, theta, grad

    def _state(self, p, value):
        """Optimizer state as stored: 16-bit for a pure 16-bit parameter, else as computed (float32)."""
        if self.master_weights is False and _is_low(p.realize_cached_data()):
            return array_api.astype(value, p.dtype)
        return value

    def _update(self, p, theta):
        """Store a parameter's new float32 value: into its master copy and (rounded) into the parameter."""
        old = p.realize_cached_data()
        if not _is_low(old):
            p.cached_data = _as_dtype(theta, old)
            return
        if p in self.master:
            self.master[p] = theta
        if self.stochastic_rounding:
            self._rounding_steps += 1  # a fresh seed per parameter and step: the noise never repeats
            p.cached_data = array_api.round_stochastic(theta, self._rounding_steps)
        else:
            p.cached_data = array_api.astype(theta, old.dtype)

    def state_bytes(self):
        """Bytes held by the optimizer's state (moments, master copies)."""
        arrays = list(self.master.values())
        for name in ("u", "m", "v"):
            arrays += list(getattr(self, name, {}).values())
        return int(sum(a.size * np.dtype(a.dtype).itemsize for a in arrays))
