"""needle's ops: each a class with `compute` and `gradient`, plus the lower-case helper that applies it.

Each ops module lists its public names in its own `__all__`; this package re-exports every one of them, so adding
an op is one edit in its own file (`ndl.ops.relu`, `ndl.ops.ReLU`, `ndl.ops.scaled_dot_product_attention`, ...).
The fused ops (attention, layer norm, linear, dropout, the LM head's linear_cross_entropy) are ordinary ops here.
"""
from .. import lazy
from . import (ops_activation, ops_attention, ops_dropout, ops_fused, ops_linear, ops_logarithmic, ops_mathematic,
               ops_norm, ops_tuple)

OPS_MODULES = (ops_mathematic, ops_logarithmic, ops_tuple, ops_linear, ops_dropout, ops_norm, ops_attention, ops_fused,
               ops_activation)
# The few-bit activations' ops live in the toolbox (fewbit.py), loaded on first use.
__getattr__ = lazy.attributes(__name__, {"FewBitActivation": "fewbit:FewBitActivation",
                                         "FewBitGrad": "fewbit:FewBitGrad"})


def _gather_exports(modules):
    """{name: object} of every name in the modules' `__all__`; a name exported twice is an error."""
    exports, owner = {}, {}
    for module in modules:
        for name in module.__all__:
            if name in exports:
                raise ImportError(f"needle.ops: {name!r} is exported by both {owner[name]} and {module.__name__}")
            exports[name], owner[name] = getattr(module, name), module.__name__
    return exports


globals().update(_gather_exports(OPS_MODULES))
__all__ = sorted(name for module in OPS_MODULES for name in module.__all__)
