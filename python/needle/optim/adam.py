"""Adam with bias correction and weight decay, with the course's update rule."""
from .optimizer import Optimizer, _as_dtype, _widen


class Adam(Optimizer):
    """Adam with bias correction; moments of g + weight_decay * theta, one step count t for all parameters.

    m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  theta <- theta - lr * m_hat / (sqrt(v_hat) + eps),
    m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t).
    """

    def __init__(self, params, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, master_weights=None,
                 stochastic_rounding=False):
        super().__init__(params, master_weights, stochastic_rounding)
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
            m = grad * (1 - b1) if m is None else _widen(m) * b1 + grad * (1 - b1)
            v = (grad * grad) * (1 - b2) if v is None else _widen(v) * b2 + (grad * grad) * (1 - b2)
            self.m[p], self.v[p] = self._state(p, m), self._state(p, v)
            m_hat = m / correction1
            v_hat = v / correction2
            self._update(p, _as_dtype(theta - m_hat * self.lr / (v_hat**0.5 + self.eps), theta))
