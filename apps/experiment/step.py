"""One optimizer step of a run, measured: its micro-batches' forward and backward passes, the optimizer's update,
and what they cost in memory (the allocator's exact bytes, the process's RSS) and time.  train_step for one
process, data parallel (--parallel dp, zero1, zero2, zero3) or tensor parallel (tp, tp+sp, tp+dp); pipeline_step
for --parallel pipeline; captured_step for --capture (ndl.jit.capture)."""
import contextlib
import time

import numpy as np

import needle as ndl
from needle import autograd, checkpoint
from needle.toolbox import cost_model
from needle.autograd import nbytes_of
from needle import backend_ndarray as nd
from needle import distributed as dist

from .data import micro_batches
from .measure import PeakRSS, gpu_memory_bytes


def cached(device, at_peak=False):
    """The allocator's freed blocks kept for reuse (resident, but free), now or when its peak was reached: the CPU
    backend reports them; 0 elsewhere."""
    return nd.memory_stats(device).get("cached_bytes_at_peak" if at_peak else "cached_bytes", 0)


def train_step(model, loss_fn, opt, batches, start, config, device, params, scaler=None):
    """One optimizer step (of `accumulation_steps` micro-batches), with its memory and time measured; loss_fn(X, y)
    is make_loss's (the full or the fused head, under autocast for mixed precision); `scaler` a GradScaler for
    mixed-fp16 (the step is skipped, and counted, when a gradient overflowed).  With a DataParallel model (--parallel
    dp, zero1, zero2, zero3, tp+dp) each rank trains on its share of every micro-batch's columns, and the model sums the
    micro-batches' gradients itself (no_sync), averaging them across the ranks in the last backward."""
    data_parallel = isinstance(model, dist.DataParallel)
    tensor_parallel = tensor_parallel_group(model)
    if tensor_parallel is not False:
        dist.traffic(tensor_parallel, reset=True)  # this step's collectives of the split layers, counted below
    opt.reset_grad()
    micro = micro_batches(batches, start, config, device)
    if data_parallel:  # tp+dp: the columns of this rank's data group (tensor-parallel ranks share theirs)
        micro = [rank_share(X, y, device, model.group) for X, y in micro]
    nd.reset_peak_memory_stats(device)
    baseline = nd.memory_stats(device)["current_bytes"]
    rss = None if device.name == "cuda" else PeakRSS(cached(device))  # GPU memory: GPUtil, not host RSS
    t0 = time.perf_counter()
    passes = _forward_backward(model, loss_fn, micro, config, device, params, scaler, baseline, rss)
    del micro
    # M_peak is forward + backward (what Budget bounds); the optimizer's own temporaries come after it.
    forward_backward_peak = nd.memory_stats(device)["peak_bytes"] - baseline
    rss_peak = rss.growth(cached(device, at_peak=True)) if rss else None  # the same window as M_peak's
    grad_bytes = gradient_bytes(opt, params)
    skipped = False
    if scaler is None:
        opt.step()
    else:
        skipped = not scaler.step(opt)
        scaler.update()
    elapsed = time.perf_counter() - t0 - passes["bookkeeping_seconds"]
    # read after the clock stops: the hidden share prices the copies with the cost model, whose calibration may be
    # measured on first use (seconds; --policy offload has no Budget that measured it before the step)
    traffic = offload_traffic(passes["backward_stats"], device)
    stats = nd.memory_stats(device)
    step = {
        "loss": float(np.mean(passes["losses"])), "time_seconds": elapsed,
        "activation_bytes": int(passes["activation_bytes"]), "floor_bytes": int(passes["floor_bytes"]),
        "peak_bytes": int(stats["peak_bytes"]), "peak_activation_bytes": int(forward_backward_peak),
        "step_peak_bytes": int(stats["peak_bytes"] - baseline), "baseline_bytes": int(baseline),
        "recomputed_nodes": int(passes["recomputed_nodes"]), "gpu_memory_bytes": gpu_memory_bytes(),
        "rss_peak_bytes": rss_peak, "rss_start_bytes": rss.start if rss else None,
        **state_bytes(opt, params, grad_bytes), "skipped_step": skipped,
        "loss_scale": None if scaler is None else scaler.get_scale(), **traffic,
    }
    if tensor_parallel is not False:  # read before the all-gathers of the figures below
        step["tensor_parallel"] = tensor_parallel_traffic(tensor_parallel)
    if config.parallel:
        step["loss"] = float(np.mean(dist.all_gather_object(step["loss"])))  # the global batch's mean loss
        step["ranks"] = per_rank_memory(step)
    if data_parallel:
        step["sync"] = model.last_sync_stats()
    return step, passes["loss"]


def _forward_backward(model, loss_fn, micro, config, device, params, scaler, baseline, rss):
    """Forward and backward of every micro-batch, their gradients summed into the parameters' .grad.  M_act and
    M_floor are read on the first micro-batch, when its backward is about to start; the time that reading takes
    (bookkeeping_seconds) is left out of T_step."""
    k = config.accumulation_steps
    data_parallel = isinstance(model, dist.DataParallel)
    act, floor, losses, recomputed, grads, accumulated, bookkeeping = 0, 0, [], 0, None, None, 0.0
    backward_stats = []
    for j, (X, y) in enumerate(micro):
        with autograd.lazy_mode(config.lazy):
            loss = loss_fn(X, y) if k == 1 else loss_fn(X, y) / k
            # The policies that plan from the whole graph (a Budget, compression's region outputs) decide when
            # backward starts; reading the loss first computes a lazy forward, so they decide now.
            autograd.run_deferred([loss])
            losses.append(float(loss.numpy()) * k)
            held = nd.memory_stats(device)["current_bytes"] - baseline
            if j == 0:
                act = held
                t_floor = time.perf_counter()  # bookkeeping of the measurement, left out of T_step
                # (a stack's boundary, a layer's output the stack's policy may drop, is no part of the floor)
                floor = sum(b for node, reason, b in checkpoint.saved_residuals(loss, exclude=params + [X, y])
                            if reason == "leaf" or reason == "boundary" and not node.boundary)
                if rss:
                    rss.sample()
                bookkeeping += time.perf_counter() - t_floor
            accumulating = data_parallel and j < k - 1
            with model.no_sync() if accumulating else contextlib.nullcontext():
                (loss if scaler is None else scaler.scale(loss)).backward()
        backward_stats.append(checkpoint.last_backward_stats())
        recomputed += backward_stats[-1]["recomputed_nodes"]
        if rss:
            rss.sample()
        if k > 1 and not data_parallel:
            grads = [p.grad.realize_cached_data() for p in params]
            accumulated = grads if accumulated is None else [a + g for a, g in zip(accumulated, grads)]
            for p in params:
                p.grad = None
    del micro, X, y
    if k > 1 and not data_parallel:
        for p, g in zip(params, accumulated):
            p.grad = ndl.Tensor(g, device=device, requires_grad=False)
    return {"activation_bytes": act, "floor_bytes": floor, "losses": losses, "recomputed_nodes": recomputed,
            "bookkeeping_seconds": bookkeeping, "loss": loss, "backward_stats": backward_stats,
            # Gradient accumulation's buffers (the last micro-batch's gradients, the sums), held in `passes` until
            # train_step returns, as gc.py always has: its step_peak_bytes (Adam's update included) counts them.
            "accumulation_buffers": (grads, accumulated)}


def captured_training(model, loss_fn, opt, config, device):
    """--capture: (the plain step through ndl.jit.capture, `held`): recorded on its first calls, replayed after; on
    the calls that run in Python the step notes in `held` the bytes live once its forward is computed (M_act's
    reading: a replay, which runs no Python, skips it, as it skips every value read into Python)."""
    held = []

    def plain(X, y):
        opt.reset_grad()
        with autograd.lazy_mode(config.lazy):
            loss = loss_fn(X, y)
            autograd.run_deferred([loss])
        loss.realize_cached_data()
        held.append(nd.memory_stats(device)["current_bytes"])
        loss.backward()
        opt.step()
        return loss
    return ndl.jit.capture(plain), held


def captured_step(captured, batches, start, config, device, params, opt):
    """One step of --capture, measured from outside it. A recording call is measured as train_step measures a
    step; a replay allocates nothing (its arena, made by the first replay and kept, is the step's memory): its
    M_peak and step peak are the arena's bytes, its M_act the arena's bytes alive when the loss is computed."""
    stepper, held = captured
    ((X, y),) = micro_batches(batches, start, config, device)
    opt.reset_grad()  # (the last step's gradients go before the baseline, as in train_step; a replay puts them back)
    nd.reset_peak_memory_stats(device)
    baseline = nd.memory_stats(device)["current_bytes"]
    rss = None if device.name == "cuda" else PeakRSS(cached(device))
    held.clear()
    t0 = time.perf_counter()
    loss = float(stepper(X, y).numpy())
    elapsed = time.perf_counter() - t0
    rss_peak = rss.growth(cached(device, at_peak=True)) if rss else None
    stats = nd.memory_stats(device)
    if held:  # recorded: the step ran in Python
        act, own = held[0] - baseline, stats["peak_bytes"] - baseline
    else:
        # the arena (made by the first replay, held after) and what the replay allocated besides it; no RSS growth
        # of its own to read (the arena is resident before it begins)
        rss_peak = None
        arena = stepper.memory_plan.arena_bytes if stepper.memory_plan else 0
        baseline = stats["current_bytes"] - arena  # what is held outside the step's arena
        own, act = stats["peak_bytes"] - baseline, stepper.latest.result_bytes() or 0
    return {"loss": loss, "time_seconds": elapsed, "activation_bytes": int(act), "floor_bytes": None,
            "peak_bytes": int(stats["peak_bytes"]), "peak_activation_bytes": int(own), "step_peak_bytes": int(own),
            "baseline_bytes": int(baseline), "gpu_memory_bytes": gpu_memory_bytes(), "replayed": not held,
            # (a replay runs the program the last recording ran: its backward's count is the replay's)
            "recomputed_nodes": int(checkpoint.last_backward_stats()["recomputed_nodes"]),
            "rss_peak_bytes": rss_peak, "rss_start_bytes": rss.start if rss else None,
            **state_bytes(opt, params, gradient_bytes(opt, params)), "skipped_step": False, "loss_scale": None,
            **offload_traffic([], device)}, None


def offload_traffic(backward_stats, device):
    """The step's activation copies to and from host memory (--policy offload, --offload), from each backward's
    last_backward_stats (which counts the copies since the backward before: its forward's and its own)."""
    exposed = sum(s.get("copy_seconds_exposed", 0.0) for s in backward_stats)  # (offloading's store's traffic:
    offloaded = sum(s.get("offloaded_bytes", 0) for s in backward_stats)  # present once it has held a value)
    fetched = sum(s.get("fetched_bytes", 0) for s in backward_stats)
    hidden = None  # nothing was copied
    if (offloaded or fetched) and not cost_model.device_copies_overlap(device):
        hidden = 0.0  # cpu_numpy(): every copy is synchronous, nothing runs beside it
    elif offloaded or fetched:
        # a copy stream (cuda) or the copy thread (cpu()): the host waits only for what is not done when it needs
        # it. The copies' own seconds are their bytes at the measured bandwidth (cost_model's cached calibration);
        # what the host did not wait for of them was hidden under the compute beside them.
        model = cost_model.CostModel(device)
        copying = model.copy_seconds(offloaded, "to_host") + model.copy_seconds(fetched, "to_device")
        hidden = min(max(1 - exposed / copying, 0.0), 1.0)
    return {"activation_offloaded_bytes": int(offloaded), "activation_fetched_bytes": int(fetched),
            "host_peak_bytes": int(max((s.get("host_peak_bytes", 0) for s in backward_stats), default=0)),
            "fetched_nodes": int(sum(s["brought_back_nodes"] for s in backward_stats)),
            "copy_seconds_exposed": exposed, "copy_hidden_fraction": hidden}


def state_bytes(opt, params, grad_bytes):
    """The bytes of what a step keeps besides activations: parameters, gradients, the optimizer's state."""
    return {"param_bytes": int(sum(p.realize_cached_data().nbytes for p in params)), "grad_bytes": grad_bytes,
            "optimizer_bytes": int(opt.state_bytes()), "offloaded_bytes": int(opt.host_state_bytes())}


def gradient_bytes(opt, params):
    """Bytes of the gradients held on the device for the optimizer step: every `.grad` there (one a Budget parked in
    host memory is not, and is not fetched to be counted), or with ZeRO-2 this rank's shard."""
    if isinstance(opt, dist.ZeroRedundancyOptimizer):
        return int(opt.gradient_bytes())
    return int(sum(nbytes_of(p.grad.cached_data) for p in params if p.grad is not None))


def rank_share(X, y, device, group=None):
    """This rank's columns of a micro-batch: X (seq_len, b) and its targets y (seq_len * b,), b/N columns each
    (N: the ranks of `group`, the job's by default)."""
    X_np = X.numpy()
    y_np = y.numpy().reshape(X_np.shape)
    X_mine, y_mine = dist.split_batch(X_np, axis=1, group=group), dist.split_batch(y_np, axis=1, group=group)
    return (ndl.Tensor(X_mine, device=device, requires_grad=False),
            ndl.Tensor(np.ascontiguousarray(y_mine).reshape(-1), device=device, requires_grad=False))


def tensor_parallel_group(model):
    """The tensor-parallel group of a model split by parallelize_transformer (None: every rank), or False."""
    module = model.module if isinstance(model, dist.DataParallel) else model
    return getattr(module, "tensor_parallel_group", False)


def tensor_parallel_traffic(group):
    """This step's collectives in the tensor-parallel group: {kind: [calls, elements]} (comm.traffic)."""
    return {kind: list(counts) for kind, counts in dist.traffic(group).items()}


def per_rank_memory(step):
    """Every rank's memory and time in this step (one all-gather): parameters, gradients, optimizer state,
    activations, the step's seconds."""
    keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "peak_activation_bytes",
            "time_seconds")
    return dist.all_gather_object({"rank": dist.rank(), **{key: step[key] for key in keys}})


def pipeline_step(pipe, loss_fn, opt, batches, start, config, device, params):
    """One optimizer step of --parallel pipeline: the step's accumulation_steps micro-batches through the stages
    (GPipe), then this stage's optimizer step.  M_act is what this stage holds when its backward phase starts (all
    micro-batches' activations, GPipe's price); every rank reports its own."""
    opt.reset_grad()
    micro = micro_batches(batches, start, config, device)
    nd.reset_peak_memory_stats(device)
    baseline = nd.memory_stats(device)["current_bytes"]
    rss = None if device.name == "cuda" else PeakRSS(cached(device))
    t0 = time.perf_counter()
    with autograd.lazy_mode(config.lazy):
        loss = pipe.train_step(micro, loss_fn)
    del micro
    forward_backward_peak = nd.memory_stats(device)["peak_bytes"] - baseline
    rss_peak = rss.growth(cached(device, at_peak=True)) if rss else None  # the same window as M_peak's
    grad_bytes = gradient_bytes(opt, params)
    opt.step()
    elapsed = time.perf_counter() - t0
    stats, memory = pipe.last_step_stats(), nd.memory_stats(device)
    step = {
        "loss": loss, "time_seconds": elapsed, "activation_bytes": int(stats["activation_bytes"] or 0),
        "floor_bytes": None, "peak_bytes": int(memory["peak_bytes"]),
        "peak_activation_bytes": int(forward_backward_peak),
        "step_peak_bytes": int(memory["peak_bytes"] - baseline), "baseline_bytes": int(baseline),
        "recomputed_nodes": int(stats["recomputed_nodes"]), "gpu_memory_bytes": gpu_memory_bytes(),
        "rss_peak_bytes": rss_peak, "rss_start_bytes": rss.start if rss else None,
        **state_bytes(opt, params, grad_bytes), "skipped_step": False, "loss_scale": None,
        "pipeline": {key: stats[key] for key in ("bubble", "bubble_mean", "theory", "compute_seconds",
                                                 "step_seconds", "compute_seconds_per_rank")},
    }
    step["ranks"] = per_rank_memory(step)
    return step, None
