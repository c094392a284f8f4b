"""Adam with bias correction and weight decay, with the course's update rule."""
from ..backend_selection import array_api
import math

from .optimizer import Optimizer, flat_view, widen, as_dtype, check_range


class Adam(Optimizer):
    """Adam with bias correction; moments of g + weight_decay * theta, one step count t for all parameters.

    m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  theta <- theta - lr * m_hat / (sqrt(v_hat) + eps),
    m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t).
    """

    slots = ("m", "v")
    hyperparameters = ("lr", "beta1", "beta2", "eps", "weight_decay", "t")

    def __init__(self, params, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, master_weights=None,
                 stochastic_rounding=False, offload_state=False, in_backward=False):
        super().__init__(params, master_weights, stochastic_rounding, offload_state, in_backward)
        self.__dict__.update(self.check_hyperparameters(dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                                             weight_decay=weight_decay, t=0)))

    def check_hyperparameters(self, values):
        checked, name = super().check_hyperparameters(values), type(self).__name__
        checked["lr"] = check_range(name, "lr", values["lr"], 0, math.inf)
        checked["beta1"] = check_range(name, "beta1", values["beta1"], 0, 1)
        checked["beta2"] = check_range(name, "beta2", values["beta2"], 0, 1)
        # eps > 0: on a zero gradient the update is 0 / (0 + eps); eps = 0 would make it NaN
        checked["eps"] = check_range(name, "eps", values["eps"], 0, math.inf, low_open=True)
        checked["weight_decay"] = check_range(name, "weight_decay", values["weight_decay"], 0, math.inf)
        return checked

    def begin_step(self):
        super().begin_step()
        self.t += 1
        self.corrections = 1 - self.beta1**self.t, 1 - self.beta2**self.t

    def fused_in_place(self, p):
        """float32, or bfloat16 without a master copy (pure bf16 training: state in bfloat16 too)."""
        dtype = str(p.realize_cached_data().dtype)
        return dtype == "float32" or (dtype == "bfloat16" and not self._keeps_master(p))

    def update_parameter(self, p, theta, grad):
        (m, new), (v, _) = self._open(p, "m"), self._open(p, "v")
        kinds = ("float32", str(theta.dtype))
        if self.fused_in_place(p) and str(m.dtype) in kinds and str(grad.dtype) in kinds:
            # One backend pass (adam_step) over the whole arrays, written in place; a bfloat16 parameter widened,
            # updated and rounded back inside it, as `_update` would round it (stochastic rounding: bfloat16 only).
            array_api.adam_step(theta, grad, None if new else m, None if new else v, *self._hyper(),
                                weight_decay=self.weight_decay, out=(theta, m, v), rounding_seed=self.rounding_seed(p))
        else:
            flat_m, flat_v = flat_view(m), flat_view(v)
            for start, th, g in self._chunks(theta, grad):
                end = start + g.size
                old = (None, None) if new else (widen(flat_m[start:end]), widen(flat_v[start:end]))
                th, flat_m[start:end], flat_v[start:end] = self._step_chunk(th, g, *old)
                self._update(p, theta, th, start)
        self._finish(p, theta, m=m, v=v)

    def _hyper(self):
        return (self.lr, self.beta1, self.beta2, self.eps) + self.corrections

    def _step_chunk(self, theta, grad, m, v):
        """The new (theta, m, v) of a chunk in float32 (m, v None on the first step)."""
        if all(_is_float32(a) for a in (theta, grad) + (() if m is None else (m, v))):
            return array_api.adam_step(theta, grad, m, v, *self._hyper())  # the same operations in one pass
        b1, b2, (correction1, correction2) = self.beta1, self.beta2, self.corrections
        m = grad * (1 - b1) if m is None else m * b1 + grad * (1 - b1)
        v = (grad * grad) * (1 - b2) if v is None else v * b2 + (grad * grad) * (1 - b2)
        m_hat = m / correction1
        v_hat = v / correction2
        return as_dtype(theta - m_hat * self.lr / (v_hat**0.5 + self.eps), theta), m, v


def _is_float32(array):
    return str(array.dtype) == "float32"
