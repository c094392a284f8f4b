"""gc.py sample: text from a model gc.py run --save-checkpoint trained, the model's flags and vocabulary read from
the file alone; the text alone on stdout; one seed, one text; bad input one line and exit status 2."""
import numpy as np
import pytest

import needle as ndl

from conftest import GC_TINY, gc_in_process, gc_process, run_gc, tiny_ptb


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(a checkpoint of gc.py's tiny model trained on the tiny corpus, the corpus's folder)."""
    tmp = tmp_path_factory.mktemp("sample")
    data = tiny_ptb(tmp)
    run_gc([*map(str, GC_TINY), "--data", data, "--use-gc", "0", "--json", str(tmp / "run.json"),
            "--save-checkpoint", str(tmp / "lm"), "--no-progress"])
    return str(tmp / "lm"), data


def test_sample_prints_the_prompt_continued_in_the_corpus_words_and_nothing_else(trained):
    checkpoint, data = trained
    code, out, err = gc_process("sample", "--checkpoint", checkpoint, "--prompt", "w3 w7", "--tokens", 12,
                                "--seed", 5)
    assert code == 0 and err == "", err
    words = out.split()
    assert out == " ".join(words) + "\n" and len(words) == 14 and words[:2] == ["w3", "w7"]
    vocabulary = set(ndl.data.Corpus(data).dictionary.idx2word)
    assert set(words) <= vocabulary and "<eos>" in vocabulary


def test_one_seed_one_text_and_the_file_alone_rebuilds_the_model(trained, tmp_path):
    checkpoint, _ = trained
    texts = [gc_in_process("sample", "--checkpoint", checkpoint, "--prompt", "w1", "--tokens", 20, "--seed", s)[1]
             for s in (1, 1, 2, 3)]
    assert texts[0] == texts[1]
    assert len(set(texts)) > 1  # other seeds, other text
    greedy = gc_in_process("sample", "--checkpoint", checkpoint + ".npz", "--prompt", "w1", "--tokens", 20,
                           "--temperature", 0, "--seed", 9)[1]
    assert greedy == gc_in_process("sample", "--checkpoint", checkpoint, "--prompt", "w1", "--tokens", 20,
                                   "--top-k", 1)[1]
    state = ndl.load(checkpoint + ".npz")  # what travels in the file: the model's flags and the words, in id order
    assert state["config"]["embedding_size"] == 8 and state["config"]["vocab"] == len(state["vocabulary"].split(" "))


@pytest.mark.parametrize("flags, message", [
    (["--prompt", "w1 zebra"], "--prompt 'w1 zebra': not in the vocabulary of 31 words: 'zebra'"),
    (["--prompt", "  "], "--prompt is empty"),
    (["--prompt", "w1", "--tokens", "-1"], "--tokens must be 0 or more, got -1"),
    (["--prompt", "w1", "--temperature", "-1"], "--temperature must be a number >= 0"),
    (["--prompt", "w1", "--top-k", "0"], "--top-k must be 1 or more, got 0"),
])
def test_bad_input_is_one_line_and_exit_status_2(trained, flags, message):
    checkpoint, _ = trained
    code, out, err = gc_in_process("sample", "--checkpoint", checkpoint, *flags)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_a_file_without_a_vocabulary_or_none_at_all_is_refused(trained, tmp_path):
    checkpoint, _ = trained
    state = ndl.load(checkpoint + ".npz")
    del state["vocabulary"]
    ndl.save(state, str(tmp_path / "old.npz"))
    code, _, err = gc_in_process("sample", "--checkpoint", tmp_path / "old", "--prompt", "w1")
    assert code == 2 and "holds no vocabulary" in err
    ndl.save({"weights": np.zeros(3)}, str(tmp_path / "other.npz"))
    code, _, err = gc_in_process("sample", "--checkpoint", tmp_path / "other.npz", "--prompt", "w1")
    assert code == 2 and "is not a file gc.py run --save-checkpoint writes" in err
    code, _, err = gc_in_process("sample", "--checkpoint", tmp_path / "missing", "--prompt", "w1")
    assert code == 2 and f"there is no file {tmp_path / 'missing.npz'}" in err
