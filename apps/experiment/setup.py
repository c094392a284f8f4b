"""A run's configuration, RunConfig (the parsed command line, converted once), and what a run builds from it: the
device, the model, the checkpointing policy, the optimizer and the loss; Budget's plan checked before any work."""
import gc as python_gc  # the standard module (built in, so gc.py's name does not shadow it)
import math
from dataclasses import dataclass, fields

import numpy as np

import needle as ndl
from needle import autograd, checkpoint, nn
from needle import backend_ndarray as nd
from needle import distributed as dist
from needle.checkpoint_budget import InfeasibleBudget
from needle.data import batchify

from models import LanguageModel, LMStage

from .console import fail
from .data import micro_batches

POLICIES = ["off", "all", "sqrt", "selective", "layers", "budget", "offload"]
# gc.py sweep --over budget_mb: its curves, each (the child's --policy, whether its Budget may offload).  "offload"
# offloads what "all" drops whatever the budget: Budget has no offload-only mode, so that curve stands for it.
BUDGET_CURVES = {"budget": ("budget", False), "offload": ("offload", False), "budget-offload": ("budget", True)}
HEADS = ["full", "fused"]  # the LM head + loss: the course's SoftmaxLoss(model(x)), or model.loss(x, y) (fused)
# --precision -> (autocast dtype or None, loss scaling?)
PRECISIONS = ["fp32", "mixed-bf16", "mixed-fp16", "bf16"]
AUTOCAST = {"fp32": None, "mixed-bf16": "bfloat16", "mixed-fp16": "float16", "bf16": None}
OPTIMIZERS = ["adam", "adam8bit", "adafactor", "sgd"]
# --parallel: data parallel (gradients all-reduced), ZeRO stage 1 / 2 / 3 on top of it, GPipe over the ranks, or
# Megatron's tensor parallelism (with sequence parallelism, or in a 2-D layout with data parallelism)
PARALLEL = ["dp", "zero1", "zero2", "zero3", "pipeline", "tp", "tp+sp", "tp+dp"]
ZERO_STAGE = {"zero1": 1, "zero2": 2, "zero3": 3}
TENSOR_PARALLEL = ("tp", "tp+sp", "tp+dp")
TP_DP_TENSOR_SIZE = 2  # --parallel tp+dp: tensor groups of 2 consecutive ranks, data parallel across them


@dataclass(frozen=True)
class RunConfig:
    """Everything a gc.py command was told: every flag of every subcommand, by its dest.  A subcommand without a
    flag gets the default here (ablate has no --precision: fp32), so code reads config.precision, never asks
    whether it is there.  Memory flags are in MiB, as typed; the JSON records bytes."""
    command: str = "run"
    argv: tuple = ()  # the command line after `gc.py`, as the JSON records it
    # model and data
    data: str = None
    batch_size: int = None
    accumulation_steps: int = 1
    seq_len: int = None
    embedding_size: int = None
    hidden_size: int = None
    num_layers: int = None
    seq_model: str = "transformer"  # or "lstm"
    num_head: int = None
    dropout: float = None
    activation: str = "relu"
    activation_bits: int = None
    compress_bits: int = None  # checkpoint.compress around gc on's policy
    head_init_scale: float = None
    precision: str = "fp32"
    stochastic_rounding: bool = False
    init_scale: float = 2.0**16
    optimizer: str = "adam"
    optimizer_in_backward: bool = False  # each parameter updated inside backward, its gradient freed there
    offload_state: bool = False
    capture: bool = False  # the step through ndl.jit.capture: recorded on its first calls, replayed after
    head: str = None
    # checkpointing
    policy: str = None  # run: None is "all"
    offload: bool = False  # --policy budget: may Budget park values in host memory?
    host_bandwidth: float = None  # GB/s Budget plans its copies at (None: measured)
    use_gc: int = None
    policies: list = None  # sweep, max-batch
    segment_len: int = None
    budget_mb: float = None
    # training and measurement
    lazy: bool = True
    device: str = None
    epochs: int = 1
    max_batches: int = None
    warmup: int = None
    lr: float = None
    seed: int = None
    memory_limit_mb: float = None
    parallel: str = None
    bucket_mb: float = None
    # output
    out: str = None
    json: str = None
    progress: bool = None
    # saving and resuming (run)
    save_checkpoint: str = None
    save_every: int = None
    resume: str = None
    preset: str = None  # run --preset: presets.py's values for the flags not given
    # sample
    checkpoint: str = None
    prompt: str = None
    tokens: int = None
    temperature: float = None
    top_k: int = None
    # sweep, ablate, plot
    over: str = None
    values: list = None
    repeats: int = None
    rows: list = None
    steps: int = None
    dir: str = None
    # explain, max-batch
    verify: bool = False  # explain: each what-if row measured beside its prediction
    dry_run: bool = False  # max-batch: bisect on predictions, then confirm the answer with one real step

    @classmethod
    def from_args(cls, args, argv=()):
        """The argparse Namespace of one subcommand, as a RunConfig (a flag without a field is an error here)."""
        given = vars(args)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - names)
        if unknown:
            raise TypeError(f"RunConfig has no field for the flag(s) {', '.join(unknown)}: add them")
        return cls(argv=tuple(argv), **given)


def pick_device(name):
    if name == "cuda" or (name is None and nd.cuda().enabled()):
        if not nd.cuda().enabled():
            fail("--device cuda, but no GPU / CUDA build is available")
        return nd.cuda()
    if name == "cpu_numpy":
        return nd.cpu_numpy()
    if not nd.cpu().enabled():
        fail("the C++ backend is not built; run `make` first (or give --device cpu_numpy)")
    return nd.cpu()


def make_policy(config):
    """gc on's policy: a name for enable_gc (None: "all"), a Budget, or either inside checkpoint.compress."""
    policy = budget_policy(config) if config.policy == "budget" else \
        None if config.policy in (None, "all") else config.policy
    if config.compress_bits is None:
        return policy
    if policy is None:  # all, at --segment-len: its segments go inside compress (enable_gc would refuse them beside)
        policy = checkpoint.resolve_policy("all", config.segment_len)
    return checkpoint.compress(config.compress_bits, None if policy == "off" else policy)  # off: keep all, compressed


def policy_label(config):
    """gc on's policy as the JSON and the tables name it: "selective", or "selective+compress8"."""
    name = config.policy or "all"
    return name if config.compress_bits is None else f"{name}+compress{config.compress_bits}"


def segment_len(config, policy):
    """enable_gc's segment_len: --segment-len where gc on's policy is a bare "all" (make_policy's None); a
    compressed all carries its segments inside (make_policy), and no other policy takes them."""
    return config.segment_len if policy is None else None


def budget_policy(config, bound=None):
    """checkpoint.Budget at --budget-mb (or `bound` bytes), parking values in host memory with --offload, planning its
    copies at --host-bandwidth GB/s when given. Priced with this machine's calibration (calibrate=True: measured
    once, cached), so that its predicted step time is this machine's (gc.py reports it beside the measured)."""
    bandwidth = None if config.host_bandwidth is None else config.host_bandwidth * 1e9
    bound = int(config.budget_mb * 2**20) if bound is None else bound
    return checkpoint.Budget(bound, offload=bool(config.offload), host_bandwidth=bandwidth, calibrate=True)


def build_model(config, vocab, device, policy):
    """The course's LanguageModel (a Transformer, or an LSTM with --seq-model lstm), seeded; checkpointing on when
    policy is not "off"."""
    np.random.seed(config.seed)
    if config.seq_model == "lstm":
        model = LanguageModel(config.embedding_size, vocab, config.hidden_size, num_layers=config.num_layers,
                              seq_model="lstm", seq_len=config.seq_len, device=device)
    else:
        model = LanguageModel(config.embedding_size, vocab, config.hidden_size, num_layers=config.num_layers,
                              seq_model="transformer", seq_len=config.seq_len, device=device, num_head=config.num_head,
                              dim_head=config.embedding_size // config.num_head, dropout=config.dropout,
                              activation=config.activation, activation_bits=config.activation_bits)
    if config.head_init_scale != 1:
        # The course's init gives the output layer logits with a std of several units (its input, the residual
        # stream, is not normalized), so the loss starts far above ln(vocab), a uniform guess.  Scaled down,
        # training starts from about that guess.  Drawn the course's way first, so the random stream is the same.
        w = model.linear.weight
        w.data = w.data * config.head_init_scale
    if config.precision == "bf16":
        model.astype("bfloat16")  # pure bf16: the weights themselves (drawn in float32 first, then rounded)
    if policy != "off":
        model.enable_gc(segment_len=segment_len(config, policy), policy=policy)
    return model


def make_optimizer(config, params, model=None):
    """--optimizer at --lr: Adam (the course's); Adam8bit (block-wise 8-bit moments; the embedding's state kept
    32-bit, the paper's stable-embedding recipe); Adafactor with the external lr (relative_step and
    scale_parameter off, so the rows compare at one learning rate; factored second moments, no first moment);
    SGD with momentum 0.9.  fp32 and mixed precision keep float32 parameters (the master weights); pure bf16 keeps
    weights and state in bfloat16, with stochastic rounding if asked.  --offload-state keeps the state in host
    memory.  --optimizer-in-backward updates each parameter inside backward, as soon as its gradient is complete
    (in_backward=True; step() and reset_grad() then have nothing to do).  --parallel zero1 / zero2 / zero3 runs it
    inside ZeroRedundancyOptimizer (stage 1 / 2 / 3)."""
    name = config.optimizer
    kw = {"lr": config.lr, "offload_state": bool(config.offload_state)}
    if config.optimizer_in_backward:  # (only when asked: an optimizer without the argument still builds)
        kw["in_backward"] = True
    if config.precision == "bf16":
        kw.update(master_weights=False, stochastic_rounding=config.stochastic_rounding)
    cls = {"adam8bit": ndl.optim.Adam8bit, "adafactor": ndl.optim.Adafactor, "sgd": ndl.optim.SGD}.get(
        name, ndl.optim.Adam)
    if name == "adam8bit":
        embedding = getattr(model, "embedding", None)  # a pipeline stage without the embedding has None
        kw["fp32_state_params"] = [embedding.weight] if embedding is not None else []
    elif name == "adafactor":
        kw.update(relative_step=False, scale_parameter=False)
    elif name == "sgd":
        kw["momentum"] = 0.9
    stage = ZERO_STAGE.get(config.parallel)
    if stage:
        return dist.ZeroRedundancyOptimizer(params, cls, stage=stage, **kw)
    return cls(params, **kw)


def make_loss(model, head, autocast=None):
    """loss(X, y): the mean cross-entropy of one micro-batch through the LM head.

    "full" is the course's path, nn.SoftmaxLoss()(model(X)[0], y): the (tokens x vocabulary) logits are a graph
    value, held whole, and so is their gradient.  "fused" is model.loss(X, y), ops.linear_cross_entropy: the same
    loss and gradients up to rounding, the logits computed a chunk of tokens at a time inside one op (again in its
    gradient) and never held whole."""
    if head == "fused":
        loss = lambda X, y: model.loss(X, y)[0]  # noqa: E731
    else:
        softmax_loss = nn.SoftmaxLoss()
        loss = lambda X, y: softmax_loss(model(X)[0], y)  # noqa: E731
    if autocast is None:
        return loss

    def mixed(X, y):
        with ndl.autocast(autocast):  # forward and loss; backward replays the graph's casts
            return loss(X, y)
    return mixed


# ----- --parallel tp, tp+sp, tp+dp: the LanguageModel split by Megatron's tensor parallelism ------------------------
def parallel_layout(parallel, ranks):
    """(tensor-parallel size, data-parallel size) of --parallel over `ranks` processes: dp and zero are all data
    parallel, tp and tp+sp all tensor parallel, tp+dp tensor groups of TP_DP_TENSOR_SIZE."""
    if parallel == "tp+dp":
        return TP_DP_TENSOR_SIZE, ranks // TP_DP_TENSOR_SIZE
    if parallel in TENSOR_PARALLEL:
        return ranks, 1
    return 1, ranks


def parallel_groups(parallel):
    """(tensor group, data group) of this rank, None meaning every rank of the job. tp+dp: ranks {0, 1}, {2, 3},
    ... split the model, ranks equal mod 2 hold the same slice and share the batch. Every rank creates every
    group, in the same order (MPI's sub-communicators are collective)."""
    if parallel != "tp+dp":
        return None, None
    n, me, t = dist.world_size(), dist.rank(), TP_DP_TENSOR_SIZE
    tensor = [dist.new_group(range(s, s + t)) for s in range(0, n, t)]
    data = [dist.new_group(range(r, n, t)) for r in range(t)]
    return tensor[me // t], data[me % t]


def check_tensor_parallel_vocabulary(config, vocab):
    """--parallel tp, tp+sp, tp+dp: the embedding's and the head's vocabulary split over the tensor-parallel ranks
    (one line and exit 2 on every rank: they all read the same corpus)."""
    if config.parallel not in TENSOR_PARALLEL:
        return
    size, _ = parallel_layout(config.parallel, dist.world_size())
    if vocab % size:
        fail(f"--parallel {config.parallel}: the vocabulary of {vocab} words does not divide by the tensor-parallel "
             f"size {size} (the embedding and the LM head are split by vocabulary)")


def tensor_parallel_model(config, model, policy):
    """`model` (built with checkpointing off, the same on every rank) split by --parallel tp / tp+sp / tp+dp, then
    checkpointed with `policy`; tp+dp wraps it in DataParallel over its data group."""
    tensor_group, data_group = parallel_groups(config.parallel)
    try:
        dist.tensor_parallel.parallelize_transformer(model, group=tensor_group,
                                                     sequence_parallel=config.parallel == "tp+sp")
    except ValueError as err:  # the same model on every rank: every rank fails alike, no rank left waiting
        fail(f"--parallel {config.parallel}: {err}")
    if policy != "off":
        model.enable_gc(segment_len=segment_len(config, policy), policy=policy)
    if config.parallel == "tp+dp":
        return dist.DataParallel(model, bucket_mb=config.bucket_mb, group=data_group)
    return model


# ----- --parallel pipeline: the LanguageModel cut into stages (models.LMStage) --------------------------------
def pipeline_stages(model, n):
    """The LanguageModel cut into n stages of consecutive layers (the first ones get the extra layer)."""
    layers = model.seq_model.layers
    cuts = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(len(layers)), n)])
    return [LMStage(model, layers[cuts[s]:cuts[s + 1]], s == 0, s == n - 1) for s in range(n)]


def pipeline_loss(stage, head):
    """loss(rows, y) on the last stage: its head (the full or the fused one) and the mean cross-entropy."""
    if stage.linear is None:
        return None
    if head == "fused":
        return lambda h, y: ndl.ops.linear_cross_entropy(h, stage.linear.weight, stage.linear.bias, y)
    softmax_loss = nn.SoftmaxLoss()
    return lambda h, y: softmax_loss(stage.linear(h), y)


# ----- Budget(b), planned before any work ------------------------------------------------------------------------
def plan_budget(config, data, vocab, device, policy):
    """`policy`, a checkpoint.Budget, planned on the graph of the run's first micro-batch exactly as the run's
    first step will plan it; in lazy mode nothing is computed (the planner walks the graph with a byte ledger), in
    eager mode one forward pass is.  Its minimum_peak is the least M_peak checkpointing can reach, its
    predicted_peak the M_peak it plans for (with a budget above gc off's peak: gc off's, nothing dropped).
    InfeasibleBudget when the budget is infeasible (minimum_peak is set then too)."""
    model = build_model(config, vocab, device, policy)
    model.train()
    batches = batchify(data, config.batch_size * config.accumulation_steps, device=device, dtype="float32")
    X, y = micro_batches(batches, 0, config, device)[0]
    k = config.accumulation_steps
    try:
        with autograd.lazy_mode(config.lazy):
            loss = make_loss(model, config.head)(X, y)
            policy.plan(loss if k == 1 else loss / k)
    finally:
        del model, X, y
        python_gc.collect()
    return policy


def check_budget(config, data, vocab, device):
    """Fail with one line, before any work, when --budget-mb is below the least peak this graph can reach."""
    policy = budget_policy(config)
    try:
        plan_budget(config, data, vocab, device, policy)
    except InfeasibleBudget:
        least = policy.minimum_peak / 2**20
        fail(f"--budget-mb {config.budget_mb:g} is infeasible: the least M_peak checkpointing can reach on this "
             f"model is {least:.1f} MB ({policy.minimum_peak} bytes): give --budget-mb "
             f"{math.ceil(least * 10) / 10:g} or more")
    return policy
