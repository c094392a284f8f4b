"""A small, quick training run: a Transformer language model on Penn Treebank text.

    python apps/train_demo.py                  # ~40 batches, well under a minute on 2 CPU cores
    python apps/train_demo.py --batches 200 --device cpu_numpy

It reads PTB from ../shared/data/ptb (next to the repository) or data/ptb, and otherwise writes a small
synthetic corpus to a temporary folder, so it always runs. The loss printed every few batches should fall.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import needle as ndl
except ImportError:  # a checkout without `pip install -e .`: use the in-tree package
    sys.path.append(os.path.join(ROOT, "python"))
    import needle as ndl
sys.path.append(os.path.join(ROOT, "apps"))
from models import LanguageModel  # noqa: E402
from simple_ml import evaluate_ptb  # noqa: E402

__all__ = ["find_ptb", "main", "synthetic_corpus"]


def find_ptb(root=ROOT):
    """The first folder with PTB's train.txt and test.txt: ../shared/data/ptb, then data/ptb; else None."""
    for folder in (os.path.join(root, "..", "shared", "data", "ptb"), os.path.join(root, "data", "ptb")):
        if all(os.path.exists(os.path.join(folder, f)) for f in ("train.txt", "test.txt")):
            return os.path.normpath(folder)
    return None


def synthetic_corpus(folder, lines=400, seed=0):
    """Write train.txt and test.txt of sentences from a tiny grammar (learnable structure) into `folder`."""
    rng = np.random.RandomState(seed)
    subjects, verbs, objects = ["the cat", "a dog", "the bird", "my friend"], ["sees", "likes", "eats"], [
        "the fish", "a ball", "some bread", "the moon"]
    os.makedirs(folder, exist_ok=True)
    for name, n in (("train.txt", lines), ("test.txt", lines // 4)):
        with open(os.path.join(folder, name), "w") as f:
            for _ in range(n):
                f.write(f" {subjects[rng.randint(4)]} {verbs[rng.randint(3)]} {objects[rng.randint(4)]} \n")
    return folder


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=40, help="training batches (default 40)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=20)
    parser.add_argument("--max-lines", type=int, default=300, help="lines of each PTB file to read")
    parser.add_argument("--device", choices=["cpu", "cpu_numpy", "cuda"], default=None,
                        help="default: cpu if the C++ backend is built, else cpu_numpy")
    parser.add_argument("--data", default=None, help="a folder with train.txt and test.txt")
    parser.add_argument("--eval-batches", type=int, default=5, help="test batches to evaluate on at the end")
    parser.add_argument("--print-every", type=int, default=5)
    args = parser.parse_args(argv)

    device = getattr(ndl, args.device)() if args.device else (ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy())
    folder = args.data or find_ptb()
    if folder is None:
        folder = synthetic_corpus(os.path.join(tempfile.mkdtemp(prefix="needle-demo-"), "ptb"))
        print(f"PTB not found; using a synthetic corpus in {folder}")
    corpus = ndl.data.Corpus(folder, max_lines=args.max_lines)
    train = ndl.data.batchify(corpus.train, args.batch_size, device, "float32")
    test = ndl.data.batchify(corpus.test, args.batch_size, device, "float32")[:args.eval_batches * args.seq_len + 1]
    print(f"data {folder}: {len(corpus.train)} training tokens, vocabulary {len(corpus.dictionary)}, device {device}")

    np.random.seed(0)
    model = LanguageModel(64, len(corpus.dictionary), 128, num_layers=2, seq_model="transformer",
                          seq_len=args.seq_len, device=device)
    opt = ndl.optim.Adam(model.parameters(), lr=0.003)
    loss_fn = ndl.nn.SoftmaxLoss()
    model.train()
    start, window, losses = time.time(), 0, []
    for step in range(args.batches):
        if window >= train.shape[0] - 1:
            window = 0  # next epoch
        X, y = ndl.data.get_batch(train, window, args.seq_len, device=device)
        window += args.seq_len
        opt.reset_grad()
        out, _ = model(X)
        loss = loss_fn(out, y)
        losses.append(float(np.asarray(loss.numpy()).item()))  # read before backward releases it
        loss.backward()
        opt.step()
        if (step + 1) % args.print_every == 0 or step + 1 == args.batches:
            recent = np.mean(losses[-args.print_every:])
            print(f"batch {step + 1:4d}  loss {recent:.3f}  ({time.time() - start:.1f}s)")
    acc, loss = evaluate_ptb(model, test, seq_len=args.seq_len, device=device)
    print(f"test: loss {loss:.3f}, accuracy {acc:.3f}  ({time.time() - start:.1f}s in all)")
    return losses


if __name__ == "__main__":
    main()
