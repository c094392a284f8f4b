"""SGD with momentum and weight decay, with the course's update rule."""
import math

from ..backend_selection import array_api
from .optimizer import Optimizer, flat_view, widen, check_range


class SGD(Optimizer):
    """u <- momentum * u + (1 - momentum) * (g + weight_decay * theta);  theta <- theta - lr * u  (u starts at 0)."""

    slots = ("u",)
    hyperparameters = ("lr", "momentum", "weight_decay")

    def __init__(self, params, lr=0.01, momentum=0.0, weight_decay=0.0, master_weights=None,
                 stochastic_rounding=False, offload_state=False, in_backward=False):
        super().__init__(params, master_weights, stochastic_rounding, offload_state, in_backward)
        self.__dict__.update(self.check_hyperparameters(dict(lr=lr, momentum=momentum, weight_decay=weight_decay)))

    def check_hyperparameters(self, values):
        checked = super().check_hyperparameters(values)
        checked["lr"] = check_range("SGD", "lr", values["lr"], 0, math.inf)
        checked["momentum"] = check_range("SGD", "momentum", values["momentum"], 0, 1, high_open=False)
        checked["weight_decay"] = check_range("SGD", "weight_decay", values["weight_decay"], 0, math.inf)
        return checked

    def slots_of(self, p):
        return self.slots if self.momentum else ()

    def fused_in_place(self, p):
        return str(p.realize_cached_data().dtype) == "float32"  # (its gradient and u: float32 too)

    def update_parameter(self, p, theta, grad):
        beta, state, new = self.momentum, {}, True
        if beta:
            state["u"], new = self._open(p, "u")
            stored = flat_view(state["u"])
        if self.fused_in_place(p) and str(grad.dtype) == "float32":  # one backend pass (sgd_step), in place
            u = state.get("u", theta)  # (without momentum no u is read or written)
            array_api.sgd_step(theta, grad, None if new else u, self.lr, beta, self.weight_decay, out=(theta, u))
            return self._finish(p, theta, **state)
        for start, th, u in self._chunks(theta, grad):  # in place, a chunk at a time
            if beta:
                end = start + u.size
                u = u * (1 - beta) if new else widen(stored[start:end]) * beta + u * (1 - beta)
                stored[start:end] = u
            self._update(p, theta, th - u * self.lr, start)
        self._finish(p, theta, **state)
