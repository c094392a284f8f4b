"""The Budget, extended: keep, recompute or offload each value, park gradients, and price it all as this machine runs.

`checkpoint.Budget(b, offload=True)`, `Budget(b, calibrate=True)` or `Budget(b, host_bandwidth=...)` is this class
(Budget.__new__ hands it out). It plans as the core's Budget (checkpoint_budget.py), with three additions:

- A value may leave the device for host memory (offload.py's `OFFLOAD` store) instead of being recomputed, which
  ever costs fewer seconds: a copy to the host and back, less what the compute beside it hides where copies overlap
  compute, against its recomputation. In a lazy step a region's outputs, which recomputation starts from, may be
  parked too (an eager forward never gives an output back).
- When even everything off the device does not fit, what is left is the parameters' gradients, all alive at the
  end of backward: then each goes to host memory as soon as backward has finished it (ZeRO-Offload's trick;
  offload.GRADIENTS), and the optimizer brings each back for its own update.
- `calibrate=True` prices with this machine's measured rates (cost_model.py: measured once, cached in a file);
  otherwise the core's fixed rates, so the plan is the same on every machine. `host_bandwidth` (bytes/s) plans the
  copies as if over that link (16e9: PCIe 4), as a GPU's copy engine runs them.

`trace_seconds` is the Python a lazy forward spent building its graph (timed from the first region annotated to the
plan): not ops, so no cost model sees it, yet a step pays it; it is part of `predicted_time`.
"""
import time

from .. import costs
from ..backward import always_kept
from ..checkpoint_budget import Budget
from ..ledger import value_bytes
from .cost_model import CostModel, device_copies_overlap
from .offload import GRADIENTS, OFFLOAD, offloadable

__all__ = ["OffloadBudget"]


class OffloadBudget(Budget):
    """Budget(bytes, offload, host_bandwidth, cost_model, calibrate): the core's Budget with offloading, gradient
    parking and measured prices (the module doc)."""

    def __init__(self, bytes, offload=False, host_bandwidth=None, cost_model=None, calibrate=False):
        if cost_model is None:
            cost_model = (CostModel if calibrate else costs.CostModel)(host_bandwidth=host_bandwidth)
        super().__init__(bytes, cost_model=cost_model)
        self.offload = bool(offload)  # may a value be parked in host memory instead of recomputed?
        self.host_bandwidth = host_bandwidth  # bytes/s to plan copies with (None: the cost model's)
        self.gradient_store = GRADIENTS if self.offload else None
        self.means = "checkpointing and offloading" if self.offload else "checkpointing"
        self.trace_seconds = 0.0
        self._traced_since = None

    def __repr__(self):
        return f"Budget({self.bytes}{', offload=True' if self.offload else ''})"

    def copies_overlap(self):
        """Whether copies run beside compute: on a device with a copy stream, or when planning for a given link."""
        return self.host_bandwidth is not None or device_copies_overlap(self.cost_model.device)

    def _region_seen(self):
        if self._traced_since is None:
            self._traced_since = time.perf_counter()

    def _trace_seconds(self, lazy_step):
        seconds = time.perf_counter() - self._traced_since if lazy_step and self._traced_since else 0.0
        self._traced_since = None
        self.trace_seconds = seconds
        return seconds

    def _output_places(self, outs, lazy_step):
        if not (self.offload and lazy_step):
            return []
        return [(("out", position), n) for position, n in enumerate(outs)
                if n is not None and offloadable(n) and not always_kept(n)]

    def _gradient_seconds(self, params, gradient_store):
        if gradient_store is None:
            return 0.0
        return sum(self.cost_model.copy_seconds(value_bytes(p), way)
                   for p in params for way in ("to_host", "to_device"))

    def _cheaper_way(self, node, around, output=False, recompute=None):
        """(how `node` leaves the device — False: recomputed, OFFLOAD: parked in host memory —, what that costs in
        seconds). A copy to the host and back; where copies overlap compute, the part of each that the compute
        beside it (`around`: one op's seconds) does not hide. `output`: it can only be parked (a region's output, a
        stack's spine); `recompute`: the seconds of recomputing it, where more than its own op's (a stack's
        boundary: its layer)."""
        recompute = self.cost_model.compute_seconds(node) if recompute is None else recompute
        if not (self.offload and offloadable(node)):
            return False, recompute
        copies = [self.cost_model.copy_seconds(value_bytes(node), way) for way in ("to_host", "to_device")]
        if self.copies_overlap():
            copies = [c - self.cost_model.hidden_seconds(c, around) for c in copies]
        return (OFFLOAD, sum(copies)) if output or sum(copies) < recompute else (False, recompute)
