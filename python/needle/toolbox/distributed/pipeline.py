"""Pipeline parallelism, GPipe's schedule (Huang et al. 2019): a model cut into d consecutive stages, one per rank.

A batch is split into m micro-batches. Stage s runs the forward pass of micro-batch 0, sends its output to stage
s + 1 (point-to-point MPI, non-blocking) and goes on with micro-batch 1 while s + 1 works on 0; when all m
forwards are done, the backward passes run the other way, each stage receiving the gradient of its output from
the next stage and sending the gradient of its input to the previous one. The gradients of a stage's parameters
are summed over the m micro-batches, and one optimizer step follows:

    stages = [nn.Sequential(embed, layer0, layer1), nn.Sequential(layer2, layer3, head)]   # same on every rank
    pipe = dist.Pipeline(stages, micro_batches=8)      # rank r runs stages[r]; mpiexec -n 2
    opt = ndl.optim.Adam(pipe.parameters(), lr=1e-3)   # this rank's stage only
    loss = pipe.train_step(micro_batches, loss_fn)     # [(x0, y0), ...]: stage 0 reads x, the last stage y
    opt.step()

Each micro-batch's loss is divided by m, so the gradients are those of the mean loss: the same as the unsplit
model accumulating over the m micro-batches (bit for bit: each stage runs the same operations on the same
values, and the sums over micro-batches are taken in the same order, 0 to m - 1).

The bubble: with d stages of equal cost, each rank idles for d - 1 of the m + d - 1 micro-batch slots of the
forward phase, and again in the backward phase: a fraction (d - 1)/(m + d - 1) of the step, negligible for
m >= 4d. `last_step_stats()` reports the measured one (the time a rank does not compute its stage, over the
step) next to that formula. GPipe holds every micro-batch's activations until its backward; with
`checkpoint="all"` (or any policy of `Module.enable_gc`) each stage keeps only its layers' boundaries and
recomputes the rest during backward: GPipe's re-materialization.
"""
import time

from ...autograd import Tensor, last_backward_stats
from ...nn import Module
from . import comm

__all__ = ["Pipeline", "bubble_fraction"]


def bubble_fraction(stages, micro_batches):
    """GPipe's idle fraction of a step: (d - 1) / (m + d - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


class Pipeline:
    """GPipe over the ranks: `stages[rank()]` runs here; see the module docstring.

    `stages`: one Module per rank (every rank passes the same list; a stage's forward takes one Tensor and returns
    one Tensor); `micro_batches`: m; `checkpoint`: None, or an `enable_gc` policy ("all", "sqrt", ...) for this
    rank's stage. A list with another number of stages than ranks is a ValueError on every rank.
    """

    def __init__(self, stages, micro_batches, checkpoint=None):
        comm.init()
        n, me = comm.world_size(), comm.rank()
        stages = list(stages)
        if len(stages) != n:
            raise ValueError(f"Pipeline: {len(stages)} stages for {n} rank{'s' * (n != 1)}: one stage per rank "
                             f"(run with mpiexec -n {len(stages)}, or split the model into {n} stages)")
        if not all(isinstance(s, Module) for s in stages):
            raise TypeError("Pipeline: every stage must be a needle Module")
        if isinstance(micro_batches, bool) or int(micro_batches) != micro_batches or micro_batches < 1:
            raise ValueError(f"Pipeline: micro_batches must be a positive integer, got {micro_batches!r}")
        self.stage, self.stages, self.micro_batches = stages[me], n, int(micro_batches)
        self.rank, self.first, self.last = me, me == 0, me == n - 1
        if checkpoint is not None:
            self.stage.enable_gc(policy=None if checkpoint in (True, "all") else checkpoint)
        self._stats = {}

    def parameters(self):
        """This rank's stage's parameters (what its optimizer steps)."""
        return self.stage.parameters()

    def train(self):
        self.stage.train()
        return self

    def eval(self):
        self.stage.eval()
        return self

    def train_step(self, batches, loss_fn):
        """Forward and backward of `batches`, a list of m (x, y) micro-batches, GPipe's schedule; returns the mean
        of the m losses (on every rank). Leaves `.grad` on this stage's parameters: the gradient of that mean.

        `loss_fn(output, y)` (a scalar Tensor) runs on the last stage. Every rank passes the micro-batches (stage
        0 reads only the x's, the last stage only the y's; the others may pass None for both)."""
        m = self.micro_batches
        if len(batches) != m:
            raise ValueError(f"Pipeline.train_step: {len(batches)} micro-batches, but the pipeline was built for "
                             f"micro_batches={m}")
        comm.barrier("Pipeline.train_step's start")  # the step starts together on every rank: the bubble's zero
        t0 = time.perf_counter()
        compute, recomputed, start_bytes = 0.0, 0, self._current_bytes()
        params = self.parameters()
        held, sends, losses = [], [], []
        for j, (x, y) in enumerate(batches):  # all forwards
            inp = x if self.first else Tensor(comm.recv(self.rank - 1, tag=j, device=self._device()),
                                              requires_grad=True)
            t = time.perf_counter()
            out = self.stage(inp)
            if self.last:
                loss = loss_fn(out, y)
                losses.append(float(loss.numpy()))
                out = loss / m
            else:
                out.realize_cached_data()
            compute += time.perf_counter() - t
            if not self.last:
                sends.append(comm.send(out.realize_cached_data(), self.rank + 1, tag=j))
            held.append((inp, out))
        held_bytes = None if start_bytes is None else self._current_bytes() - start_bytes
        accumulated = None
        for j, (inp, out) in enumerate(held):  # all backwards, in the same order
            if self.last:
                out_grad = None
            else:
                out_grad = Tensor(comm.recv(self.rank + 1, tag=m + j, device=self._device()), requires_grad=False)
            t = time.perf_counter()
            out.backward(out_grad)
            recomputed += last_backward_stats()["recomputed_nodes"]
            grads = [None if p.grad is None else p.grad.realize_cached_data() for p in params]
            accumulated = grads if accumulated is None else \
                [g if a is None else a if g is None else a + g for a, g in zip(accumulated, grads)]
            compute += time.perf_counter() - t
            if not self.first:
                sends.append(comm.send(inp.grad.realize_cached_data(), self.rank - 1, tag=m + j))
            held[j] = None  # this micro-batch's activations die here
        for p, g in zip(params, accumulated or []):
            p.grad = None if g is None else Tensor(g, device=p.device, dtype=str(p.dtype), requires_grad=False)
        for s in sends:
            s.wait()
        mine = (compute, sum(losses) / m if self.last else None)
        everyone = comm.all_gather_object(mine, label="Pipeline.train_step's statistics")
        step = time.perf_counter() - t0
        self._stats = {"step_seconds": step, "compute_seconds": compute, "bubble": 1 - compute / step,
                       "compute_seconds_per_rank": [c for c, _ in everyone],
                       "theory": bubble_fraction(self.stages, m), "stages": self.stages, "micro_batches": m,
                       "activation_bytes": held_bytes, "recomputed_nodes": recomputed}
        self._stats["bubble_mean"] = 1 - sum(c for c, _ in everyone) / (len(everyone) * step)
        return everyone[-1][1]

    def last_step_stats(self):
        """The last train_step: its wall time, this rank's compute time, the measured bubble (this rank's idle
        fraction, and the mean over ranks), GPipe's (d - 1)/(m + d - 1), the bytes this stage held when its
        backward phase began (the device allocator's count; None where the backend keeps none) and the nodes
        checkpointing recomputed."""
        return dict(self._stats)

    def __call__(self, x):
        """Forward of one batch through all stages (no micro-batches, no graph kept between ranks): the output on
        the last rank, None on the others. For evaluation."""
        inp = x if self.first else Tensor(comm.recv(self.rank - 1, tag=0, device=self._device()),
                                          requires_grad=False)
        out = self.stage(inp)
        if self.last:
            return out
        comm.send(out.realize_cached_data(), self.rank + 1, tag=0).wait()
        return None

    def _device(self):
        params = self.parameters()
        return params[0].device if params else None

    def _current_bytes(self):
        device = self._device()
        stats = getattr(device, "memory_stats", None)
        return stats()["current_bytes"] if stats is not None and device.enabled() else None
