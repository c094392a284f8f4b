"""One training step of the Transformer language model: needle (gc off and "all") vs the same model in PyTorch.

    python benchmarks/bench_step.py                 # batch 128, seq_len 32, embedding = hidden = 256, 4 layers
    python benchmarks/bench_step.py --batch_size 32 --num_layers 2
    python benchmarks/bench_step.py --profile        # where needle's step spends its time (cProfile, top 25)
    python benchmarks/bench_step.py --markdown       # the table alone on stdout, in Markdown (figures.py)

Same architecture (pre-norm attention + ReLU MLP, 4 heads, positional embedding, PTB-sized vocabulary), same
thread count (OMP_NUM_THREADS, default all cores; torch.set_num_threads likewise), forward + backward + Adam.
Median of repeated steps after warm-up, measured in one run. PyTorch is skipped with a message if absent.
"""
import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
threads = os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))
os.environ.setdefault("OPENBLAS_NUM_THREADS", threads)
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps")]

import numpy as np  # noqa: E402

import needle as ndl  # noqa: E402
from needle import nn  # noqa: E402

from md_table import markdown_table, progress_to_stderr  # noqa: E402
from models import LanguageModel  # noqa: E402


def build_lm(args, gc, device=None):
    """(model, Adam, the loss, X, y): the benchmark's Transformer LM on one seeded batch (bench_rss builds it too),
    on `device` (cpu() unless given: gpu_check.py times it on cuda())."""
    np.random.seed(0)
    device = device or ndl.cpu()
    model = LanguageModel(args.embedding_size, args.vocab, args.hidden_size, num_layers=args.num_layers,
                          seq_model="transformer", seq_len=args.seq_len, device=device, num_head=args.num_head,
                          dim_head=dim_head(args))
    if gc:
        model.enable_gc()
    opt = ndl.optim.Adam(model.parameters(), lr=1e-3)
    rs = np.random.RandomState(0)
    X = ndl.Tensor(rs.randint(0, args.vocab, (args.seq_len, args.batch_size)).astype(np.float32), device=device,
                   requires_grad=False)
    y = ndl.Tensor(rs.randint(0, args.vocab, (args.seq_len * args.batch_size,)).astype(np.float32), device=device,
                   requires_grad=False)
    return model, opt, nn.SoftmaxLoss(), X, y


def dim_head(args):
    """Each head's width: --dim_head, else the embedding split among the heads (the benchmark model's)."""
    return getattr(args, "dim_head", None) or args.embedding_size // args.num_head


def needle_step_fn(args, gc, autocast=None, device=None, capture=False):
    """The step as a function of no arguments; `capture`: run through ndl.jit.capture (replayed after two calls)."""
    model, opt, loss_fn, X, y = build_lm(args, gc, device)

    def train(X, y):
        opt.reset_grad()
        with ndl.autograd.lazy_mode(True), ndl.autocast(autocast or "bfloat16", enabled=autocast is not None):
            out, _ = model(X)
            loss = loss_fn(out, y)
        with ndl.autograd.lazy_mode(True):
            loss.backward()
        opt.step()
        return loss

    train = ndl.jit.capture(train) if capture else train
    return lambda: train(X, y)


def torch_step_fn(args, autocast=False, return_model=False, device="cpu"):
    import torch

    torch.set_num_threads(int(threads))
    torch.manual_seed(0)
    E, H, heads, D = args.embedding_size, args.hidden_size, args.num_head, dim_head(args)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm_q, self.norm_ff = torch.nn.LayerNorm(E), torch.nn.LayerNorm(E)
            self.qkv = torch.nn.Linear(E, 3 * heads * D, bias=False)
            self.out = torch.nn.Linear(heads * D, E, bias=False)
            self.ff1, self.ff2 = torch.nn.Linear(E, H), torch.nn.Linear(H, E)

        def forward(self, x):  # (B, T, E)
            B, T, _ = x.shape
            q, k, v = self.qkv(self.norm_q(x)).view(B, T, 3, heads, D).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-1, -2) / D ** 0.5
            mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
            scores = scores.masked_fill(mask, float("-inf"))
            x = x + self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, heads * D))
            return x + self.ff2(torch.relu(self.ff1(self.norm_ff(x))))

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.pos = torch.nn.Embedding(args.vocab, E), torch.nn.Embedding(args.seq_len, E)
            self.layers = torch.nn.ModuleList([Layer() for _ in range(args.num_layers)])
            self.head = torch.nn.Linear(E, args.vocab)

        def forward(self, x):  # (T, B)
            h = (self.embed(x) + self.pos(torch.arange(x.shape[0], device=x.device))[:, None]).transpose(0, 1)
            for layer in self.layers:
                h = layer(h)
            return self.head(h.transpose(0, 1).reshape(-1, E))

    model = LM().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    X = torch.randint(0, args.vocab, (args.seq_len, args.batch_size)).to(device)
    y = torch.randint(0, args.vocab, (args.seq_len * args.batch_size,)).to(device)

    def step():
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = torch.nn.functional.cross_entropy(model(X), y)
        loss.backward()
        opt.step()

    return (model, step) if return_model else step


def median_step(step, repeats):
    step()  # warm-up (a captured step: recorded on this call and the next, replayed after)
    step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def add_model_arguments(p):
    """The benchmark model's flags (its defaults are the benchmark model), for this script and bench_rss.py."""
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--embedding_size", type=int, default=256)
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--num_layers", type=int, default=4)
    p.add_argument("--num_head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=10000)
    p.add_argument("--dim_head", type=int, default=None, help="each head's width (default: embedding / heads)")


def timed_rounds(args):
    """{configuration: its best median step time over the interleaved rounds}; PyTorch's rows if it is there."""
    try:
        if args.no_torch:
            raise ImportError
        torch_step = torch_step_fn(args)
        torch_mixed = torch_step_fn(args, autocast=True)
    except ImportError:
        torch_step = torch_mixed = None
        print("bench_step: PyTorch left out (pip install torch==2.13.0 if absent); showing needle alone")
    results = {}
    for _ in range(args.rounds):  # interleave the frameworks, keep each one's best median
        for name, make in (("needle, gc off", lambda: needle_step_fn(args, False)),
                           ("needle, gc off, captured", lambda: needle_step_fn(args, False, capture=True)),
                           ("needle, gc all", lambda: needle_step_fn(args, True)),
                           ("needle, gc all, captured", lambda: needle_step_fn(args, True, capture=True)),
                           ("needle, mixed-bf16", lambda: needle_step_fn(args, False, "bfloat16")),
                           ("pytorch", torch_step and (lambda: torch_step)),
                           ("pytorch, autocast bf16", torch_mixed and (lambda: torch_mixed))):
            if make:
                t = median_step(make(), args.repeats)
                results[name] = min(t, results.get(name, t))
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(p)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-torch", "--no_torch", dest="no_torch", action="store_true", help="needle alone")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; each framework keeps its best median")
    p.add_argument("--markdown", action="store_true", help="print the table in Markdown on stdout, the rest on stderr")
    args = p.parse_args()
    if not ndl.cpu().enabled():
        raise SystemExit("bench_step: the C++ backend is not built; run `make` first")
    with progress_to_stderr(args.markdown):
        print(f"bench_step: batch {args.batch_size} x seq_len {args.seq_len}, embedding {args.embedding_size}, "
              f"hidden {args.hidden_size}, {args.num_layers} layers, {args.num_head} heads, vocab {args.vocab}, "
              f"{threads} thread(s); median of {args.repeats} steps after a warm-up")
        if args.profile:
            step = needle_step_fn(args, gc=False)
            step()
            cProfile.runctx("step()", globals(), {"step": step}, "/tmp/bench_step.prof")
            pstats.Stats("/tmp/bench_step.prof").sort_stats("tottime").print_stats(25)
            return
        results = timed_rounds(args)
        base = results.get("pytorch")
        print(f"{'':24s}{'s / step':>10s}{'x pytorch':>11s}")
        for name, t in results.items():
            print(f"{name:24s}{t:10.3f}{(t / base if base else float('nan')):11.2f}")
        if "needle, mixed-bf16" in results:
            ratio = results["needle, mixed-bf16"] / results["needle, gc off"]
            print(f"needle mixed-bf16 / needle fp32 (gc off): {ratio:.2f}")
    if args.markdown:
        rows = [[name, f"{t:.3f}", f"{t / base:.2f}" if base else ""] for name, t in results.items()]
        print(markdown_table([f"{threads} thread(s)", "s / step", "× PyTorch"], rows, right=(1, 2)))


if __name__ == "__main__":
    main()
