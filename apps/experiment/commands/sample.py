"""gc.py sample: text from a model that `gc.py run --save-checkpoint FILE` trained.

    python gc.py run --use-gc 0 --epochs 3 --save-checkpoint results/lm
    python gc.py sample --checkpoint results/lm --prompt "the company said" --tokens 40 --seed 1

The file holds all it takes: the model's flags (resume.RESUME_MUST_MATCH), its parameters and the vocabulary's
words. The model continues the prompt word by word (LanguageModel.generate: a window of the last --seq-len words,
each next word drawn at --temperature among the --top-k likeliest); stdout gets the text alone, the prompt and its
continuation, each word joined by one space (`<eos>`, PTB's end of a sentence, included). One --seed, one text.
"""
import math
import os
from dataclasses import replace

import needle as ndl
from needle.data import Dictionary

from ..console import fail
from ..outputs import checkpoint_file
from ..setup import build_model, pick_device

# The saved flags that shape the model (the rest of a run's flags do not matter to its forward pass).
MODEL_FLAGS = ("embedding_size", "hidden_size", "num_layers", "num_head", "seq_len", "dropout", "activation",
               "activation_bits", "precision")
WHOLE_MODEL = (None, "dp", "zero1", "zero2")  # --parallel runs whose every rank's file holds the whole model


def validate(config):
    """sample's flags, before the file is read."""
    if config.tokens < 0:
        fail(f"--tokens must be 0 or more, got {config.tokens}")
    if not (math.isfinite(config.temperature) and config.temperature >= 0):
        fail(f"--temperature must be a number >= 0 (0: always the likeliest word), got {config.temperature:g}")
    if config.top_k is not None and config.top_k < 1:
        fail(f"--top-k must be 1 or more, got {config.top_k}")
    if config.seed is not None and not 0 <= config.seed < 2**32:
        fail(f"--seed must be in [0, 2**32), got {config.seed}")
    if not os.path.isfile(checkpoint_file(config.checkpoint)):
        fail(f"--checkpoint {config.checkpoint}: there is no file {checkpoint_file(config.checkpoint)} (write one with "
             f"python gc.py run --use-gc 0 --save-checkpoint {config.checkpoint})")


def main(config):
    """Print the prompt and its continuation, the text alone."""
    state = read_checkpoint(config.checkpoint)
    dictionary = Dictionary()
    for word in state["vocabulary"].split(" "):
        dictionary.add_word(word)
    try:
        prompt = dictionary.encode(config.prompt)
    except ValueError as err:
        fail(f"--prompt {config.prompt!r}: {err}")
    if not prompt:
        fail("--prompt is empty: give the words to start from (PTB's sentences start after <eos>)")
    model = saved_model(config, state, len(dictionary))
    ids = model.generate(prompt, config.tokens, temperature=config.temperature, top_k=config.top_k, seed=config.seed)
    print(dictionary.decode(ids))


def read_checkpoint(path):
    """The state a --save-checkpoint FILE holds, with its vocabulary (one line and exit 2 otherwise)."""
    path = checkpoint_file(path)
    try:
        state = ndl.load(path)
    except (OSError, ValueError) as err:
        fail(f"--checkpoint {path}: {err}")
    if not isinstance(state, dict) or not all(key in state for key in ("config", "model")):
        fail(f"--checkpoint {path} is not a file gc.py run --save-checkpoint writes")
    if not isinstance(state.get("vocabulary"), str):
        fail(f"--checkpoint {path} holds no vocabulary (it was saved before gc.py kept one): train it again with "
             f"gc.py run --save-checkpoint")
    parallel = state["config"].get("parallel")
    if parallel not in WHOLE_MODEL:
        fail(f"--checkpoint {path} holds one rank's part of a --parallel {parallel} model, not the whole model")
    return state


def saved_model(config, state, vocab):
    """The LanguageModel the file's flags describe, with its saved parameters, on --device."""
    saved = state["config"]
    if saved.get("vocab") != vocab:
        fail(f"--checkpoint: its model has {saved.get('vocab')} words and its vocabulary {vocab}: the file is damaged")
    model_config = replace(config, **{name: saved[name] for name in MODEL_FLAGS}, head_init_scale=1.0,
                           compress_bits=None, seed=0)
    model = build_model(model_config, vocab, pick_device(config.device), "off")
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, ValueError, KeyError, TypeError) as err:
        fail(f"--checkpoint: its parameters do not fit the model its flags describe: {err}")
    return model
