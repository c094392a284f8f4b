"""Whether the model a command line describes can fit at all, decided from the flags before anything is built: its
parameters, their gradients and the optimizer's state, counted from the shapes the flags give, against the memory
there is (--memory-limit-mb, else the machine's).  A model a thousand times too large fails here in a line instead
of starting to draw weights it has no room for.

The count is a lower bound (activations, the batch and the allocator's slack come on top), so it refuses only what
cannot possibly train; test_experiment.py checks the shapes against a built model, parameter for parameter."""
import math

from needle import distributed as dist

from .console import fail
from .measure import machine_memory_bytes
from .setup import parallel_layout

ADAM8BIT_MIN_SIZE = 4096  # Adam8bit's min_8bit_size (its default, which gc.py keeps): smaller tensors stay 32-bit


def parameter_shapes(config, vocab):
    """The shapes of the LanguageModel's parameters (models.LanguageModel, a Transformer), in named_parameters()
    order: the embedding, the positions, each layer's pre-norms, projections, norm and feed-forward, the head."""
    d, h, t = config.embedding_size, config.hidden_size, config.seq_len
    layer = [(d,)] * 6 + [(d, d)] * 4 + [(d,)] * 2 + [(d, h), (1, h), (h, d), (1, d)]
    return [(vocab, d), (t, d)] + layer * config.num_layers + [(d, vocab), (1, vocab)]


def state_bytes(config, shapes, itemsize):
    """A lower bound of the optimizer's state for `shapes`: Adam two moments, SGD one velocity, Adam8bit two 1-byte
    codes (full-width ones for the embedding and small tensors), Adafactor a row and a column per matrix."""
    sizes = [math.prod(s) for s in shapes]
    if config.optimizer == "adam":
        return 2 * itemsize * sum(sizes)
    if config.optimizer == "sgd":
        return itemsize * sum(sizes)
    if config.optimizer == "adam8bit":  # the embedding and tensors too small to quantize keep full moments
        return sum((2 * itemsize if i == 0 or n < ADAM8BIT_MIN_SIZE else 2) * n for i, n in enumerate(sizes))
    return itemsize * sum(s[0] + s[1] if len(s) == 2 else math.prod(s) for s in shapes)  # adafactor


def model_bytes(config, vocab, ranks=1):
    """{"parameters", "gradients", "optimizer_state"}: bytes one process holds for them (a lower bound).  Pure bf16
    keeps 2-byte weights, every other precision 4-byte ones; --parallel pipeline spreads the parameters over the
    ranks, ZeRO the state (stage 1), the gradients (stage 2) and the parameters (stage 3), tensor parallelism splits
    all three (the layer norms, whole on every rank, make the division a lower bound still); --optimizer-in-backward
    holds one gradient at a time."""
    shapes = parameter_shapes(config, vocab)
    itemsize = 2 if config.precision == "bf16" else 4
    params = itemsize * sum(math.prod(s) for s in shapes)
    state = state_bytes(config, shapes, itemsize)
    # --optimizer-in-backward: each gradient is freed by its update inside backward; at least the largest is made
    grads = itemsize * max(math.prod(s) for s in shapes) if config.optimizer_in_backward else params
    split, _ = parallel_layout(config.parallel, ranks)  # tensor parallel: each rank about 1/split of the model
    share = {"pipeline": (ranks, ranks, ranks), "zero1": (1, 1, ranks), "zero2": (1, ranks, ranks),
             "zero3": (ranks, ranks, ranks)}.get(config.parallel, (split, split, split))
    return {"parameters": params // share[0], "gradients": grads // share[1], "optimizer_state": state // share[2]}


def check_fits(config, vocab, device):
    """Fail with one line when the model's parameters, gradients and optimizer state alone exceed the memory there
    is: --memory-limit-mb (the allocator's cap), else the machine's (the GPU's, or the host's RAM)."""
    need = model_bytes(config, vocab, dist.world_size() if config.parallel else 1)
    if config.memory_limit_mb is not None:  # it caps the device allocator, which offloaded state is outside of
        have, where = int(config.memory_limit_mb * 2**20), f"--memory-limit-mb {config.memory_limit_mb:g}"
        counted = ("parameters", "gradients") + (() if config.offload_state else ("optimizer_state",))
    else:
        have, where = machine_memory_bytes(device)
        counted = tuple(need)
    total = sum(need[key] for key in counted)
    what = f"parameters, gradients and {config.optimizer} state" if len(counted) == 3 else "parameters and gradients"
    if total > have:
        fail(f"the model would not fit: its {what} need at least "
             f"{gib(total)} ({gib(need['parameters'])} of parameters, --embedding-size {config.embedding_size}, "
             f"--hidden-size {config.hidden_size}, --num-layers {config.num_layers}, vocabulary {vocab}), and "
             f"{where} gives {gib(have)}")


def gib(nbytes):
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
