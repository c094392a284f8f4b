"""Xavier (Glorot) and Kaiming (He) initializers, as the course defines them."""
import math

from .init_basic import rand, randn

__all__ = ["kaiming_normal", "kaiming_uniform", "xavier_normal", "xavier_uniform"]


def xavier_uniform(fan_in, fan_out, gain=1.0, **kwargs):
    """U(-a, a), a = gain * sqrt(6 / (fan_in + fan_out))."""
    a = gain * math.sqrt(6 / (fan_in + fan_out))
    return rand(fan_in, fan_out, low=-a, high=a, **kwargs)


def xavier_normal(fan_in, fan_out, gain=1.0, **kwargs):
    """N(0, std^2), std = gain * sqrt(2 / (fan_in + fan_out))."""
    std = gain * math.sqrt(2 / (fan_in + fan_out))
    return randn(fan_in, fan_out, std=std, **kwargs)


def _relu_gain(nonlinearity):
    if nonlinearity != "relu":
        raise ValueError(f"kaiming init supports nonlinearity='relu' only, got {nonlinearity!r}")
    return math.sqrt(2)


def kaiming_uniform(fan_in, fan_out, shape=None, nonlinearity="relu", **kwargs):
    """U(-b, b), b = sqrt(2) * sqrt(3 / fan_in); drawn at `shape` if given, else (fan_in, fan_out)."""
    bound = _relu_gain(nonlinearity) * math.sqrt(3 / fan_in)
    shape = (fan_in, fan_out) if shape is None else tuple(shape)
    return rand(*shape, low=-bound, high=bound, **kwargs)


def kaiming_normal(fan_in, fan_out, shape=None, nonlinearity="relu", **kwargs):
    """N(0, std^2), std = sqrt(2) / sqrt(fan_in); drawn at `shape` if given, else (fan_in, fan_out)."""
    std = _relu_gain(nonlinearity) / math.sqrt(fan_in)
    shape = (fan_in, fan_out) if shape is None else tuple(shape)
    return randn(*shape, std=std, **kwargs)
