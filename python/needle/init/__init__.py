"""Tensor initializers (`needle.init`)."""
from .init_basic import constant, one_hot, ones, ones_like, rand, randb, randn, zeros, zeros_like
from .init_initializers import kaiming_normal, kaiming_uniform, xavier_normal, xavier_uniform

__all__ = ["constant", "kaiming_normal", "kaiming_uniform", "one_hot", "ones", "ones_like", "rand", "randb",
           "randn", "xavier_normal", "xavier_uniform", "zeros", "zeros_like"]
