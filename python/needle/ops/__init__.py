"""needle's ops: each a class with `compute` and `gradient`, plus the lower-case helper that applies it."""
from . import ops_logarithmic, ops_mathematic, ops_tuple
from .ops_logarithmic import *  # noqa: F401,F403  (each module lists its ops in __all__)
from .ops_mathematic import *  # noqa: F401,F403
from .ops_tuple import *  # noqa: F401,F403

__all__ = ops_mathematic.__all__ + ops_logarithmic.__all__ + ops_tuple.__all__
