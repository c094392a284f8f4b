"""parallelize_transformer: a LanguageModel's Transformer cut between the ranks of a tensor-parallel group.

    model = LanguageModel(E, V, H, num_layers=2, seq_model="transformer", ...)   # the same on every rank
    tensor_parallel.parallelize_transformer(model, group=None, sequence_parallel=False)
    loss, _ = model.loss(x, y)        # x (T, B), y (T*B,): the whole batch on every rank of the group

What is split (Megatron-LM): each layer's attention by heads (the q, k and v projections by columns, the output
projection by rows: ColumnParallelLinear, RowParallelLinear), its MLP (linear1 by columns, linear2 by rows), the
embedding and the head by vocabulary. The layer norms and the positional embedding are whole on every rank.

Without sequence parallelism the layers' activations outside attention and the MLP are replicated: f (copy) in
front of the attention's pre-norms and of the MLP's linear1, g (all-reduce) after the output projection and
linear2. The course's attention normalizes q, k and v with three LayerNorms (Megatron has one), so f sits before
them and their weights and biases pass through f too: each rank's gradient of them is partial (its heads'
share), summed in backward. Per layer: 2 all-reduces of B·T·E forward (Megatron's), and in backward 2 of B·T·E
plus 6 of E (the pre-norms' parameters).

With `sequence_parallel=True` (Korthikanti et al. 2022) each rank holds T/N positions of the residual stream:
the layer norms, the dropouts and the residual adds run on that shard; the column-parallel layers all-gather it
("gather") and the row-parallel ones reduce-scatter their partial sums back to shards instead of g. Every
parameter used on a shard (the layer norms, the positional embedding, linear2's bias) gets a partial gradient and
passes through f. The embedding reduce-scatters its partial lookups to shards; the head all-gathers the rows.
The three pre-norms each gather their output (3 all-gathers of B·T·E where Megatron has 1).

`model.state_dict()` gives the one-process model's keys and shapes on every rank (each split parameter gathered:
a collective, so every rank of the group calls it), `load_state_dict` takes them and keeps this rank's slice.
"""
import numpy as np

from .... import ops
from ....autograd import Tensor
from ....nn import Module
from ....nn.nn_transformer import Transformer
from .. import comm
from ..data_parallel import check_same_model
from .cross_entropy import VocabParallelHead
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .regions import copy_to_region, gather_along, slice_along

__all__ = ["ParallelAttention", "ParallelTransformer", "ParallelTransformerLayer", "TensorParallelModel",
           "parallelize_transformer", "sharded_parameters"]

SEQUENCE_AXIS = 1  # of the layers' (B, T, E) stream


def _layer_norm(norm, x, group, sharded):
    """`norm` (LayerNorm1d) on x; with `sharded` its parameters go through f (their gradient is partial here)."""
    if not sharded:
        return norm(x)
    return ops.layer_norm(x, copy_to_region(norm.weight, group), copy_to_region(norm.bias, group), norm.eps)


class ParallelAttention(Module):
    """AttentionLayer (self-attention) with its heads split between the ranks; see the module docstring."""

    def __init__(self, attention, group, sequence_parallel):
        super().__init__()
        n = comm.world_size(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.prenorm_q, self.prenorm_k, self.prenorm_v = attention.prenorm_q, attention.prenorm_k, attention.prenorm_v
        arrive = "gather" if sequence_parallel else "ready"
        self.q_projection = ColumnParallelLinear(attention.q_projection, group, arrive, SEQUENCE_AXIS)
        self.k_projection = ColumnParallelLinear(attention.k_projection, group, arrive, SEQUENCE_AXIS)
        self.v_projection = ColumnParallelLinear(attention.v_projection, group, arrive, SEQUENCE_AXIS)
        self.attn = attention.attn
        reduce = "reduce_scatter" if sequence_parallel else "all_reduce"
        self.out_projection = RowParallelLinear(attention.out_projection, group, reduce, SEQUENCE_AXIS)
        self.num_head, self.dim_head = attention.num_head // n, attention.dim_head
        self.fused_attention = attention.fused_attention

    def _heads(self, x):
        B, T, _ = x.shape
        return ops.transpose(ops.reshape(x, (B, T, self.num_head, self.dim_head)), (1, 2))

    def forward(self, x):
        inner = x if self.sequence_parallel else copy_to_region(x, self.group)
        sharded = True  # replicated input through f, or a sequence shard: the pre-norms' gradients are partial
        q = self._heads(self.q_projection(_layer_norm(self.prenorm_q, inner, self.group, sharded)))
        k = self._heads(self.k_projection(_layer_norm(self.prenorm_k, inner, self.group, sharded)))
        v = self._heads(self.v_projection(_layer_norm(self.prenorm_v, inner, self.group, sharded)))
        fused = self.fused_attention if self.fused_attention is not None else \
            self.attn.dropout.p == 0 or not self.attn.dropout.training
        result = self.attn.fused(q, k, v) if fused else self.attn(q, k, v)[0]
        B, _, T, _ = result.shape
        merged = ops.reshape(ops.transpose(result, (1, 2)), (B, T, self.num_head * self.dim_head))
        return self.checkpoint(self.out_projection(merged), [x])


class ParallelTransformerLayer(Module):
    """TransformerLayer with attention and MLP split between the ranks; see the module docstring."""

    def __init__(self, layer, group, sequence_parallel):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.attention = ParallelAttention(layer.attention, group, sequence_parallel)
        self.layernorm = layer.layernorm
        self.linear1 = ColumnParallelLinear(layer.linear1, group, "gather" if sequence_parallel else "copy",
                                            SEQUENCE_AXIS)
        self.linear2 = RowParallelLinear(layer.linear2, group, "reduce_scatter" if sequence_parallel else
                                         "all_reduce", SEQUENCE_AXIS)
        # element-wise: each rank applies the activation (and its few-bit codes) to its own columns
        self.dropout, self.activation, self.activation_bits = layer.dropout, layer.activation, layer.activation_bits
        if layer.activation == "relu":
            self.relu = layer.relu

    def forward(self, x):
        h = x + self.dropout(self.attention(x))
        normed = _layer_norm(self.layernorm, h, self.group, self.sequence_parallel)
        hidden = self.linear1(normed, activation=self.activation, activation_bits=self.activation_bits)
        out = h + self.dropout(self.linear2(self.dropout(hidden)))
        return self.checkpoint(out, [x])


class ParallelTransformer(Module):
    """Transformer (sequence first, as LanguageModel uses it) over ParallelTransformerLayers: forward(x (T, B, E),
    or this rank's (T/N, B, E) shard with sequence parallelism) -> (output of x's shape, zeros)."""

    def __init__(self, transformer, group, sequence_parallel):
        super().__init__()
        if transformer.batch_first:
            raise ValueError("parallelize_transformer: a batch_first Transformer is not supported (LanguageModel's "
                             "is sequence first)")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.embedding_size, self.sequence_len = transformer.embedding_size, transformer.sequence_len
        self.positional_embedding = transformer.positional_embedding
        self.layers = [ParallelTransformerLayer(layer, group, sequence_parallel) for layer in transformer.layers]

    def forward(self, x, h=None):
        T, B, E = x.shape
        first = comm.rank(self.group) * T if self.sequence_parallel else 0  # this shard's first position
        if first + T > self.sequence_len:
            raise ValueError(f"ParallelTransformer: sequence length {first + T} exceeds sequence_len="
                             f"{self.sequence_len}")
        positions = Tensor(np.arange(first, first + T).reshape(T, 1), device=x.device, dtype="float32",
                           requires_grad=False)
        if self.sequence_parallel:  # positions of this shard only: the table's gradient is partial
            table = copy_to_region(self.positional_embedding.weight, self.group)
            pos = ops.gather_rows(table, ops.reshape(positions, (T,)))
        else:
            pos = self.positional_embedding(positions)
        pos = ops.reshape(pos, (1, T, E))
        y = self.checkpoint(ops.transpose(x, (0, 1)) + ops.broadcast_to(pos, (B, T, E)), [x])
        for layer in self.layers:
            y = layer(y)
        y = ops.transpose(y, (0, 1))
        zero = Tensor(np.zeros((1, 1, 1), np.float32), device=x.device, dtype=x.dtype, requires_grad=False)
        return y, ops.broadcast_to(zero, tuple(x.shape))


def sharded_parameters(module, prefix=""):
    """{dotted name: axis} of the split parameters under `module` (the layers' `shard_axes`), as state_dict names
    them."""
    found, stack = {}, [(prefix, module)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, Module):
            for name, axis in getattr(value, "shard_axes", {}).items():
                if getattr(value, name, None) is not None:
                    found[f"{path}.{name}" if path else name] = axis
            value = value.__dict__
        if isinstance(value, dict):
            stack += [(f"{path}.{k}" if path else str(k), v) for k, v in value.items() if isinstance(v, (Module, list,
                                                                                                       tuple, dict))]
        elif isinstance(value, (list, tuple)):
            stack += [(f"{path}.{i}" if path else str(i), v) for i, v in enumerate(value)]
    return found


class TensorParallelModel:
    """What parallelize_transformer adds to a LanguageModel (as the first base of its class): forward and loss
    through the split modules, and state dicts of the whole model."""

    def _hidden(self, x, h):
        out, h = self.seq_model(self.embedding(x), h)
        T, B, E = out.shape
        return ops.reshape(out, (T * B, E)), h

    def forward(self, x, h=None):
        """(logits (T*B, V), whole on every rank, h); the same as the one-process model's."""
        hidden, h = self._hidden(x, h)
        return self.linear(hidden), h

    def loss(self, x, y, h=None, chunk_size=None):
        """(the mean cross-entropy, h), the head fused with the loss over the split vocabulary (cross_entropy)."""
        if self.sequence_parallel and x.shape[0] % comm.world_size(self.tensor_parallel_group):
            raise ValueError(f"{type(self).__name__}: sequence length {x.shape[0]} does not split over the "
                             f"{comm.world_size(self.tensor_parallel_group)} ranks (sequence_parallel=True)")
        hidden, h = self._hidden(x, h)
        return self.linear.loss(hidden, y, chunk_size), h

    def state_dict(self):
        """The one-process model's state dict, on every rank: each split parameter all-gathered (a collective)."""
        state = super().state_dict()
        for name, axis in sharded_parameters(self).items():
            state[name] = gather_along(state[name], axis, self.tensor_parallel_group)
        return state

    def load_state_dict(self, state_dict, strict=True):
        """Load the one-process model's state dict: each rank keeps its slice of the split parameters."""
        sliced = dict(state_dict)
        n, own = comm.world_size(self.tensor_parallel_group), dict(self._named_tensors())
        for name, axis in sharded_parameters(self).items():
            if name not in sliced:
                continue
            value = np.asarray(sliced[name].numpy() if hasattr(sliced[name], "numpy") else sliced[name])
            full = tuple(s * n if i == axis else s for i, s in enumerate(own[name].shape))
            if value.shape != full:
                raise RuntimeError(f"load_state_dict for {type(self).__name__}: {name!r} has shape {value.shape} "
                                   f"in the state dict, but {full} in the (whole) model")
            sliced[name] = slice_along(value, axis, self.tensor_parallel_group)
        return super().load_state_dict(sliced, strict)


_CLASSES = {}


def _tensor_parallel_class(cls):
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (TensorParallelModel, cls), {})
    return _CLASSES[cls]


def _check_divisible(model, n):
    transformer = model.seq_model
    checks = [("the embedding", "vocabulary", model.embedding.num_embeddings),
              ("the LM head", "vocabulary", model.linear.out_features)]
    for i, layer in enumerate(transformer.layers):
        checks += [(f"seq_model.layers.{i}.attention", "heads", layer.attention.num_head),
                   (f"seq_model.layers.{i}.linear1", "hidden features", layer.linear1.out_features)]
    for where, what, size in checks:
        if size % n:
            raise ValueError(f"parallelize_transformer: {where} has {size} {what}, which do not divide by the "
                             f"tensor-parallel size {n}")


def parallelize_transformer(model, group=None, sequence_parallel=False):
    """Turn `model` (a LanguageModel with seq_model="transformer", built identically on every rank of `group`)
    into its tensor-parallel form in place, each rank keeping its slice; see the module docstring. Returns it.

    ValueError on every rank (before any communication) when a head count, the vocabulary or the MLP width does
    not divide by the group's size, naming the module and the sizes; a model built differently on another rank
    is a ValueError on every rank too (one all-gather of the parameters' names, shapes and checksums), and so is
    a first batch whose token ids differ between ranks (VocabParallelEmbedding checks it)."""
    if not isinstance(getattr(model, "seq_model", None), Transformer):
        raise ValueError(f"parallelize_transformer: expected a LanguageModel with seq_model='transformer', got "
                         f"{type(model).__name__} with seq_model {type(getattr(model, 'seq_model', None)).__name__}")
    n = comm.world_size(group)
    _check_divisible(model, n)
    # each rank keeps its slice of its own copy: copies that differ (another seed) would train a model that is neither
    check_same_model("parallelize_transformer", model.named_parameters(), group, values=True)
    reduce = "reduce_scatter" if sequence_parallel else "all_reduce"
    model.embedding = VocabParallelEmbedding(model.embedding, group, reduce, sequence_axis=0)
    model.seq_model = ParallelTransformer(model.seq_model, group, sequence_parallel)
    model.linear = VocabParallelHead(model.linear, group, sequence_parallel)
    model.tensor_parallel_group, model.sequence_parallel = group, sequence_parallel
    model.__class__ = _tensor_parallel_class(type(model))
    policy = model.checkpoint_policy
    for m in [model] + model._children():  # the new modules are checkpointed as the model was
        m.checkpoint_policy = policy
        m.training = model.training
    model.__dict__.pop("_named", None)
    for p in model.parameters():
        p.name = None
    model.named_parameters()  # name the new parameters by their paths
    return model
