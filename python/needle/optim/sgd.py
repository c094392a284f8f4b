"""SGD with momentum and weight decay, with the course's update rule."""
from .optimizer import Optimizer, _as_dtype, _widen


class SGD(Optimizer):
    """u <- momentum * u + (1 - momentum) * (g + weight_decay * theta);  theta <- theta - lr * u  (u starts at 0)."""

    def __init__(self, params, lr=0.01, momentum=0.0, weight_decay=0.0, master_weights=None,
                 stochastic_rounding=False):
        super().__init__(params, master_weights, stochastic_rounding)
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.u = {}

    def step(self):
        beta = self.momentum
        for p, theta, grad in self._with_grads():
            if beta:
                u = self.u.get(p)
                u = grad * (1 - beta) if u is None else _widen(u) * beta + grad * (1 - beta)
                self.u[p] = self._state(p, u)
            else:
                u = grad
            self._update(p, _as_dtype(theta - u * self.lr, theta))
