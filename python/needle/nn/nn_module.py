"""Module and Parameter: the base of every layer, the switch that turns checkpointing on, and state dicts."""
from collections import OrderedDict

import numpy as np

from .. import checkpoint, memory_hook
from ..backend_selection import array_api
from ..autograd import Tensor
from ..specs import dtype_named

__all__ = ["Module", "Parameter"]


class Parameter(Tensor):
    """A Tensor that is a trainable parameter of a Module (found by `Module.parameters()`).

    `name` is its dotted path in the first module that listed it ("layers.0.weight"), for error messages.
    """

    name = None


def _unpack_tensors(value, prefix=""):
    """(dotted name, Tensor) pairs found in `value`'s attributes, lists, tuples and dicts, in order of definition."""
    if isinstance(value, Tensor):
        return [(prefix, value)]
    if isinstance(value, Module):
        value = value.__dict__
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _unpack_tensors(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _unpack_tensors(v, f"{prefix}.{i}" if prefix else str(i))]
    return []


def _unpack_modules(value, prefix=""):
    """(dotted name, Module) pairs found in `value` (a module: itself first, named `prefix`) and in its
    attributes, lists, tuples and dicts, in order of definition."""
    if isinstance(value, Module):
        return [(prefix, value)] + _unpack_modules(value.__dict__, prefix)
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _unpack_modules(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _unpack_modules(v, f"{prefix}.{i}" if prefix else str(i))]
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
    inside it, storing the resolved policy in `checkpoint_policy` (None: off); a module then calls
    `self.checkpoint(out, inputs)` at the end of its forward, which marks its interior nodes `drop` (see
    needle.checkpoint.annotate). The first forward pass after `enable_gc` warns once when no region had an
    interior to drop (checkpoint.NothingToDropWarning: a model of one-op layers, such as the course's MLP).
    Saving: `state_dict()` gives NumPy copies of the parameters and buffers by dotted name; `load_state_dict(d)`
    copies them back in place (`ndl.save` / `ndl.load` write and read them as .npz).
    """

    checkpoint_policy = None  # the policy callable when checkpointing is on (enable_gc), else None

    def __init__(self):
        self.training = True

    @property
    def gc(self):
        """Whether gradient checkpointing is on for this module."""
        return self.checkpoint_policy is not None

    def _named_tensors(self):
        """(dotted name, Tensor) for every Parameter and buffer, first occurrence of each, in definition order."""
        named, seen = [], set()
        for name, t in _unpack_tensors(self.__dict__):
            if id(t) not in seen and (isinstance(t, Parameter) or t.is_leaf()):  # not a cached graph value
                seen.add(id(t))
                named.append((name, t))
        return named

    def named_parameters(self):
        """(dotted name, Parameter) for every Parameter of this module and its children, in order of definition."""
        named = [(name, t) for name, t in self._named_tensors() if isinstance(t, Parameter)]
        for name, p in named:
            if p.name is None:
                p.name = name
        return named

    def parameters(self):
        """Every Parameter of this module and its children, in order of definition."""
        return [p for _, p in self.named_parameters()]

    def named_modules(self):
        """(dotted name, Module) for this module (named "") and every module inside it, first occurrence of each,
        in order of definition: "blocks.2.attn" is `self.blocks[2].attn`."""
        named, seen = [], set()
        for name, m in _unpack_modules(self):
            if id(m) not in seen:
                seen.add(id(m))
                named.append((name, m))
        return named

    def named_buffers(self):
        """(dotted name, Tensor) for the plain leaf Tensors that are state too (BatchNorm's running_mean...)."""
        return [(name, t) for name, t in self._named_tensors() if not isinstance(t, Parameter)]

    def state_dict(self):
        """An OrderedDict {dotted name: NumPy copy} of every parameter and buffer, in order of definition.

        Names are attribute paths, as `named_parameters()` gives them ("modules.1.running_mean" in a Sequential).
        Save it with `ndl.save(model.state_dict(), "model.npz")`.
        """
        self.named_parameters()  # name the parameters, as a forward pass would
        return OrderedDict((name, np.array(t.numpy(), copy=True)) for name, t in self._named_tensors())

    def load_state_dict(self, state_dict, strict=True):
        """Copy the values of `state_dict` (NumPy arrays, Tensors or NDArrays) into this module, in place.

        Each parameter and buffer keeps its identity, dtype and device (an optimizer holding it stays valid);
        its version is bumped, as by any in-place write. `strict`: every key must match (else RuntimeError naming
        the missing and unexpected keys); shapes must match always. Returns (missing keys, unexpected keys).
        """
        own = OrderedDict(self._named_tensors())
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict for {type(self).__name__}: missing keys {missing}, unexpected keys "
                               f"{unexpected} (keys are attribute paths, as state_dict() gives them)")
        arrays = {}
        for key, t in own.items():
            if key in state_dict:
                value = state_dict[key]
                arrays[key] = np.asarray(value.numpy() if hasattr(value, "numpy") else value)
                if arrays[key].shape != tuple(t.shape):
                    raise RuntimeError(f"load_state_dict for {type(self).__name__}: {key!r} has shape "
                                       f"{arrays[key].shape} in the state dict, but {tuple(t.shape)} in the module")
        for key, array in arrays.items():  # all checked first: an error leaves the module unchanged
            t = own[key]
            t.data = Tensor(array, device=t.device, dtype=t.dtype, requires_grad=False)
        return missing, unexpected

    def astype(self, dtype):
        """Store every floating parameter and buffer in `dtype` ("bfloat16" for pure-bf16 training), in place:
        each keeps its identity, so an optimizer holding the parameters stays valid. Returns the module."""
        dtype = dtype_named(dtype, f"{type(self).__name__}.astype")
        for _, t in self._named_tensors():
            current = str(np.dtype(t.dtype))
            if current in ("float32", "float16", "bfloat16") and current != dtype:
                t.cached_data = array_api.astype(t.realize_cached_data(), dtype)
        for m in [self] + self._children():  # (_children: every descendant)
            if isinstance(getattr(m, "dtype", None), str):  # modules that make constants (attention's mask)
                m.dtype = dtype
        return self

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
        """Turn gradient checkpointing on for this module and all its children (see needle.checkpoint).

        `segment_len` chooses the checkpoints of the "all" policy; any other policy chooses its own, so giving
        both is an error (it used to ignore `segment_len` silently).  `policy="off"` is no checkpointing, as
        disable_gc() (the name gc.py's --policy off uses).
        """
        if segment_len is not None and policy not in (None, "all"):
            raise ValueError(f"enable_gc: segment_len={segment_len} and policy={policy!r} conflict: segment_len "
                             f"sets the checkpoints of the 'all' policy, {policy!r} chooses its own; pass only one")
        resolved = checkpoint.resolve_policy(policy, segment_len)  # once: a bad policy fails now, not in forward
        for m in [self] + self._children():
            m.checkpoint_policy = resolved
        self.gc_first_forward = True  # the next forward checks there is something to drop (once, not every step)
        return self

    def disable_gc(self):
        for m in [self] + self._children():
            m.checkpoint_policy = None
        return self

    def checkpoint(self, out, inputs, stack=False):
        """Mark the nodes between `inputs` and `out` as dropped when checkpointing is on; return `out`. `stack`: a
        module made of modules (layers, time steps) annotates their outputs as its boundaries (see annotate)."""
        if self.checkpoint_policy is not None:
            checkpoint.annotate(out, inputs, policy=self.checkpoint_policy, label=type(self).__name__, stack=stack)
        return out

    def __call__(self, *args, **kwargs):
        if "_named" not in self.__dict__:  # the outermost module runs first: its names are the full paths
            self.named_parameters()
            self._named = True
        with memory_hook.module(self):  # needle.memory's recorder: the values made belong to this module
            out = self.forward(*args, **kwargs)
        if self.__dict__.pop("gc_first_forward", False) and self.gc:
            checkpoint.warn_if_nothing_to_drop(out, type(self).__name__)
        return out
