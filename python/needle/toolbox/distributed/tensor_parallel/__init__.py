"""needle.distributed.tensor_parallel: a model's layers split between the ranks of a group (Megatron-LM's tensor
parallelism, Shoeybi et al. 2019, and its sequence parallelism, Korthikanti et al. 2022), on MPI.

- `regions`: the communication as graph ops with gradients: f (copy_to_region: identity forward, all-reduce
  backward), g (reduce_from_region: the converse), and for sequence parallelism gather_from_region /
  reduce_scatter_to_region / scatter_to_region (all-gather forward and reduce-scatter backward, and the converse).
- `layers`: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.
- `cross_entropy`: VocabParallelHead and vocab_parallel_linear_cross_entropy: the LM head with its vocabulary
  split, fused with the loss (per-row max and sums all-reduced, never the logits).
- `activations`: norm_and_dropout_bytes, the layer norms' and dropouts' activations of a recorded step (what
  sequence parallelism divides by N).
- `transformer`: parallelize_transformer(model, group=None, sequence_parallel=False) turns a LanguageModel into
  its tensor-parallel form in place; its state_dict is the one-process model's.

Checkpointing: a recomputation never repeats a collective, but for one repeat made on purpose. The ops that
communicate in their forward pass are not `recomputable` (an attribute of autograd.Op), and checkpoint.annotate
never offers such a node to a policy, so its output is never dropped: backward, which recomputes only dropped
values, never runs them again. f and the scatter do not communicate forward and may be dropped and recomputed like
any op. The repeat: with sequence parallelism the all-gathered sequence in front of a column-parallel matmul is not
kept but gathered again in backward for the weight's gradient (Megatron-SP; regions.not_kept), the same on every
rank. Every gradient runs once, in backward, so gc "all" makes exactly the collectives of gc off (tested: the
counts of `comm.traffic`).
"""
from . import activations, cross_entropy, layers, regions, transformer
from .activations import norm_and_dropout_bytes
from .cross_entropy import VocabParallelHead, vocab_parallel_linear_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .regions import (
    copy_to_region, gather_from_region, not_kept, reduce_from_region, reduce_scatter_to_region, scatter_to_region,
)
from .transformer import parallelize_transformer, sharded_parameters

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead", "activations",
    "copy_to_region", "cross_entropy", "gather_from_region", "layers", "norm_and_dropout_bytes", "not_kept",
    "parallelize_transformer", "reduce_from_region",
    "reduce_scatter_to_region", "regions", "scatter_to_region", "sharded_parameters", "transformer",
    "vocab_parallel_linear_cross_entropy",
]
