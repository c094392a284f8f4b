"""ndl.jit: a training step captured once and replayed as the backend calls it made, on a static memory plan.

    step = ndl.jit.capture(step)      # or @ndl.jit.capture on its definition
    step.memory_plan                  # every transient buffer's offset in the one arena (after the second call)

capture.py records and replays; plan.py places the buffers. docs/capture.md explains both.
"""
from .capture import StaleCapture, capture
from .plan import MemoryPlan

__all__ = ["MemoryPlan", "StaleCapture", "capture"]
