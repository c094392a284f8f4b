"""Layers whose parameters are split between the ranks of a tensor-parallel group (Megatron-LM).

Each is built from the one-process layer (`from_linear`, `from_embedding`), built identically on every rank, and
keeps this rank's slice of its parameters, so a tensor-parallel model holds exactly the one-process model's
numbers, cut up. `shard_axes` says which parameters are split, and along which axis: what state_dict gathers and
load_state_dict slices (transformer.py).

- ColumnParallelLinear: y = x W + b with W (in, out) and b split by columns (output features): rank r computes
  its out/N features of y from the whole x. `input` says how x arrives: "copy" (replicated on every rank: f, whose
  backward all-reduces the partial input gradients), "gather" (sequence parallel: the ranks' sequence shards are
  all-gathered, reduce-scattered in backward; the gathered sequence is not kept but gathered again in backward,
  as Megatron-SP does), or "ready" (the caller already did one of these).
- RowParallelLinear: W split by rows (input features): rank r multiplies its in/N features of x (the column-
  parallel layer's output) by its rows, and the partial products are summed: "all_reduce" (g) or
  "reduce_scatter" along the sequence axis (sequence parallel). The bias, whole on every rank, is added after
  the sum; under sequence parallelism each rank adds it to its own positions only, so its gradient is partial
  and goes through f (all-reduced in backward). The partial products are not kept: no gradient reads them.
- VocabParallelEmbedding: the table's rows (vocabulary) split: rank r looks up the ids in its range, zeros for
  the others, and the sum over ranks (all-reduce, or reduce-scatter along the sequence) is the lookup.
"""
import zlib

import numpy as np

from .... import ops
from ....autograd import Tensor
from ....nn import Module, Parameter
from .. import comm
from .regions import copy_to_region, gather_from_region, not_kept, reduce_from_region, reduce_scatter_to_region

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "slice_parameter"]

INPUTS = ("copy", "gather", "ready")
REDUCTIONS = ("all_reduce", "reduce_scatter")


def slice_parameter(param, axis, group, what):
    """A new Parameter holding this rank's 1/N of `param` along `axis` (ValueError naming `what` if N does not
    divide it)."""
    n, me = comm.world_size(group), comm.rank(group)
    size = param.shape[axis]
    if size % n:
        raise ValueError(f"{what}: {size} {'rows' if axis == 0 else 'columns'} (shape {tuple(param.shape)}) do not "
                         f"split over the {n} ranks of the tensor-parallel group")
    values = param.numpy()
    index = [slice(None)] * len(param.shape)
    index[axis] = slice(me * (size // n), (me + 1) * (size // n))
    return Parameter(np.ascontiguousarray(values[tuple(index)]), device=param.device, dtype=str(param.dtype))


class ColumnParallelLinear(Module):
    """A Linear whose output features are split between the ranks; see the module docstring."""

    shard_axes = {"weight": 1, "bias": 1}

    def __init__(self, linear, group=None, input="copy", sequence_axis=1):
        super().__init__()
        if input not in INPUTS:
            raise ValueError(f"ColumnParallelLinear: input must be one of {', '.join(INPUTS)}, got {input!r}")
        what = f"ColumnParallelLinear({linear.in_features}, {linear.out_features})"
        self.group, self.input, self.sequence_axis = group, input, sequence_axis
        self.in_features = linear.in_features
        self.out_features = linear.out_features // comm.world_size(group) if linear.out_features else 0
        self.weight = slice_parameter(linear.weight, 1, group, what)
        self.bias = None if linear.bias is None else slice_parameter(linear.bias, 1, group, what)

    @classmethod
    def from_linear(cls, linear, group=None, input="copy", sequence_axis=1):
        return cls(linear, group, input, sequence_axis)

    def forward(self, x, activation=None, activation_bits=None):
        if self.input == "copy":
            x = copy_to_region(x, self.group)
        elif self.input == "gather":  # the whole sequence: not kept, gathered again for the weight's gradient
            x = gather_from_region(x, self.sequence_axis, self.group, regather=True)
        out = ops.linear(x, self.weight, self.bias, activation, activation_bits)
        if self.input == "gather":
            not_kept(x)
        return out


class RowParallelLinear(Module):
    """A Linear whose input features are split between the ranks; see the module docstring."""

    shard_axes = {"weight": 0}

    def __init__(self, linear, group=None, reduce="all_reduce", sequence_axis=1):
        super().__init__()
        if reduce not in REDUCTIONS:
            raise ValueError(f"RowParallelLinear: reduce must be one of {', '.join(REDUCTIONS)}, got {reduce!r}")
        what = f"RowParallelLinear({linear.in_features}, {linear.out_features})"
        self.group, self.reduce, self.sequence_axis = group, reduce, sequence_axis
        self.in_features = linear.in_features // comm.world_size(group)
        self.out_features = linear.out_features
        self.weight = slice_parameter(linear.weight, 0, group, what)
        self.bias = linear.bias  # whole on every rank, added after the sum

    @classmethod
    def from_linear(cls, linear, group=None, reduce="all_reduce", sequence_axis=1):
        return cls(linear, group, reduce, sequence_axis)

    def forward(self, x):
        partial = ops.linear(x, self.weight)
        if self.reduce == "all_reduce":
            out, bias = reduce_from_region(partial, self.group), self.bias
        else:
            out = reduce_scatter_to_region(partial, self.sequence_axis, self.group)
            bias = None if self.bias is None else copy_to_region(self.bias, self.group)  # added to a shard
        not_kept(partial)  # no gradient reads this rank's partial sums (the reduction's is the identity or a gather)
        if bias is None:
            return out
        return out + ops.broadcast_to(ops.reshape(bias, (1,) * (len(out.shape) - 1) + (self.out_features,)),
                                      out.shape)


class VocabParallelEmbedding(Module):
    """An Embedding whose rows (vocabulary) are split between the ranks; see the module docstring.

    forward(ids of shape S) -> S + (dim,), summed over the ranks by all-reduce, or with reduce="reduce_scatter"
    this rank's slice of it along `sequence_axis` (sequence parallelism)."""

    shard_axes = {"weight": 0}

    def __init__(self, embedding, group=None, reduce="all_reduce", sequence_axis=0):
        super().__init__()
        if reduce not in REDUCTIONS:
            raise ValueError(f"VocabParallelEmbedding: reduce must be one of {', '.join(REDUCTIONS)}, got {reduce!r}")
        what = f"VocabParallelEmbedding({embedding.num_embeddings}, {embedding.embedding_dim})"
        self.group, self.reduce, self.sequence_axis = group, reduce, sequence_axis
        self.weight = slice_parameter(embedding.weight, 0, group, what)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.start = comm.rank(group) * self.weight.shape[0]  # this rank's first row in the whole table
        self.batch_checked = False  # the first batch's ids are compared between ranks (check_same_ids)

    @classmethod
    def from_embedding(cls, embedding, group=None, reduce="all_reduce", sequence_axis=0):
        return cls(embedding, group, reduce, sequence_axis)

    def forward(self, x):
        shape = tuple(x.shape)
        ids = x.numpy().reshape(-1).astype(np.int64)
        bad = (ids < 0) | (ids >= self.num_embeddings)
        if bad.any():
            raise IndexError(f"VocabParallelEmbedding({self.num_embeddings}, {self.embedding_dim}): id "
                             f"{int(ids[bad][0])} is outside [0, {self.num_embeddings})")
        if not self.batch_checked:
            check_same_ids(ids, self.group)
            self.batch_checked = True
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = ops.gather_rows(self.weight, Tensor(np.where(mine, local, 0).astype(np.float32), device=x.device,
                                                   dtype="float32", requires_grad=False))
        keep = Tensor(mine[:, None].astype(np.float32), device=x.device, dtype=str(self.weight.dtype),
                      requires_grad=False)  # (k, 1), broadcast as a view
        # other ranks' rows: zeros here, their values added by the reduction below
        out = ops.reshape(rows * ops.broadcast_to(keep, tuple(rows.shape)), shape + (self.embedding_dim,))
        if self.reduce == "all_reduce":
            return reduce_from_region(out, self.group)
        return reduce_scatter_to_region(out, self.sequence_axis, self.group)


def check_same_ids(ids, group=None):
    """ValueError on every rank unless every rank of `group` was given the same token ids (tensor parallelism splits
    the model, not the batch: ranks fed different batches would train a model that is neither). One all-gather of a
    checksum, so every rank raises alike."""
    everyone = comm.all_gather_object((ids.shape, zlib.crc32(ids.tobytes())), label="the first batch's ids check",
                                      group=group)
    differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        raise ValueError(f"tensor parallelism: rank {differ[0]} was given other token ids than rank 0 (shape "
                         f"{everyone[differ[0]][0]} against {everyone[0][0]}): every rank of a tensor-parallel group "
                         f"must see the same batch")
