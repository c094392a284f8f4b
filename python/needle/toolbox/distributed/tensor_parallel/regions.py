"""The communication of tensor and sequence parallelism as graph ops (Megatron-LM's "regions"), with gradients.

Megatron's f and g (Shoeybi et al. 2019) and their sequence-parallel forms (Korthikanti et al. 2022):

    copy_to_region          f: identity forward, all-reduce backward (enters a tensor-parallel region)
    reduce_from_region      g: all-reduce forward, identity backward (leaves it: the partial sums added)
    gather_from_region      all-gather along an axis forward; backward reduce-scatter ("reduce_scatter": the
                            consumers were split, each rank's gradient is partial) or this rank's slice ("split":
                            the consumers were replicated, every rank holds the whole gradient)
    reduce_scatter_to_region  reduce-scatter along an axis forward (partial sums in, this rank's sum out),
                            all-gather backward
    scatter_to_region       this rank's slice along an axis forward, all-gather backward

Every rank of the group must call the same ops in the same order, which MPI needs anyway: a model built the
same way on every rank does. The ops that communicate in their forward (all but copy and scatter) are not
`recomputable` (autograd.Op): checkpointing never drops their output, so backward never recomputes them and a
recomputation never repeats a collective; their gradients run once each, in backward. Collectives work on NumPy
copies (comm), so the arrays go to the host and back, as every collective of needle.distributed does.

One repeat is on purpose: `gather_from_region(..., regather=True)` (sequence parallelism's all-gather in front of
a column-parallel matmul, Korthikanti et al. 2022, section 4.2.2). Its output, the whole sequence, is what the
matmul's weight gradient reads; keeping it would hold N times the shard each rank keeps. So the op is
`recomputable` and its caller marks the output dropped (`not_kept`) once the matmul has read it: backward's plan
then all-gathers the shard again just before the weight gradient, as it recomputes any dropped value (at most
once per backward, released after its last use). Every rank plans the same backward of the same graph, so every
rank repeats the same all-gather at the same point, and gc "all" makes exactly the collectives of gc off (tested:
the counts of `comm.traffic`). fully_sharded.GatherShards re-gathers ZeRO-3's weights the same way.
"""
import numpy as np

from ....autograd import TensorOp
from ....backend_selection import array_api, device_of
from ....regions import apply_decision
from .. import comm

__all__ = ["CopyToRegion", "GatherFromRegion", "ReduceFromRegion", "ReduceScatterToRegion", "ScatterToRegion",
           "copy_to_region", "gather_from_region", "not_kept", "reduce_from_region", "reduce_scatter_to_region",
           "scatter_to_region"]


def _like(values, array):
    return array_api.array(np.ascontiguousarray(values), dtype=str(array.dtype), device=device_of(array))


def _axis(axis, ndim):
    return axis % ndim


def gather_along(values, axis, group):
    """Every rank's NumPy `values` concatenated along `axis` in group-rank order (one all-gather)."""
    n = comm.world_size(group)
    flat = np.ascontiguousarray(values).reshape(-1)
    everything = comm.all_gather_buffer(flat, [flat.size] * n, group=group).reshape((n,) + values.shape)
    return np.concatenate(list(everything), axis=axis)


def reduce_scatter_along(values, axis, group):
    """This rank's slice along `axis` of the sum over the group's ranks of NumPy `values` (one reduce-scatter)."""
    n = comm.world_size(group)
    moved = np.ascontiguousarray(np.moveaxis(values, axis, 0))  # the slices to scatter, contiguous
    size = moved.size
    part = comm.reduce_scatter_buffer(moved.reshape(-1), [size // n] * n, group=group).wait()
    shape = (moved.shape[0] // n,) + moved.shape[1:]
    return np.moveaxis(part.reshape(shape), 0, axis)


def slice_along(values, axis, group):
    """This rank's slice of `values` along `axis` (its 1/N, in group-rank order)."""
    n, me = comm.world_size(group), comm.rank(group)
    size = values.shape[axis] // n
    index = [slice(None)] * values.ndim
    index[axis] = slice(me * size, (me + 1) * size)
    return values[tuple(index)]


def _check_divisible(what, shape, axis, group):
    n = comm.world_size(group)
    if shape[axis] % n:
        raise ValueError(f"{what}: axis {axis} of shape {tuple(shape)} does not split over the {n} ranks of the "
                         f"tensor-parallel group")


class CopyToRegion(TensorOp):
    """f: the identity; d/dx: the all-reduce (sum) of the gradient over the group."""

    elementwise = True
    saves = "none"
    view = True

    def __init__(self, group):
        self.group = group

    def view_strides(self, shape, strides, out_shape):
        return tuple(strides)

    def compute(self, a):
        return a

    def gradient(self, out_grad, node):
        return reduce_from_region(out_grad, self.group)


class ReduceFromRegion(TensorOp):
    """g: the all-reduce (sum) over the group; d/dx: the identity."""

    elementwise = True
    saves = "none"
    recomputable = False

    def __init__(self, group):
        self.group = group

    def compute(self, a):
        return comm.all_reduce(a, "sum", group=self.group)

    def gradient(self, out_grad, node):
        return out_grad


class GatherFromRegion(TensorOp):
    """All-gather along `axis`; d/dx: the reduce-scatter of the gradient ("reduce_scatter") or its slice ("split").
    `regather`: backward may all-gather again instead of keeping the output (see the module docstring)."""

    saves = "none"
    recomputable = False

    def __init__(self, axis, group, grad="reduce_scatter", regather=False):
        if grad not in ("reduce_scatter", "split"):
            raise ValueError(f"gather_from_region: grad must be 'reduce_scatter' or 'split', got {grad!r}")
        self.axis, self.group, self.grad = axis, group, grad
        self.recomputable = regather

    def infer_shape(self, shape):
        axis = _axis(self.axis, len(shape))
        return tuple(s * comm.world_size(self.group) if i == axis else s for i, s in enumerate(shape))

    def compute(self, a):
        values = array_api.to_numpy(a)
        return _like(gather_along(values, _axis(self.axis, values.ndim), self.group), a)

    def gradient(self, out_grad, node):
        if self.grad == "split":
            return scatter_to_region(out_grad, self.axis, self.group)
        return reduce_scatter_to_region(out_grad, self.axis, self.group)


class ToShards(TensorOp):
    """This rank's slice along `axis` of `shard(values)`; d/dx: the all-gather of the gradient. The two ops below
    differ only in what they slice: the sum over the group, or the value as it is."""

    saves = "none"
    name = "to_shards"

    def __init__(self, axis, group):
        self.axis, self.group = axis, group

    def infer_shape(self, shape):
        axis = _axis(self.axis, len(shape))
        return tuple(s // comm.world_size(self.group) if i == axis else s for i, s in enumerate(shape))

    def shard(self, values, axis):
        raise NotImplementedError

    def compute(self, a):
        values = array_api.to_numpy(a)
        axis = _axis(self.axis, values.ndim)
        _check_divisible(self.name, values.shape, axis, self.group)
        return _like(self.shard(values, axis), a)

    def gradient(self, out_grad, node):
        return gather_from_region(out_grad, self.axis, self.group, grad="split")


class ReduceScatterToRegion(ToShards):
    """This rank's slice along `axis` of the sum over the group; d/dx: the all-gather of the gradient."""

    recomputable = False
    name = "reduce_scatter_to_region"

    def shard(self, values, axis):
        return reduce_scatter_along(values, axis, self.group)


class ScatterToRegion(ToShards):
    """This rank's slice along `axis` (no communication); d/dx: the all-gather of the gradient."""

    name = "scatter_to_region"

    def shard(self, values, axis):
        return slice_along(values, axis, self.group)


def copy_to_region(x, group=None):
    return CopyToRegion(group)(x)


def reduce_from_region(x, group=None):
    return ReduceFromRegion(group)(x)


def gather_from_region(x, axis, group=None, grad="reduce_scatter", regather=False):
    return GatherFromRegion(axis, group, grad, regather)(x)


def not_kept(node):
    """Keep no value of `node` after its consumers have read it: eager mode releases it now (call this once they
    are built), lazy mode as soon as they are computed; backward computes it again if a gradient reads it."""
    apply_decision(node, False)
    return node


def reduce_scatter_to_region(x, axis, group=None):
    return ReduceScatterToRegion(axis, group)(x)


def scatter_to_region(x, axis, group=None):
    return ScatterToRegion(axis, group)(x)
