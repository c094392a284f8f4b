"""gc.py run --save-checkpoint FILE / --resume FILE: a run's training state saved, and a later run continuing from it
bit for bit, as if it had never stopped.

What a continuation needs is everything the next step reads: the parameters (the model's state_dict), the
optimizer's state (moments, step counts), the GradScaler's scale, NumPy's global RNG (dropout's masks come from it),
--compress-bits' rounding-noise counter (checkpoint.compress's state_dict; None without it), and the step count,
which is also where the data is: step i trains on window i mod --max-batches of the corpus, a function of i and the
flags, so the resumed run sees the batches the uninterrupted one would have.  The file also
records the flags that make a step what it is (RESUME_MUST_MATCH), and the vocabulary's words (so that gc.py sample can
rebuild the model from the file alone and write its text); a resume with another value of one is refused
in one line naming it, before any work, and so is what no run saves (a file edited by hand): a step that is not a
count, weights or optimizer state that are not finite, a --compress-bits run's file without its counter.

Under mpiexec each rank saves and resumes a file of its own (FILE.rankR.npz): its RNG, a pipeline stage's
parameters, a ZeRO shard's optimizer state are its own."""
import hashlib

import numpy as np

import needle as ndl
from needle.backend_ndarray.ndarray import FLOATS
from needle.toolbox import compress
from needle import distributed as dist

from .console import fail
from .data import resolve_data, vocabulary_words
from .outputs import checkpoint_file, make_folder_of

# The flags a resumed run must share with the run that saved (the vocabulary and the world size too): the model's
# shape, what a step computes (precision, head, dropout, batch) and the optimizer whose state is restored.
RESUME_MUST_MATCH = ("embedding_size", "hidden_size", "num_layers", "num_head", "seq_len", "batch_size",
                     "accumulation_steps", "dropout", "activation", "activation_bits", "compress_bits", "head",
                     "precision", "stochastic_rounding", "optimizer", "lr", "parallel")


def rank_and_size(config):
    """(this process's rank, the job's size): (0, 1) unless --parallel (then MPI is up)."""
    return (dist.rank(), dist.world_size()) if config.parallel else (0, 1)


def identity(config, vocab):
    """The values of RESUME_MUST_MATCH for this run, with the vocabulary and the world size, as the file keeps them."""
    return {**{name: getattr(config, name) for name in RESUME_MUST_MATCH}, "vocab": int(vocab),
            "world_size": rank_and_size(config)[1]}


def module_of(model):
    """The Module whose state_dict is the run's parameters: a Pipeline's own stage, else the model (or its
    DataParallel wrapper)."""
    return model.stage if isinstance(model, dist.Pipeline) else model


def compression_policy(model):
    """The model's checkpoint.compress policy (--compress-bits), or None: on the module enable_gc was called on,
    which a DataParallel wrapper (--parallel dp, zero, tp+dp) holds inside, not on itself."""
    module = module_of(model)
    for m in [module] + module._children():
        if isinstance(m.checkpoint_policy, compress.Compress):
            return m.checkpoint_policy
    return None


def compress_state(model):
    """--compress-bits' rounding-noise counter (checkpoint.compress's state_dict), or None without compression."""
    policy = compression_policy(model)
    return None if policy is None else policy.state_dict()


def save_training(config, vocab, step, model, opt, scaler):
    """This process's training state after `step` steps, written atomically (ndl.save) to --save-checkpoint."""
    # the vocabulary's words, in id order, one space between them: gc.py sample writes its text with them
    state = {"step": step, "config": identity(config, vocab), "model": module_of(model).state_dict(),
             "vocabulary": " ".join(vocabulary_words(resolve_data(config.data))),
             "optimizer": opt.state_dict(), "scaler": None if scaler is None else scaler.state_dict(),
             "rng": ndl.random_state(), "compress": compress_state(model)}
    path = checkpoint_file(config.save_checkpoint, *rank_and_size(config))
    try:
        make_folder_of(path)
        ndl.save(state, path)  # atomic: a failed save leaves the previous file, and no temporary one
    except OSError as err:
        fail(f"--save-checkpoint: cannot write {path}: {err.strerror or err}")


def load_training(config, vocab):
    """The state --resume names, checked against this run's flags (one line naming the first that differs)."""
    path = checkpoint_file(config.resume, *rank_and_size(config))
    try:
        state = ndl.load(path)
    except (OSError, ValueError) as err:
        fail(f"--resume {config.resume}: {err}")
    keys = ("step", "config", "model", "optimizer", "scaler", "rng")
    if not isinstance(state, dict) or any(key not in state for key in keys) or not isinstance(state["config"], dict):
        fail(f"--resume {path} is not a checkpoint gc.py run --save-checkpoint writes (it needs {', '.join(keys)})")
    check_values(state, path)
    saved, here = state["config"], identity(config, vocab)
    for name, value in here.items():
        if saved.get(name) != value:
            what = f"--{name.replace('_', '-')}" if name in RESUME_MUST_MATCH else f"the {name.replace('_', ' ')}"
            fail(f"--resume {path} was saved by a run with {what} {saved.get(name)}, this run has {value}: resume "
                 f"with the flags it was saved with")
    if config.compress_bits is not None and config.use_gc != 0 and state.get("compress") is None:
        fail(f"--resume {path}: the checkpoint holds no --compress-bits state (the count its rounding noise goes on "
             f"from): resumed, this run would draw other noise than the uninterrupted one")
    return state


def check_values(state, path):
    """What a hand-edited file could hold that no run saves: a step that is not a count, or weights and optimizer
    state that are not finite (training on from NaN only spreads it). One line naming the field."""
    step = state["step"]
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or step < 0:
        fail(f"--resume {path}: its step is {step!r}; a checkpoint's step is the count of steps trained (0 or more)")
    for part in ("model", "optimizer"):
        for name, value in leaves(state[part], part):
            array = np.asarray(value)
            floating = array.dtype.kind == "f" or array.dtype.name in FLOATS  # (bfloat16's kind is "V")
            if floating and not np.isfinite(array.astype(np.float32)).all():
                fail(f"--resume {path}: {name} holds NaN or infinity; a run saves finite values (was the file "
                     f"edited, or did that run diverge?)")


def leaves(tree, name):
    """(dotted name, value) of every leaf of a loaded checkpoint's nesting (dicts, lists, tuples)."""
    stack = [(name, tree)]
    while stack:
        name, node = stack.pop()
        if isinstance(node, dict):
            stack.extend((f"{name}.{key}", value) for key, value in reversed(node.items()))
        elif isinstance(node, (list, tuple)):
            stack.extend((f"{name}.{i}", value) for i, value in reversed(list(enumerate(node))))
        else:
            yield name, node


def restore_training(state, model, opt, scaler):
    """Put the loaded state into the freshly built model, optimizer and scaler, and NumPy's RNG; the step to go on
    from.  A state that does not fit them (a file edited by hand) is one line, as any bad input."""
    try:
        module_of(model).load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if scaler is not None:
            scaler.load_state_dict(state["scaler"])
        ndl.set_random_state(state["rng"])
        if compression_policy(model) is not None:  # its rounding noise goes on from the saved count
            compression_policy(model).load_state_dict(state.get("compress"))
    except (RuntimeError, ValueError, KeyError, TypeError) as err:
        fail(f"--resume: the checkpoint does not fit this run's model or optimizer: {err}")
    return int(state["step"])


def parameters_sha256(params):
    """SHA-256 of the parameters' bytes, in order: two runs that trained alike end with the same digest."""
    digest = hashlib.sha256()
    for p in params:
        digest.update(np.ascontiguousarray(p.numpy()).tobytes())
    return digest.hexdigest()
