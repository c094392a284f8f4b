"""Adafactor (Shazeer & Stern 2018): Adam's second moment in n + m numbers for an n x m matrix.

For a parameter of two or more dimensions, the running mean of g^2 over the last two axes is kept only as its row
means R (shape (..., n)) and column means C (shape (..., m)); the estimate of the full matrix is the rank-1
V ~ R C^T / mean(R), which is exact when g^2 is rank 1. Vectors keep the full V. The update follows the paper and
the common reference implementations (HF transformers, fairseq):

  t-th step:   beta2_t = 1 - t^decay_rate;   G = g^2 + eps1
  factored:    R <- beta2_t R + (1 - beta2_t) mean_cols(G);   C <- beta2_t C + (1 - beta2_t) mean_rows(G)
               u = g / sqrt(R C^T / mean(R))
  full:        V <- beta2_t V + (1 - beta2_t) G;   u = g / sqrt(V)
  clipping:    u <- u / max(1, RMS(u) / clip_threshold)
  step size:   lr_t = lr, or with relative_step min(1e-6 t if warmup_init else 1e-2, 1 / sqrt(t)),
               times max(eps2, RMS(theta)) with scale_parameter
  momentum:    with beta1, m <- beta1 m + (1 - beta1) lr_t u and the step is m (else lr_t u; no first moment kept)
  update:      theta <- theta - lr_t weight_decay theta - step   (decoupled weight decay)

RMS(x) = sqrt(mean(x^2)). One step count t for all parameters (as needle's Adam).

The update works in place, a chunk of whole rows at a time (optimizer.CHUNK elements), so its temporaries are
chunk-sized (issue 47): one pass for R and C, one for RMS(u), one that writes; u is computed twice rather than kept.
The arithmetic per element is the whole-array form's; only the sums over chunks differ in order: RMS(theta), RMS(u)
(each chunk's sum in the backend, the chunk sums added in float64) and, for a matrix larger than a chunk, its column
sums (added chunk by chunk in float32), so those may differ from a whole-array sum in the last bits. A float32
parameter takes the same passes as three backend calls over the whole array (adafactor_moments, adafactor_sumsq,
adafactor_step: src/README.md), which sum in the chunks' order and so give the chunk loop's bytes.
"""
import math

import numpy as np

from ...backend_selection import array_api
from ...optim.optimizer import CHUNK, Optimizer, flat_view, widen, check_range

_KERNELS = hasattr(array_api, "adafactor_step")  # the fused passes (not on NEEDLE_BACKEND=np: its sums differ)


def _scalar(x):
    return float(np.asarray(array_api.to_numpy(x)).reshape(-1)[0])


def _rms(chunks):
    """RMS of the array made of `chunks` (float32): each chunk's sum of squares from the backend, added in float64."""
    total = size = 0
    for x in chunks:
        total, size = total + _scalar(array_api.sum(x * x)), size + x.size
    return math.sqrt(total / size)


def _mean(x, axis):
    """Mean over `axis`, the axis kept (length 1) so that it broadcasts back."""
    return array_api.sum(x, axis=axis, keepdims=True) / x.shape[axis]


def _pieces(array):
    """(start, float32 chunk) of the flat array, chunks of CHUNK elements."""
    flat = flat_view(array)
    for start in range(0, array.size, CHUNK):
        yield start, widen(flat[start:start + CHUNK])


def _write(stored, value):
    """`value` written into the array `stored` (converted to its dtype), in place; `stored` returned."""
    flat_view(stored)[0:stored.size] = flat_view(value)
    return stored


def _row_chunks(shape):
    """(first row, rows, matrix) of chunks of whole rows of a parameter seen as matrices (..., n, m): at most CHUNK
    elements (one row at least), never two matrices."""
    n, m = shape[-2], shape[-1]
    k = max(1, CHUNK // max(m, 1))
    for b in range(math.prod(shape[:-2])):
        for r in range(0, n, k):
            yield b * n + r, min(k, n - r), b


class Adafactor(Optimizer):
    """Adafactor with factored second moments for parameters of 2 or more dimensions; see the module docstring."""

    slots = ("row", "col", "v", "m")
    hyperparameters = ("lr", "beta1", "eps", "clip_threshold", "decay_rate", "relative_step", "scale_parameter",
                       "warmup_init", "weight_decay", "t")

    def __init__(self, params, lr=None, beta1=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8,
                 relative_step=True, scale_parameter=True, warmup_init=False, weight_decay=0.0, master_weights=None,
                 stochastic_rounding=False, offload_state=False, in_backward=False):
        super().__init__(params, master_weights, stochastic_rounding, offload_state, in_backward)
        self.__dict__.update(self.check_hyperparameters(dict(
            lr=lr, beta1=beta1, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate,
            relative_step=relative_step, scale_parameter=scale_parameter, warmup_init=warmup_init,
            weight_decay=weight_decay, t=0)))

    def check_hyperparameters(self, values):
        checked, v = super().check_hyperparameters(values), values
        if v["lr"] is not None and v["relative_step"]:
            raise ValueError("Adafactor: a manual lr and relative_step=True exclude each other "
                             "(pass relative_step=False to use lr)")
        if v["lr"] is None and not v["relative_step"]:
            raise ValueError("Adafactor: relative_step=False needs an lr")
        if v["warmup_init"] and not v["relative_step"]:
            raise ValueError("Adafactor: warmup_init=True needs relative_step=True")
        checked["lr"] = None if v["lr"] is None else check_range("Adafactor", "lr", v["lr"], 0, math.inf)
        checked["beta1"] = None if v["beta1"] is None else check_range("Adafactor", "beta1", v["beta1"], 0, 1)
        if not isinstance(v["eps"], (tuple, list)) or len(v["eps"]) != 2:
            raise ValueError(f"Adafactor: eps must be a pair (eps1, eps2), got {v['eps']!r}")
        checked["eps"] = tuple(check_range("Adafactor", "eps", e, 0, math.inf) for e in v["eps"])
        checked["clip_threshold"] = check_range("Adafactor", "clip_threshold", v["clip_threshold"], 0, math.inf)
        # beta2_t = 1 - t^decay_rate: decay_rate <= 0
        checked["decay_rate"] = check_range("Adafactor", "decay_rate", v["decay_rate"], -math.inf, 0, high_open=False)
        checked["weight_decay"] = check_range("Adafactor", "weight_decay", v["weight_decay"], 0, math.inf)
        for name in ("relative_step", "scale_parameter", "warmup_init"):
            checked[name] = bool(v[name])
        return checked

    def _step_size(self, theta):
        lr = self.lr
        if self.relative_step:
            lr = min(1e-6 * self.t if self.warmup_init else 1e-2, 1 / math.sqrt(self.t))
        if self.scale_parameter:
            lr *= max(self.eps[1], _rms(x for _, x in _pieces(theta)))
        return lr

    l2_weight_decay = False  # decoupled: theta <- theta - lr_t weight_decay theta

    def begin_step(self):
        super().begin_step()
        self.t += 1
        self.beta2_t = 1 - self.t ** self.decay_rate

    def update_parameter(self, p, theta, grad):
        if theta.size == 0:  # nothing to update, and its RMS (the relative step, the clipping) is undefined
            return
        lr, state = self._step_size(theta), {}
        if all(str(a.dtype) == "float32" for a in (p.realize_cached_data(), grad)) and _KERNELS:
            self._update_fused(p, theta, grad, lr, state)
            return self._finish(p, theta, **state)
        if self.beta1 is not None:
            state["m"], new_m = self._open(p, "m")
            flat_m = flat_view(state["m"])
        us = self._factored(p, grad, state) if len(grad.shape) >= 2 else self._unfactored(p, grad, state)
        scale = lr / max(1.0, _rms(u for _, u in us(False)) / self.clip_threshold)
        for start, u in us(True):  # the same u again, now applied
            u, th, end = u * scale, widen(flat_view(theta)[start:start + u.size]), start + u.size
            if self.beta1 is not None:
                u = u * (1 - self.beta1) if new_m else widen(flat_m[start:end]) * self.beta1 + u * (1 - self.beta1)
                flat_m[start:end] = u
            if self.weight_decay:
                th = th - th * (self.weight_decay * lr)
            self._update(p, theta, th - u, start)
        self._finish(p, theta, **state)

    def _update_fused(self, p, theta, grad, lr, state):
        """The float32 update in three backend calls, each over the whole parameter and summing in the chunks'
        order (src/README.md, adafactor_*): the bytes of the chunk loop below."""
        shape, beta2, eps1 = tuple(grad.shape), self.beta2_t, self.eps[0]
        n, m = shape[-2:] if len(shape) >= 2 else (theta.size, 1)
        k = max(1, CHUNK // m) if len(shape) >= 2 else CHUNK  # rows per chunk, as _row_chunks and _pieces take them
        (v, first), rc = (None, False), None
        if len(shape) >= 2:
            r, c = self._factors(p, *array_api.adafactor_moments(grad, n, m, k, eps1), state)
            rc = array_api.reshape(r, (-1,)), array_api.reshape(c, (-1,))
        else:
            v, first = self._open(p, "v")
            state["v"] = v
        total = 0.0
        for x in array_api.to_numpy(array_api.adafactor_sumsq(grad, rc, v, first, n, m, k, beta2, eps1)).tolist():
            total += x  # in order, in float64, as _rms adds the chunks' sums
        scale = lr / max(1.0, math.sqrt(total / theta.size) / self.clip_threshold)
        if self.beta1 is not None:
            state["m"], new_m = self._open(p, "m")
        array_api.adafactor_step(theta, grad, rc, v, state.get("m"), first, self.beta1 is not None and new_m, n, m,
                                 beta2, eps1, scale, self.beta1, lr, self.weight_decay)

    def _unfactored(self, p, grad, state):
        """us(write): (start, flat u chunk) with V updated from g^2 + eps1 (written into V when `write`)."""
        beta2, eps1 = self.beta2_t, self.eps[0]
        state["v"], new = self._open(p, "v")
        flat_v = flat_view(state["v"])

        def us(write):
            for start, g in _pieces(grad):
                end, g2 = start + g.size, g * g + eps1
                v = g2 * (1 - beta2) if new else widen(flat_v[start:end]) * beta2 + g2 * (1 - beta2)
                if write:
                    flat_v[start:end] = v
                yield start, g * v ** -0.5
        return us

    def _factored(self, p, grad, state):
        """us(write): (start, u chunk) for u = g / sqrt(R C^T / mean(R)), R and C updated (and kept) first."""
        shape = tuple(grad.shape)
        n, m = shape[-2:]
        grad = array_api.reshape(flat_view(grad), (-1, m))
        wide = "float64" if str(grad.dtype) == "float64" else "float32"  # (float64 under NEEDLE_BACKEND=np)
        row_now = array_api.empty((grad.shape[0], 1), dtype=wide, device=p.device)
        col_sum = [None] * math.prod(shape[:-2])
        for r, k, b in _row_chunks(shape):  # R's new rows and C's sums of g^2 + eps1, whole rows at a time
            g = widen(grad[r:r + k])
            g2 = g * g + self.eps[0]
            row_now[r:r + k] = _mean(g2, -1)
            s = array_api.sum(g2, axis=0, keepdims=True)
            col_sum[b] = s if col_sum[b] is None else col_sum[b] + s
        r, c = self._factors(p, row_now, (array_api.stack(col_sum) if len(col_sum) > 1 else col_sum[0]) / n, state)
        r, c = array_api.reshape(r, (-1, 1)), array_api.reshape(c, (-1, m))

        def us(write):
            for r0, k, b in _row_chunks(shape):
                g = widen(grad[r0:r0 + k])
                factor = array_api.broadcast_to(r[r0:r0 + k], g.shape) * array_api.broadcast_to(c[b:b + 1], g.shape)
                yield r0 * m, array_api.reshape(g * factor, (-1,))
        return us

    def _factors(self, p, row_now, col_now, state):
        """(r, c): r = (R / mean(R))^-0.5 per row, c = C^-0.5 per column, after R and C take this step's row and
        column means of g^2 + eps1."""
        (row, new), (col, _) = self._open(p, "row"), self._open(p, "col")
        beta2 = self.beta2_t
        row_now, col_now = array_api.reshape(row_now, row.shape), array_api.reshape(col_now, col.shape)
        rows = row_now * (1 - beta2) if new else widen(row) * beta2 + row_now * (1 - beta2)
        cols = col_now * (1 - beta2) if new else widen(col) * beta2 + col_now * (1 - beta2)
        state["row"], state["col"] = _write(row, rows), _write(col, cols)
        return (rows / array_api.broadcast_to(_mean(rows, -2), rows.shape)) ** -0.5, cols ** -0.5  # r: normalized

    def workspace_bytes(self, p):
        """The fused float32 update's temporaries, exactly (ndl.memory.predict counts them): the step's row and
        column means, R and C's new values and their normalized factors, at most four row or column vectors beside
        two of the other (three of each on the first update: its state has no old value to widen), the chunks'
        sums, and with scale_parameter the RMS's chunk of squares; a 16-bit update's: Optimizer's chunked bound."""
        data = p.realize_cached_data()
        if str(data.dtype) != "float32" or not _KERNELS:
            return super().workspace_bytes(p)
        shape, rms = tuple(p.shape), (4 * min(data.size, CHUNK) + 4) if self.scale_parameter else 0
        if len(shape) < 2:
            return max(rms, 4 * -(-data.size // CHUNK))
        n, m, matrices = shape[-2], shape[-1], math.prod(shape[:-2])
        R, C = 4 * matrices * n, 4 * matrices * m
        sums = 4 * matrices * -(-n // max(1, CHUNK // max(m, 1)))
        first = self.row.get(p) is None or ("row", id(p)) in self._unwritten  # (no old value to widen)
        factors = max(4 * R + 2 * C, 3 * R + 3 * C) if first else max(4 * R + 2 * C, 2 * R + 4 * C)
        return max(rms, factors, R + C + sums)

    def slots_of(self, p):
        return self.slots if self.beta1 is not None else self.slots[:-1]  # "m" only with beta1

    def _state_shape(self, p, slot):
        """R (..., n, 1) and C (..., 1, m) for matrices, V for vectors, m of the parameter's shape."""
        shape = tuple(p.shape)
        if slot == "m":
            return shape
        if len(shape) >= 2:
            return {"row": shape[:-1] + (1,), "col": shape[:-2] + (1,) + shape[-1:]}.get(slot)
        return shape if slot == "v" else None
