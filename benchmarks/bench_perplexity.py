"""Perplexity you can trust: the same Transformer LM trained one epoch in needle and in PyTorch, side by side.

    python benchmarks/bench_perplexity.py               # gc.py's default model on PTB, one epoch; about 2 minutes
    python benchmarks/bench_perplexity.py --markdown    # the table alone on stdout (figures.py)
    python benchmarks/bench_perplexity.py --max-batches 5 --num-layers 1    # a quick look

Same architecture (benchmarks/torch_lm.py: needle's LanguageModel written again in PyTorch), the same initial
parameters (PyTorch's are copied from needle's seeded model, gc.py's: --seed 0 and the output layer's weight scaled by
0.1), the same batches in the same order (batchify of the training text into --batch-size columns, windows of
--seq-len rows in order, as train_ptb takes them), the same optimizer (Adam, lr 1e-3, PyTorch's defaults otherwise,
which are needle's), float32, the same thread count. Each then reads the test text the same way, in eval mode,
and reports its perplexity: exp of the mean cross-entropy per test word. needle trains as gc.py does (lazy mode, the
fused LM head model.loss, gc off); PyTorch computes the logits whole. The step times are the medians of the epoch's
steps (forward, backward, Adam), after the first. The data is data/ptb, else ../shared/data/ptb.
"""
import argparse
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps")]

import numpy as np  # noqa: E402

import needle as ndl  # noqa: E402
from needle import autograd  # noqa: E402
from needle.data import Corpus, batchify, get_batch  # noqa: E402

from md_table import markdown_table, progress_to_stderr  # noqa: E402
from models import LanguageModel  # noqa: E402

PTB = [os.path.join(ROOT, "data", "ptb"), os.path.join(ROOT, "..", "shared", "data", "ptb")]


def windows(batches, seq_len, limit=None):
    """The start rows of an epoch's windows, in order (epoch_general_ptb's), at most `limit` of them."""
    return list(range(0, len(batches) - 1, seq_len))[:limit]


def needle_model(args, vocab, device):
    np.random.seed(args.seed)
    model = LanguageModel(args.embedding_size, vocab, args.hidden_size, num_layers=args.num_layers,
                          seq_model="transformer", seq_len=args.seq_len, device=device, num_head=args.num_head,
                          dim_head=args.embedding_size // args.num_head)
    model.linear.weight.data = model.linear.weight.data * 0.1  # gc.py's --head-init-scale 0.1
    return model


def train_needle(model, batches, args, device):
    """(train losses, step seconds) of one epoch."""
    opt = ndl.optim.Adam(model.parameters(), lr=args.lr)
    model.train()
    losses, seconds = [], []
    for i in windows(batches, args.seq_len, args.max_batches):
        X, y = get_batch(batches, i, args.seq_len, device=device, dtype="float32")
        t0 = time.perf_counter()
        opt.reset_grad()
        with autograd.lazy_mode(True):
            loss = model.loss(X, y)[0]
            loss.backward()
        opt.step()
        seconds.append(time.perf_counter() - t0)
        losses.append(float(loss.numpy()))
    return losses, seconds


def train_torch(model, batches, args):
    import torch

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses, seconds = [], []
    for i in windows(batches, args.seq_len, args.max_batches):
        X, y = torch_batch(batches, i, args.seq_len)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(X), y)
        loss.backward()
        opt.step()
        seconds.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, seconds


def torch_batch(batches, i, seq_len):
    import torch

    n = min(seq_len, len(batches) - 1 - i)
    return (torch.tensor(batches[i:i + n], dtype=torch.int64),
            torch.tensor(batches[i + 1:i + 1 + n].reshape(-1), dtype=torch.int64))


def needle_perplexity(model, batches, args, device):
    model.eval()
    total = count = 0
    for i in windows(batches, args.seq_len):
        X, y = get_batch(batches, i, args.seq_len, device=device, dtype="float32")
        total += float(model.loss(X, y)[0].numpy()) * y.shape[0]
        count += y.shape[0]
    return math.exp(total / count)


def torch_perplexity(model, batches, args):
    import torch

    total = count = 0
    with torch.no_grad():
        for i in windows(batches, args.seq_len):
            X, y = torch_batch(batches, i, args.seq_len)
            total += float(torch.nn.functional.cross_entropy(model(X), y)) * len(y)
            count += len(y)
    return math.exp(total / count)


def run(args):
    """{framework: (test perplexity, first and last training loss, median step seconds)} and the set-up's text."""
    import torch

    from torch_lm import TorchLM

    data = args.data or next((p for p in PTB if os.path.isfile(os.path.join(p, "train.txt"))), None)
    if data is None:
        raise SystemExit("bench_perplexity: no PTB at data/ptb or ../shared/data/ptb (python -m needle.data.download "
                         "ptb --dir data)")
    corpus, device = Corpus(data), ndl.cpu()
    threads = device.num_threads()
    torch.set_num_threads(threads)
    train, test = (batchify(ids, args.batch_size, device, "float32") for ids in (corpus.train, corpus.test))
    model = needle_model(args, len(corpus.dictionary), device)
    oracle = TorchLM(model)  # copied before either trains
    steps = len(windows(train, args.seq_len, args.max_batches))
    setup = (f"Transformer LM (embedding {args.embedding_size}, feed-forward {args.hidden_size}, {args.num_layers} "
             f"layers, {args.num_head} heads, vocabulary {len(corpus.dictionary)}), batch {args.batch_size} x seq_len "
             f"{args.seq_len}, Adam lr {args.lr:g}, {steps} steps (one epoch of {os.path.relpath(data, ROOT)}'s "
             f"{len(corpus.train)} training words), {threads} thread(s)")
    print(f"bench_perplexity: {setup}")
    results = {}
    for name, train_fn, perplexity_fn in (
            ("needle", lambda: train_needle(model, train, args, device),
             lambda: needle_perplexity(model, test, args, device)),
            ("PyTorch", lambda: train_torch(oracle, train, args), lambda: torch_perplexity(oracle, test, args))):
        losses, seconds = train_fn()
        results[name] = (perplexity_fn(), losses[0], losses[-1], statistics.median(seconds[1:] or seconds))
        print(f"  {name}: test perplexity {results[name][0]:.2f}, training loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
              f"{results[name][3]:.3f} s per step")
    return results, setup


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--embedding-size", type=int, default=256)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batches", type=int, default=None, help="train on the epoch's first N batches only")
    p.add_argument("--data", default=None, help="a PTB folder (default: data/ptb, else ../shared/data/ptb)")
    p.add_argument("--markdown", action="store_true", help="print the table in Markdown on stdout, the rest on stderr")
    args = p.parse_args()
    if not ndl.cpu().enabled():
        raise SystemExit("bench_perplexity: the C++ backend is not built; run `make` first")
    with progress_to_stderr(args.markdown):
        results, setup = run(args)
        (ppl, *_, t), (ppl_torch, *_, t_torch) = results["needle"], results["PyTorch"]
        print(f"needle's test perplexity is {abs(ppl / ppl_torch - 1):.3%} from PyTorch's; its step "
              f"{t / t_torch:.2f}x PyTorch's")
    if args.markdown:
        rows = [[name, f"{r[0]:.2f}", f"{(r[0] / ppl_torch - 1) * 100:+.3f}%", f"{r[1]:.3f} → {r[2]:.3f}",
                 f"{r[3]:.3f} s", f"{r[3] / t_torch:.2f}"] for name, r in results.items()]
        print(f"{setup}.\n")
        print(markdown_table(["framework", "test perplexity", "vs PyTorch", "training loss, first → last step",
                              "time per step", "× PyTorch"], rows, right=(1, 2, 4, 5)))


if __name__ == "__main__":
    main()
