# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 6. A language model on PTB
#
# Everything so far measured memory. This lesson trains the course's Transformer language model on the Penn
# Treebank for a few epochs, follows its perplexity (e^loss: how many words it is choosing among, on average),
# and makes it write.

# %%
import os
import sys
import tempfile

ROOT = os.path.abspath(".." if os.path.isdir("../python/needle") else ".")  # notebooks/ or the repository root
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "apps")]

import matplotlib.pyplot as plt
import numpy as np

import needle as ndl
from needle import nn
from models import LanguageModel
from simple_ml import epoch_general_ptb

device = ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy()

# %% tags=["parameters"]
DATA = None          # a PTB folder; None: data/ptb, else ../shared/data/ptb, else a toy corpus made here
MAX_LINES = None     # read only the first lines of each file (None: all of them)
EPOCHS = 3
BATCH = 32
SEQ = 32             # words per window; the Transformer sees at most SEQ words back
WIDTH = 128
LAYERS = 2
LR = 3e-3
PROMPT = "the company said"
TOKENS = 30          # words to write after the prompt
TEMPERATURE = 0.8    # below 1: surer choices; above 1: wilder
SEED = 0

# %% [markdown]
# ## The data
#
# `Corpus` reads `train.txt` and `test.txt` into word ids, one shared dictionary, `<eos>` at each line's end.
# Without PTB here (fetch it with `python -m needle.data.download ptb --dir data`) the cell makes a toy corpus of
# simple sentences instead, and says so: the lesson runs anywhere, and learns a smaller language.

# %%
def toy_corpus(folder):
    """Writes train.txt and test.txt of simple sentences (subject, verb, object) into `folder`: a language to learn."""
    rs = np.random.RandomState(0)
    subjects = ["the company", "the bank", "the market", "a trader", "the government", "investors"]
    verbs = ["said", "expects", "sold", "bought", "reported", "lost"]
    objects = ["shares", "the stock", "its stake", "a profit", "new bonds", "the plan", "N million"]
    lines = [f"{subjects[rs.randint(6)]} {verbs[rs.randint(6)]} {objects[rs.randint(7)]}" for _ in range(4000)]
    for name, part in (("train.txt", lines[:3600]), ("test.txt", lines[3600:])):
        with open(os.path.join(folder, name), "w") as f:
            f.write("\n".join(part) + "\n")


candidates = [DATA] if DATA else [os.path.join(ROOT, "data", "ptb"), os.path.join(ROOT, "..", "shared", "data", "ptb")]
folder = next((p for p in candidates if os.path.isfile(os.path.join(p, "train.txt"))), None)
if folder is None:
    print(f"PTB not found at {' or '.join(candidates)}: training on a toy corpus of made-up sentences instead")
    with tempfile.TemporaryDirectory() as toy:  # read, then gone: nothing left behind
        toy_corpus(toy)
        corpus = ndl.data.Corpus(toy, max_lines=MAX_LINES)
    corpus_name = "a toy corpus"
else:
    corpus = ndl.data.Corpus(folder, max_lines=MAX_LINES)
    corpus_name = os.path.basename(os.path.normpath(folder))
train = ndl.data.batchify(corpus.train, BATCH, device, "float32")
test = ndl.data.batchify(corpus.test, BATCH, device, "float32")
print(f"{folder or corpus_name}: {len(corpus.train)} training words, {len(corpus.test)} test words, vocabulary "
      f"{len(corpus.dictionary)}")
print("the first words:", corpus.decode(corpus.train[:20]))

# %% [markdown]
# ## Training
#
# One epoch is one pass over the training text in windows of `SEQ` words (`epoch_general_ptb`, the course's
# helper). After each, the test text is read without training; its perplexity is the honest measure. A uniform
# guess over the vocabulary would score the vocabulary's size.

# %%
np.random.seed(SEED)
model = LanguageModel(WIDTH, len(corpus.dictionary), 2 * WIDTH, num_layers=LAYERS, seq_model="transformer",
                      seq_len=SEQ, device=device, num_head=4, dim_head=WIDTH // 4)
opt = ndl.optim.Adam(model.parameters(), lr=LR)
history = {"train": [], "test": []}
for epoch in range(EPOCHS):
    _, train_loss = epoch_general_ptb(train, model, SEQ, nn.SoftmaxLoss(), opt, device=device)
    _, test_loss = epoch_general_ptb(test, model, SEQ, nn.SoftmaxLoss(), device=device)
    history["train"].append(np.exp(train_loss))
    history["test"].append(np.exp(test_loss))
    print(f"epoch {epoch + 1}: train perplexity {history['train'][-1]:8.1f}, "
          f"test perplexity {history['test'][-1]:8.1f}")

# %% [markdown]
# On the reduced PTB (70 thousand training words, see ../shared/data/ptb/README.md) a model this size soon knows its
# training text better than language: when the training perplexity keeps falling and the test perplexity turns
# back up, it is memorizing. The full PTB's 887 thousand words hold that off for longer.

# %% [markdown]
# ## The model writes
#
# `generate` continues the prompt a word at a time: it reads the last `SEQ` words, turns the logits into
# probabilities (divided by `TEMPERATURE` first) and draws the next word with its own generator, seeded: one seed,
# one text. Every word it writes is a word of the corpus, checked below. `perplexity` scores a text under the
# model, here the prompt and what it wrote: compare it with the test text's (a lower `TEMPERATURE`, surer words,
# scores lower).

# %%
words = [w for w in PROMPT.split() if w in corpus.dictionary.word2idx] or ["<eos>"]
if len(words) < len(PROMPT.split()):
    print(f"(words of the prompt not in the vocabulary were left out: the prompt is {' '.join(words)!r})")
ids = model.generate(corpus.encode(" ".join(words)), TOKENS, temperature=TEMPERATURE, seed=SEED)
out_of_vocabulary = [i for i in ids if not 0 <= i < len(corpus.dictionary)]
assert not out_of_vocabulary, f"ids outside the vocabulary: {out_of_vocabulary}"
print(corpus.decode(ids))
print(f"\n{len(ids)} words, every id in the vocabulary of {len(corpus.dictionary)}: no out-of-vocabulary ids")
sampled = model.perplexity(ids)
print(f"\nthe text's own perplexity under the model: {sampled:.1f} (the test text's: {history['test'][-1]:.1f})")

# %% [markdown]
# ## Your turn: perplexity against the epoch
#
# Change `EPOCHS`, `WIDTH`, `LAYERS`, `LR` or `BATCH` and run all again; change `TEMPERATURE` or `SEED` and run
# the last two cells again.

# %%
fig, ax = plt.subplots(figsize=(6, 4))
epochs = np.arange(1, EPOCHS + 1)
ax.plot(epochs, history["train"], "o-", label="train (during the epoch)")
ax.plot(epochs, history["test"], "o-", label="test (after the epoch)")
ax.axhline(sampled, color="grey", ls=":", label=f"its own text (temperature {TEMPERATURE:g})")
ax.set_xlabel("epoch")
ax.set_ylabel("perplexity")
ax.set_yscale("log")
ax.set_xticks(epochs)
ax.set_title(f"{LAYERS}-layer Transformer LM, width {WIDTH}, on {corpus_name}")
ax.legend()
plt.show()
