"""Optimizers: SGD with momentum and Adam, with the course's update rules.

Updates work on raw arrays (a parameter's `cached_data`), so a step never grows the graph. A step replaces a
parameter's array by a new one, never writes into `param.grad`, and keeps the parameter's dtype (hyper-parameters
are plain Python floats, so float32 stays float32 under NEEDLE_BACKEND=np as well). Parameters without a
gradient are skipped.
"""
from .backend_selection import array_api

__all__ = ["Adam", "Optimizer", "SGD"]


def _as_dtype(array, like):
    """`array` in the dtype of `like` (arithmetic with Python floats may have promoted a numpy array)."""
    return array_api.cast_like(array, like)


class Optimizer:
    """Holds the parameters; `step()` updates them from their `.grad`, `reset_grad()` clears the gradients."""

    def __init__(self, params):
        self.params = list(params)

    def step(self):
        raise NotImplementedError()

    def reset_grad(self):
        for p in self.params:
            p.grad = None

    def _with_grads(self):
        """(parameter, its value, its gradient with weight decay added) for every parameter that has a grad."""
        for p in self.params:
            if p.grad is None:
                continue
            theta = p.realize_cached_data()
            grad = p.grad.realize_cached_data()
            if self.weight_decay:
                grad = grad + theta * self.weight_decay
            yield p, theta, grad


class SGD(Optimizer):
    """u <- momentum * u + (1 - momentum) * (g + weight_decay * theta);  theta <- theta - lr * u  (u starts at 0)."""

    def __init__(self, params, lr=0.01, momentum=0.0, weight_decay=0.0):
        super().__init__(params)
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.u = {}

    def step(self):
        beta = self.momentum
        for p, theta, grad in self._with_grads():
            if beta:
                u = self.u.get(p)
                u = grad * (1 - beta) if u is None else u * beta + grad * (1 - beta)
                self.u[p] = u
            else:
                u = grad
            p.cached_data = _as_dtype(theta - u * self.lr, theta)


class Adam(Optimizer):
    """Adam with bias correction; moments of g + weight_decay * theta, one step count t for all parameters.

    m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  theta <- theta - lr * m_hat / (sqrt(v_hat) + eps),
    m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t).
    """

    def __init__(self, params, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0):
        super().__init__(params)
        self.lr = float(lr)
        self.beta1 = float(beta1)
        self.beta2 = float(beta2)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.t = 0
        self.m = {}
        self.v = {}

    def step(self):
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        correction1, correction2 = 1 - b1**self.t, 1 - b2**self.t
        for p, theta, grad in self._with_grads():
            m, v = self.m.get(p), self.v.get(p)
            m = grad * (1 - b1) if m is None else m * b1 + grad * (1 - b1)
            v = (grad * grad) * (1 - b2) if v is None else v * b2 + (grad * grad) * (1 - b2)
            self.m[p], self.v[p] = m, v
            m_hat = m / correction1
            v_hat = v / correction2
            p.cached_data = _as_dtype(theta - m_hat * self.lr / (v_hat**0.5 + self.eps), theta)
