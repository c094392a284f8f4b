"""LanguageModel.generate and LanguageModel.perplexity (apps/models.py): text from a language model, and the
probability it gives a text, for the Transformer, the LSTM and the RNN.

Runs on the C++ cpu() backend when it is built, else on the NumPy reference device.
"""
import numpy as np
import pytest

import needle as ndl
from needle import nn
from apps.models import LanguageModel

DEVICE = ndl.cpu() if ndl.cpu().enabled() else ndl.cpu_numpy()
VOCAB = 11
SEQ_MODELS = ["transformer", "lstm", "rnn"]


def language_model(seq_model, seq_len=4, seed=0):
    np.random.seed(seed)
    return LanguageModel(8, VOCAB, 8, num_layers=2, seq_model=seq_model, seq_len=seq_len, device=DEVICE,
                         num_head=2, dim_head=4)


def logits_of(model, ids):
    """The model's logits after each word of `ids`, read in one forward pass (float64, (len, VOCAB))."""
    X = ndl.Tensor(np.array(ids, dtype=np.float32).reshape(-1, 1), device=DEVICE, requires_grad=False)
    return model(X)[0].numpy().astype(np.float64)


@pytest.mark.parametrize("seq_model", SEQ_MODELS)
def test_one_seed_gives_one_text_and_leaves_numpys_generator_alone(seq_model):
    model = language_model(seq_model)
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    first = model.generate([1, 2, 3], 12, seed=7)
    assert np.array_equal(np.random.get_state()[1], before)
    assert model.generate([1, 2, 3], 12, seed=7) == first
    assert first[:3] == [1, 2, 3] and len(first) == 15
    assert all(isinstance(i, int) and 0 <= i < VOCAB for i in first)
    others = {tuple(model.generate([1, 2, 3], 12, seed=s)) for s in range(5)}
    assert len(others) > 1  # the seed chooses the text


@pytest.mark.parametrize("seq_model", SEQ_MODELS)
def test_greedy_generation_follows_the_models_own_prediction(seq_model):
    """temperature 0 picks the argmax of the logits after the words so far: for the LSTM and the RNN, read in one
    pass over the whole text (so carrying the state word by word is the same); for the Transformer, over the
    last seq_len words (its window)."""
    model = language_model(seq_model, seq_len=4)
    ids = model.generate([5, 1], 9, temperature=0)
    for n in range(2, len(ids)):
        context = ids[max(0, n - 4):n] if seq_model == "transformer" else ids[:n]
        assert ids[n] == int(np.argmax(logits_of(model, context)[-1])), n
    assert model.generate([5, 1], 9, top_k=1, seed=3) == ids  # the one likeliest word, whatever the draw


def test_top_k_draws_only_among_the_k_likeliest():
    model = language_model("lstm")
    ranked = np.argsort(-logits_of(model, [4])[-1])
    drawn = {model.generate([4], 1, temperature=5.0, top_k=2, seed=s)[-1] for s in range(40)}
    assert drawn == set(ranked[:2].tolist())


@pytest.mark.parametrize("seq_model", SEQ_MODELS)
def test_perplexity_is_the_loss_of_the_same_predictions(seq_model):
    model = language_model(seq_model, seq_len=8)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    X = ndl.Tensor(np.array(ids[:-1], dtype=np.float32).reshape(-1, 1), device=DEVICE, requires_grad=False)
    y = ndl.Tensor(np.array(ids[1:], dtype=np.float32), device=DEVICE, requires_grad=False)
    loss = float(nn.SoftmaxLoss()(model(X)[0], y).numpy())
    assert model.perplexity(ids) == pytest.approx(np.exp(loss), rel=1e-5)


def test_generate_restores_the_training_mode_and_keeps_no_graph():
    model = language_model("transformer")
    model.train()
    model.generate([1], 3, seed=0)
    assert model.training and all(m.training for m in model._children())
    model.eval()
    model.perplexity([1, 2, 3])
    assert not model.training


@pytest.mark.parametrize("call, message", [
    (lambda m: m.generate([], 3), r"at least 1 word id\(s\) in \[0, 11\), got \[\]"),
    (lambda m: m.generate([1, 11], 3), r"in \[0, 11\), got \[1, 11\]"),
    (lambda m: m.generate([1, -2], 3), r"got \[1, -2\]"),
    (lambda m: m.generate([1.5], 3), r"got \[1.5\]"),
    (lambda m: m.generate([1], -1), "max_new_tokens must be a whole number >= 0, got -1"),
    (lambda m: m.generate([1], 3, temperature=-0.5), "temperature must be a finite number >= 0, got -0.5"),
    (lambda m: m.generate([1], 3, top_k=0), "top_k must be None or a whole number >= 1, got 0"),
    (lambda m: m.perplexity([1]), r"perplexity: tokens must be at least 2 word id\(s\)"),
])
def test_bad_input_is_one_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call(language_model("lstm"))
