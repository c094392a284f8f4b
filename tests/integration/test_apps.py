"""apps/: the course's models and training helpers, end to end on tiny data made here.

Runs on the C++ cpu() backend when it is built, else on the NumPy reference device.
"""
import gzip
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import needle as ndl
from apps import mlp_resnet, simple_ml
from apps.models import LanguageModel, ResNet9
from conftest import tiny_ptb

DEVICE = ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy()
REPO = Path(__file__).resolve().parents[2]


def blobs(n, dim, classes, seed):
    """A separable classification set: Gaussian clusters around well-separated centers."""
    rng = np.random.RandomState(seed)
    centers = rng.randn(classes, dim) * 4
    y = rng.randint(classes, size=n)
    X = (centers[y] + rng.randn(n, dim)).astype(np.float32)
    return X, y.astype(np.uint8)


def params_of(model):
    return [p.numpy().copy() for p in model.parameters()]


# ----- homework 1: the two-layer MLP with explicit weights ------------------------------------------------------
def test_two_layer_mlp_reaches_95_percent_training_accuracy():
    X, y = blobs(300, 10, 3, seed=0)
    np.random.seed(0)
    W1 = ndl.Tensor(np.random.randn(10, 32).astype(np.float32) / np.sqrt(32), device=DEVICE)
    W2 = ndl.Tensor(np.random.randn(32, 3).astype(np.float32) / np.sqrt(3), device=DEVICE)
    loss0, err0 = simple_ml.loss_err(ndl.relu(ndl.Tensor(X, device=DEVICE) @ W1) @ W2, y)
    for _ in range(5):
        W1, W2 = simple_ml.nn_epoch(X, y, W1, W2, lr=0.1, batch=50)
    loss, err = simple_ml.loss_err(ndl.relu(ndl.Tensor(X, device=DEVICE) @ W1) @ W2, y)
    assert err < 0.05 and loss < loss0, (err0, err, loss0, loss)


def test_softmax_loss_matches_numpy():
    rng = np.random.RandomState(1)
    Z = rng.randn(6, 4).astype(np.float32)
    y = rng.randint(4, size=6)
    one_hot = np.eye(4, dtype=np.float32)[y]
    expected = np.mean(np.log(np.exp(Z).sum(axis=1)) - Z[np.arange(6), y])
    got = simple_ml.softmax_loss(ndl.Tensor(Z), ndl.Tensor(one_hot)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5)


# ----- homework 2: MLPResNet on MNIST-format files --------------------------------------------------------------
def write_mnist(folder, prefix, n, seed):
    """n 28x28 images whose class (0-9) is the row of a bright band: learnable by an MLP."""
    rng = np.random.RandomState(seed)
    labels = rng.randint(10, size=n).astype(np.uint8)
    images = rng.randint(0, 40, size=(n, 28, 28)).astype(np.uint8)
    for i, c in enumerate(labels):
        images[i, 2 * c + 4:2 * c + 6, :] = 250
    with gzip.open(folder / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
        f.write(struct.pack(">iiii", 2051, n, 28, 28) + images.tobytes())
    with gzip.open(folder / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
        f.write(struct.pack(">ii", 2049, n) + labels.tobytes())
    return images, labels


def test_parse_mnist(tmp_path):
    images, labels = write_mnist(tmp_path, "train", 7, seed=0)
    X, y = simple_ml.parse_mnist(str(tmp_path / "train-images-idx3-ubyte.gz"),
                                 str(tmp_path / "train-labels-idx1-ubyte.gz"))
    assert X.shape == (7, 784) and X.dtype == np.float32 and y.dtype == np.uint8
    np.testing.assert_allclose(X, images.reshape(7, 784) / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(y, labels)


def test_mlp_resnet_trains_on_separable_data():
    X, y = blobs(200, 12, 4, seed=2)
    loader = ndl.data.DataLoader(ndl.data.NDArrayDataset(X, y), batch_size=25, shuffle=True)
    np.random.seed(0)
    model = mlp_resnet.MLPResNet(12, hidden_dim=32, num_blocks=2, num_classes=4)
    assert len(model.parameters()) == 2 + 2 * 8 + 2
    opt = ndl.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(4):
        train_err, train_loss = mlp_resnet.epoch(loader, model, opt)
    err, loss = mlp_resnet.epoch(ndl.data.DataLoader(ndl.data.NDArrayDataset(X, y), batch_size=50), model)
    assert not model.training
    assert err < 0.05 and 0 < loss < 0.5, (train_err, err, loss)


def test_train_mnist_returns_errors_and_losses(tmp_path):
    write_mnist(tmp_path, "train", 60, seed=0)
    write_mnist(tmp_path, "t10k", 20, seed=1)
    result = mlp_resnet.train_mnist(batch_size=20, epochs=2, lr=0.01, hidden_dim=16, data_dir=str(tmp_path))
    assert len(result) == 4
    train_err, train_loss, test_err, test_loss = result
    assert 0 <= train_err <= 1 and 0 <= test_err <= 1 and train_loss > 0 and test_loss > 0


def test_train_mnist_missing_data_says_how_to_fetch(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m needle.data.download mnist"):
        mlp_resnet.train_mnist(data_dir=str(tmp_path))


# ----- homework 4: CIFAR-10 helpers and ResNet9 -------------------------------------------------------------------
def test_resnet9_forward_shape_and_parameter_count():
    np.random.seed(0)
    model = ResNet9(device=DEVICE)
    convs = [(3, 16, 7), (16, 32, 3), (32, 32, 3), (32, 32, 3), (32, 64, 3), (64, 128, 3), (128, 128, 3),
             (128, 128, 3)]
    expected = sum(k * k * a * b + b + 2 * b for a, b, k in convs) + (128 * 128 + 128) + (128 * 10 + 10)
    assert sum(p.numpy().size for p in model.parameters()) == expected
    x = ndl.Tensor(np.random.rand(2, 3, 32, 32).astype(np.float32), device=DEVICE)
    out = model(x)
    assert out.shape == (2, 10)
    assert np.all(np.isfinite(out.numpy()))


def test_cifar10_helpers_train_and_evaluate():
    rng = np.random.RandomState(0)
    X = rng.rand(32, 3, 32, 32).astype(np.float32)
    y = (X[:, 0, :16].mean(axis=(1, 2)) > X[:, 0, 16:].mean(axis=(1, 2))).astype(np.float32)  # a linear rule
    loader = ndl.data.DataLoader(ndl.data.NDArrayDataset(X, y), batch_size=8)
    np.random.seed(0)
    model = ndl.nn.Sequential(ndl.nn.Flatten(), ndl.nn.Linear(3072, 2, device=DEVICE))
    acc0, loss0 = simple_ml.evaluate_cifar10(model, loader)
    acc, loss = simple_ml.train_cifar10(model, loader, n_epochs=5, lr=0.01, weight_decay=0.0, progress=False)
    acc1, loss1 = simple_ml.evaluate_cifar10(model, loader)
    assert 0 <= acc0 <= 1 and 0 <= acc <= 1
    assert loss1 < loss0 and acc1 >= acc0, (acc0, loss0, acc1, loss1)


# ----- homework 4: language models on a tiny corpus ---------------------------------------------------------------
@pytest.fixture
def corpus(tmp_path):
    rng = np.random.RandomState(0)
    subjects, verbs, objects = ["the cat", "a dog", "my friend"], ["sees", "likes"], ["the fish", "a ball", "bread"]
    lines = [f" {subjects[rng.randint(3)]} {verbs[rng.randint(2)]} {objects[rng.randint(3)]} \n" for _ in range(60)]
    (tmp_path / "train.txt").write_text("".join(lines[:50]))
    (tmp_path / "test.txt").write_text("".join(lines[50:]))
    return ndl.data.Corpus(str(tmp_path))


def language_model(corpus, seq_model, seed=0, **kw):
    np.random.seed(seed)
    return LanguageModel(8, len(corpus.dictionary), 8, num_layers=1, seq_model=seq_model, seq_len=6, device=DEVICE,
                         **kw)


@pytest.mark.parametrize("seq_model", ["rnn", "lstm", "transformer"])
def test_language_model_trains_one_epoch(corpus, seq_model):
    data = ndl.data.batchify(corpus.train, 4, DEVICE, "float32")
    model = language_model(corpus, seq_model)
    X, _ = ndl.data.get_batch(data, 0, 6, device=DEVICE)
    out, h = model(X)
    assert out.shape == (6 * 4, len(corpus.dictionary))
    acc0, loss0 = simple_ml.evaluate_ptb(model, data, seq_len=6, device=DEVICE)
    acc, loss = simple_ml.train_ptb(model, data, seq_len=6, n_epochs=1, optimizer=ndl.optim.Adam, lr=0.02,
                                    device=DEVICE, progress=False)
    acc1, loss1 = simple_ml.evaluate_ptb(model, data, seq_len=6, device=DEVICE)
    assert np.isfinite(loss) and 0 <= acc <= 1
    assert loss1 < loss0 - 0.2, (loss0, loss1)


def test_evaluate_ptb_returns_acc_and_loss_without_changing_the_model(corpus):
    data = ndl.data.batchify(corpus.test, 2, DEVICE, "float32")
    model = language_model(corpus, "lstm")
    before = params_of(model)
    result = simple_ml.evaluate_ptb(model, data, seq_len=6, device=DEVICE)
    assert isinstance(result, tuple) and len(result) == 2
    acc, loss = result
    assert isinstance(acc, float) and isinstance(loss, float) and 0 <= acc <= 1
    assert abs(loss - np.log(len(corpus.dictionary))) < 2.0  # an untrained model is near uniform
    assert simple_ml.evaluate_ptb(model, data, seq_len=6, device=DEVICE) == result  # seeded, deterministic
    assert not model.training
    for a, b in zip(before, params_of(model)):
        np.testing.assert_array_equal(a, b)


def test_evaluate_ptb_on_a_split_of_one_row_says_what_is_wrong(corpus):
    # It divided by zero (no window at all): a split shorter than two rows of the batch size
    data = ndl.data.batchify(corpus.test[:7], 4, DEVICE, "float32")  # one row of 4 tokens
    model = language_model(corpus, "lstm")
    with pytest.raises(ValueError, match=r"the batchified data has 1 row\(s\) of 4 tokens; at least 2 are needed"):
        simple_ml.evaluate_ptb(model, data, seq_len=6, device=DEVICE)


@pytest.mark.parametrize("seq_model", ["rnn", "lstm"])
def test_epoch_carries_the_recurrent_state_between_windows(corpus, seq_model):
    data = ndl.data.batchify(corpus.train, 4, DEVICE, "float32")[:9]  # windows at rows 0 and 4
    model = language_model(corpus, seq_model)
    acc, loss = simple_ml.evaluate_ptb(model, data, seq_len=4, device=DEVICE)
    loss_fn = ndl.nn.SoftmaxLoss()
    X1, y1 = ndl.data.get_batch(data, 0, 4, device=DEVICE)
    X2, y2 = ndl.data.get_batch(data, 4, 4, device=DEVICE)
    out1, h = model(X1)
    carried = loss_fn(model(X2, h)[0], y2).numpy()
    fresh = loss_fn(model(X2)[0], y2).numpy()
    first = loss_fn(out1, y1).numpy()
    np.testing.assert_allclose(loss, (first + carried) / 2, rtol=1e-5)
    assert abs(carried - fresh) > 1e-4  # the state matters, so the check above tells the two apart


@pytest.mark.parametrize("seq_model", ["rnn", "lstm", "transformer"])
def test_accumulation_matches_the_full_batch(corpus, seq_model):
    """2 micro-batches of 2 columns, gradients summed, give the update of one batch of 4 (two SGD steps)."""
    data = ndl.data.batchify(corpus.train, 4, DEVICE, "float32")[:9]  # windows at rows 0 and 4: two updates
    full, accumulated = language_model(corpus, seq_model), language_model(corpus, seq_model)
    initial = params_of(full)
    result_full = simple_ml.train_ptb(full, data, seq_len=4, lr=0.5, device=DEVICE, progress=False)
    result_acc = simple_ml.train_ptb(accumulated, data, seq_len=4, lr=0.5, device=DEVICE, accumulation_steps=2,
                                     progress=False)
    np.testing.assert_allclose(result_acc, result_full, rtol=1e-5)
    moved = 0
    for a, b, p0 in zip(params_of(accumulated), params_of(full), initial):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)
        moved += not np.allclose(b, p0)
    assert moved >= len(initial) - 1  # the updates did change the model (the transformer's unused positions aside)
    with pytest.raises(ValueError, match="must divide the batch size"):
        simple_ml.train_ptb(full, data, seq_len=4, device=DEVICE, accumulation_steps=3, progress=False)


def test_clip_bounds_the_update_by_the_global_norm(corpus):
    data = ndl.data.batchify(corpus.train, 4, DEVICE, "float32")[:5]  # one window: one update
    lr, clip = 1.0, 0.01
    free, clipped = language_model(corpus, "rnn"), language_model(corpus, "rnn")
    initial = params_of(free)
    simple_ml.train_ptb(free, data, seq_len=4, lr=lr, device=DEVICE, progress=False)
    simple_ml.train_ptb(clipped, data, seq_len=4, lr=lr, clip=clip, device=DEVICE, progress=False)

    def step_norm(model):
        return np.sqrt(sum(((a - b).astype(np.float64) ** 2).sum() for a, b in zip(params_of(model), initial)))

    assert step_norm(free) > 10 * lr * clip
    np.testing.assert_allclose(step_norm(clipped), lr * clip, rtol=1e-3)


def test_use_gc_turns_checkpointing_on_and_keeps_the_numbers(corpus):
    data = ndl.data.batchify(corpus.train, 4, DEVICE, "float32")[:13]
    plain = language_model(corpus, "rnn")
    gc = language_model(corpus, "rnn", use_gc=True, segment_len=2)
    assert gc.gc and all(m.gc and m.checkpoint_policy == ndl.checkpoint.EverySegment(2) for m in gc._children())
    assert not plain.gc
    result_plain = simple_ml.train_ptb(plain, data, seq_len=4, lr=0.5, device=DEVICE, progress=False)
    result_gc = simple_ml.train_ptb(gc, data, seq_len=4, lr=0.5, device=DEVICE, progress=False)
    np.testing.assert_allclose(result_gc, result_plain, rtol=1e-6)
    for a, b in zip(params_of(gc), params_of(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert language_model(corpus, "rnn").enable_gc(segment_len=3).seq_model.gc


def test_unknown_sequence_model_is_rejected(corpus):
    with pytest.raises(ValueError, match="seq_model"):
        language_model(corpus, "gru")


def test_progress_bar_only_when_asked(corpus, capsys):
    pytest.importorskip("tqdm", reason="tqdm is not installed")
    data = ndl.data.batchify(corpus.train, 4, DEVICE, "float32")[:9]
    simple_ml.train_ptb(language_model(corpus, "rnn"), data, seq_len=4, device=DEVICE)  # stderr is not a tty
    assert "epoch 1/1" not in capsys.readouterr().err
    simple_ml.train_ptb(language_model(corpus, "rnn"), data, seq_len=4, device=DEVICE, progress=True)
    assert "epoch 1/1" in capsys.readouterr().err


# ----- the demo and the course's import styles ---------------------------------------------------------------------
def test_train_demo_runs_on_a_small_corpus(tmp_path, capsys):
    from apps import train_demo

    assert train_demo.find_ptb(str(tmp_path)) is None
    folder = train_demo.synthetic_corpus(str(tmp_path / "data" / "ptb"), lines=40)
    assert train_demo.find_ptb(str(tmp_path)) == folder
    losses = train_demo.main(["--data", folder, "--batches", "3", "--batch-size", "2", "--seq-len", "4",
                              "--eval-batches", "1", "--print-every", "1",
                              "--device", "cpu" if DEVICE == ndl.cpu() else "cpu_numpy"])
    assert len(losses) == 3 and all(np.isfinite(losses))
    out = capsys.readouterr().out
    assert "batch    3  loss" in out and "test: loss" in out


def test_course_import_style():
    import models  # the course: sys.path.append("./apps"); from models import LanguageModel
    import simple_ml as course_simple_ml

    assert models.LanguageModel.__name__ == "LanguageModel"
    assert callable(course_simple_ml.train_ptb) and callable(course_simple_ml.epoch_general_cifar10)


def _python_in(cwd, code, pythonpath):
    """Run `code` in a fresh interpreter in `cwd`, with PYTHONPATH exactly `pythonpath` (no apps/ from pytest)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(pythonpath))
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_course_import_style_in_a_fresh_interpreter():
    """README's notebook way, from the repository root: sys.path.append("./apps"), then `from models import`."""
    code = ('import sys; sys.path.append("./apps")\n'
            "from models import LanguageModel\nfrom simple_ml import train_ptb, evaluate_ptb\nprint('ok')")
    result = _python_in(REPO, code, [str(REPO / "python")])
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_needle_apps_imports_the_repositorys_apps_without_apps_on_sys_path(tmp_path):
    """An installed needle (here: only python/ importable, run from elsewhere) offers apps/ as needle.apps."""
    code = ("import sys, importlib.util\n"
            "assert importlib.util.find_spec('models') is None, 'apps/ should not be importable here'\n"
            "from needle.apps.models import LanguageModel\n"
            "from needle.apps.simple_ml import train_ptb, evaluate_ptb\n"
            "import needle.apps.models as m\nprint(m.__file__)")
    result = _python_in(tmp_path, code, [str(REPO / "python")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert Path(result.stdout.strip()) == REPO / "apps" / "models.py"  # the one copy, not a duplicate


def _readme_notebook_snippet():
    """README's "From a notebook" code block, verbatim."""
    readme = (REPO / "README.md").read_text()
    start = readme.index("```python\n", readme.index("From a notebook, the course way")) + len("```python\n")
    return readme[start:readme.index("```", start)]


def test_readme_notebook_snippet_is_seeded_and_shows_both_calls(tmp_path):
    """Run twice on a tiny corpus, the snippet prints the same (accuracy, loss) pairs: its figures reproduce."""
    snippet = _readme_notebook_snippet()
    assert "np.random.seed(" in snippet and "\ntrain_ptb(" in snippet and "\nevaluate_ptb(" in snippet
    assert snippet.count("# (0.") == 2  # what each call returns, written under it
    corpus = Path(tiny_ptb(tmp_path, num_lines=100))
    (corpus / "test.txt").write_text((corpus / "train.txt").read_text())  # batch 32 x seq_len 20 needs > 640 words
    code = (snippet.replace('"data/ptb"', repr(str(corpus)))
            .replace("\ntrain_ptb(", "\nprint(train_ptb(").replace("\nevaluate_ptb(", "\nprint(evaluate_ptb(")
            .replace("device=ndl.cpu())\n#", "device=ndl.cpu()))\n#"))
    runs = [_python_in(REPO, code, [str(REPO / "python")]) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    printed = runs[0].stdout.strip().splitlines()
    assert len(printed) == 2 and all(line.startswith("(") for line in printed), runs[0].stdout
    assert runs[1].stdout == runs[0].stdout
