"""Module and Parameter: the base of every layer, and the switch that turns checkpointing on."""
from .. import checkpoint
from ..autograd import Tensor

__all__ = ["Module", "Parameter"]


class Parameter(Tensor):
    """A Tensor that is a trainable parameter of a Module (found by `Module.parameters()`).

    `name` is its dotted path in the first module that listed it ("layers.0.weight"), for error messages.
    """

    name = None


def _unpack_params(value, prefix=""):
    """(dotted name, Parameter) pairs found in `value`, in order of definition."""
    if isinstance(value, Parameter):
        return [(prefix, value)]
    if isinstance(value, Module):
        value = value.__dict__
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _unpack_params(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _unpack_params(v, f"{prefix}.{i}" if prefix else str(i))]
    return []


def _child_modules(value):
    if isinstance(value, Module):
        return [value] + value._children()
    if isinstance(value, dict):
        return [m for v in value.values() for m in _child_modules(v)]
    if isinstance(value, (list, tuple)):
        return [m for v in value for m in _child_modules(v)]
    return []


class Module:
    """A layer: parameters in attributes (also inside lists, tuples and dicts), `forward` does the work.

    Checkpointing: `enable_gc(segment_len=None, policy=None)` turns it on for this module and every module
    inside it; a module then calls `self.checkpoint(out, inputs)` at the end of its forward, which marks its
    interior nodes `drop` (see needle.checkpoint.annotate).
    """

    def __init__(self):
        self.training = True
        self.gc = False
        self.segment_len = None
        self.policy = None

    def named_parameters(self):
        """(dotted name, Parameter) for every Parameter of this module and its children, in order of definition."""
        named, seen = [], set()
        for name, p in _unpack_params(self.__dict__):
            if id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
                if p.name is None:
                    p.name = name
        return named

    def parameters(self):
        """Every Parameter of this module and its children, in order of definition."""
        return [p for _, p in self.named_parameters()]

    def _children(self):
        return _child_modules(self.__dict__)

    def eval(self):
        self.training = False
        for m in self._children():
            m.training = False
        return self

    def train(self):
        self.training = True
        for m in self._children():
            m.training = True
        return self

    def enable_gc(self, segment_len=None, policy=None):
        """Turn gradient checkpointing on for this module and all its children (see needle.checkpoint)."""
        checkpoint.resolve_policy(policy, segment_len)  # fail now on a bad policy, not in forward
        for m in [self] + self._children():
            m.gc, m.segment_len, m.policy = True, segment_len, policy
        return self

    def disable_gc(self):
        for m in [self] + self._children():
            m.gc, m.segment_len, m.policy = False, None, None
        return self

    def checkpoint(self, out, inputs):
        """Mark the nodes between `inputs` and `out` as dropped when checkpointing is on; return `out`."""
        if getattr(self, "gc", False):
            checkpoint.annotate(out, inputs, segment_len=self.segment_len, policy=self.policy)
        return out

    def __call__(self, *args, **kwargs):
        if "_named" not in self.__dict__:  # the outermost module runs first: its names are the full paths
            self.named_parameters()
            self._named = True
        return self.forward(*args, **kwargs)
