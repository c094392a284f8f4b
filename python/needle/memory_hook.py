"""The switch between needle's core and `needle.memory`'s recorder: None (off) or the active recorder.

The allocator's Python side (backend_ndarray/ndarray.py), the graph (autograd.py, backward.py), modules and
optimizers call the recorder through this module only where `RECORDER is not None`, so recording costs one
attribute read per allocation and per computed value when it is off (PREDICTOR, CAPTURE alike). Only
`needle.memory.record()` turns it on, by `set_recorder`. This module imports nothing of needle's: all import it.
"""
import contextlib

RECORDER = None
# ndl.memory.predict's dry run while it traces a step (None: off): Tensor.backward, an optimizer's step and
# reset_grad hand it their work instead of doing it, and no value is computed or made from data.
PREDICTOR = None
# ndl.jit.capture while it records a step (None: off): an optimizer's step is handed to it, modules noted.
CAPTURE = None

_NOTHING = contextlib.nullcontext()


def set_predictor(predictor):
    """Make `predictor` the active dry run (None: off); return the previous one."""
    global PREDICTOR
    previous, PREDICTOR = PREDICTOR, predictor
    return previous


def set_capture(capture):
    """Make `capture` the step being recorded (None: off); return the previous one."""
    global CAPTURE
    previous, CAPTURE = CAPTURE, capture
    return previous


def set_recorder(recorder):
    """Make `recorder` the active one (None: off); return the previous one."""
    global RECORDER
    previous, RECORDER = RECORDER, recorder
    return previous


@contextlib.contextmanager
def _phase(recorder, name, owner):
    previous = recorder.enter_phase(name, owner)
    try:
        yield
    finally:
        recorder.exit_phase(previous, owner)


def phase(name, owner=None):
    """A context in which the buffers made belong to phase `name` ("forward", "backward", "recompute",
    "optimizer"); `owner` is the optimizer of an "optimizer" phase. Nothing to do when not recording."""
    return _NOTHING if RECORDER is None else _phase(RECORDER, name, owner)


def allocating_state(optimizer):
    """A context in which `optimizer` allocates its state (when it is built): the buffers made are that state."""
    return _NOTHING if RECORDER is None else RECORDER.allocating_state(optimizer)


def module(mod):
    """A context in which the graph values made belong to module `mod` (Module.__call__)."""
    if CAPTURE is not None:
        CAPTURE.module_called(mod)
    return _NOTHING if RECORDER is None else RECORDER.in_module(mod)
