"""needle.data: loaders on tiny files written here, DataLoader batching, transforms, and the download checks.

Nothing here reads the real data sets or touches the network: every file is made in tmp_path, in the official
layout (gzip idx for MNIST, Python-2 pickles for CIFAR-10, text lines for PTB), and `download.fetch` is replaced.
"""
import gzip
import hashlib
import io
import os
import pickle
import re
import struct
import tarfile

import numpy as np
import pytest

import needle as ndl
from needle.data import download


# ----- DataLoader ------------------------------------------------------------------------------------------------
def test_dataloader_consecutive_batches_keep_the_short_last_one():
    X = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
    y = np.arange(7, dtype=np.float32)
    loader = ndl.data.DataLoader(ndl.data.NDArrayDataset(X, y), batch_size=3)
    batches = list(loader)
    assert len(loader) == len(batches) == 3
    assert [tuple(b[0].shape) for b in batches] == [(3, 3), (3, 3), (1, 3)]
    np.testing.assert_array_equal(np.concatenate([b[0].numpy() for b in batches]), X)
    np.testing.assert_array_equal(np.concatenate([b[1].numpy() for b in batches]), y)
    assert all(isinstance(t, ndl.Tensor) and not t.requires_grad for b in batches for t in b)


def test_dataloader_batch_of_one_keeps_the_batch_axis():
    X = np.random.default_rng(0).random((5, 10)).astype(np.float32)
    dataset = ndl.data.NDArrayDataset(X)
    for i, (batch,) in enumerate(ndl.data.DataLoader(dataset, batch_size=1)):
        np.testing.assert_array_equal(batch.numpy(), dataset[i:i + 1][0])
        assert batch.shape == (1, 10)


def test_dataloader_shuffle_draws_one_permutation_per_iter():
    n, batch_size = 10, 4
    dataset = ndl.data.NDArrayDataset(np.arange(n, dtype=np.float32))
    loader = ndl.data.DataLoader(dataset, batch_size=batch_size, shuffle=True)
    np.random.seed(3)
    expected = [np.random.permutation(n), np.random.permutation(n)]
    np.random.seed(3)
    first = iter(loader)
    np.random.rand()  # RNG use after iter() must not change this epoch's order: it was drawn at iter()
    epoch1 = np.concatenate([b[0].numpy() for b in first])
    np.random.seed(3)
    iter(loader)
    epoch2 = np.concatenate([b[0].numpy() for b in iter(loader)])
    np.testing.assert_array_equal(epoch1, expected[0])
    np.testing.assert_array_equal(epoch2, expected[1])
    assert not np.array_equal(epoch1, epoch2)


def test_dataloader_rejects_a_zero_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        ndl.data.DataLoader(ndl.data.NDArrayDataset(np.zeros(3)), batch_size=0)


def test_ndarray_dataset_checks_lengths_and_slices():
    dataset = ndl.data.NDArrayDataset(np.arange(6).reshape(3, 2), np.arange(3))
    x, y = dataset[1:3]
    np.testing.assert_array_equal(x, [[2, 3], [4, 5]])
    np.testing.assert_array_equal(y, [1, 2])
    assert len(dataset) == 3
    with pytest.raises(ValueError, match="first axes differ"):
        ndl.data.NDArrayDataset(np.zeros(3), np.zeros(4))


# ----- transforms ------------------------------------------------------------------------------------------------
def test_flip_horizontal_draws_once_and_flips_the_width_axis():
    img = np.arange(2 * 3 * 2).reshape(2, 3, 2)
    np.random.seed(0)
    draws = np.random.rand(4)
    np.random.seed(0)
    flip = ndl.data.RandomFlipHorizontal(p=0.5)
    for draw in draws:
        out = flip(img)
        np.testing.assert_array_equal(out, img[:, ::-1, :] if draw < 0.5 else img)
    assert np.random.rand() == np.random.RandomState(0).rand(5)[4]  # exactly one draw per call
    np.testing.assert_array_equal(ndl.data.RandomFlipHorizontal(p=1.0)(img)[:, 0], img[:, 2])


def test_random_crop_shifts_with_zero_fill():
    img = np.arange(1, 5 * 6 * 2 + 1, dtype=np.float32).reshape(5, 6, 2)
    crop = ndl.data.RandomCrop(padding=2)
    for seed in range(6):
        np.random.seed(seed)
        sx, sy = np.random.randint(-2, 3, size=2)
        np.random.seed(seed)
        out = crop(img)
        padded = np.zeros((9, 10, 2), dtype=np.float32)
        padded[2:7, 2:8] = img
        np.testing.assert_array_equal(out, padded[2 + sx:7 + sx, 2 + sy:8 + sy])
        assert out.shape == img.shape
    np.random.seed(0)
    np.testing.assert_array_equal(ndl.data.RandomCrop(padding=0)(img), img)


def test_random_crop_moves_content_by_the_drawn_shift():
    img = np.zeros((4, 4, 1))
    img[1, 1, 0] = 1.0
    np.random.seed(1)
    sx, sy = np.random.randint(-1, 2, size=2)
    np.random.seed(1)
    out = ndl.data.RandomCrop(padding=1)(img)
    assert out.sum() == 1.0 and out[1 - sx, 1 - sy, 0] == 1.0


# ----- MNIST -----------------------------------------------------------------------------------------------------
def write_mnist(tmp_path, images, labels, image_magic=2051):
    n = len(images)
    image_path, label_path = tmp_path / "images-idx3-ubyte.gz", tmp_path / "labels-idx1-ubyte.gz"
    with gzip.open(image_path, "wb") as f:
        f.write(struct.pack(">iiii", image_magic, n, 28, 28) + images.astype(np.uint8).tobytes())
    with gzip.open(label_path, "wb") as f:
        f.write(struct.pack(">ii", 2049, n) + labels.astype(np.uint8).tobytes())
    return str(image_path), str(label_path)


@pytest.fixture
def mnist_files(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 28, 28))
    images[0, 0, 0], images[0, 0, 1] = 0, 255
    labels = np.array([3, 1, 4, 1, 5])
    return write_mnist(tmp_path, images, labels), images, labels


def test_mnist_reads_idx_files(mnist_files):
    (image_path, label_path), images, labels = mnist_files
    dataset = ndl.data.MNISTDataset(image_path, label_path)
    assert len(dataset) == 5
    x, y = dataset[2]
    assert x.shape == (784,) and x.dtype == np.float32 and y == 4
    np.testing.assert_allclose(x, images[2].reshape(-1) / 255.0, rtol=1e-6)
    X, Y = dataset[1:4]
    assert X.shape == (3, 784)
    np.testing.assert_array_equal(Y, labels[1:4])
    assert dataset[0][0].min() == 0.0 and dataset[0][0].max() == 1.0


def test_mnist_transforms_see_hwc_images(mnist_files):
    (image_path, label_path), images, _ = mnist_files
    dataset = ndl.data.MNISTDataset(image_path, label_path, transforms=[ndl.data.RandomFlipHorizontal(p=1.0)])
    x, _ = dataset[0]
    np.testing.assert_allclose(x.reshape(28, 28), images[0][:, ::-1] / 255.0, rtol=1e-6)
    X, _ = dataset[0:2]
    np.testing.assert_allclose(X[1].reshape(28, 28), images[1][:, ::-1] / 255.0, rtol=1e-6)


def test_mnist_loader_batches(mnist_files):
    (image_path, label_path), images, labels = mnist_files
    loader = ndl.data.DataLoader(ndl.data.MNISTDataset(image_path, label_path), batch_size=2)
    X, y = next(iter(loader))
    assert X.shape == (2, 784) and y.shape == (2,)
    np.testing.assert_array_equal(y.numpy(), labels[:2])


def test_mnist_rejects_a_wrong_magic_number(tmp_path):
    image_path, label_path = write_mnist(tmp_path, np.zeros((1, 28, 28)), np.zeros(1), image_magic=1234)
    with pytest.raises(ValueError, match="magic number 1234, expected 2051"):
        ndl.data.MNISTDataset(image_path, label_path)


def test_mnist_missing_file_names_path_and_command(tmp_path):
    path = str(tmp_path / "train-images-idx3-ubyte.gz")
    with pytest.raises(FileNotFoundError) as info:
        ndl.data.MNISTDataset(path, path)
    assert f"{path} not found" in str(info.value)
    assert f"python -m needle.data.download mnist --dir {tmp_path}" in str(info.value)


# ----- CIFAR-10 ----------------------------------------------------------------------------------------------------
class Py2Pickler(pickle._Pickler):
    """Writes pickles as Python 2 did for the official batches: str and bytes as 8-bit strings (protocol 2)."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_bytes(self, obj):
        n = len(obj)
        self.write((pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n)) + obj)
        self.memoize(obj)

    def save_str(self, obj):
        self.save_bytes(obj.encode("latin-1"))

    dispatch[bytes] = save_bytes
    dispatch[str] = save_str


def official_pickle(obj):
    buf = io.BytesIO()
    Py2Pickler(buf, protocol=2).dump(obj)
    # The official files were written by NumPy 1.x, whose module was numpy.core.
    return buf.getvalue().replace(b"numpy._core.multiarray", b"numpy.core.multiarray")


def write_cifar(folder, sizes, rng):
    os.makedirs(folder, exist_ok=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    batches = {}
    for name, n in zip(names, sizes):
        data = rng.integers(0, 256, size=(n, 3072)).astype(np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=n)]
        batches[name] = (data, labels)
        content = {b"batch_label": b"training batch", b"labels": labels, b"data": data,
                   b"filenames": [b"img_%d.png" % i for i in range(n)]}
        with open(os.path.join(folder, name), "wb") as f:
            f.write(official_pickle(content))
    return batches


def test_cifar10_reads_official_layout(tmp_path):
    folder = str(tmp_path / "cifar-10-batches-py")
    batches = write_cifar(folder, [2, 1, 2, 1, 2, 3], np.random.default_rng(0))
    train = ndl.data.CIFAR10Dataset(folder, train=True)
    test = ndl.data.CIFAR10Dataset(folder, train=False)
    assert len(train) == 8 and len(test) == 3
    x, y = train[2]  # the first image of data_batch_2
    assert isinstance(x, np.ndarray) and x.shape == (3, 32, 32) and x.dtype == np.float32
    data, labels = batches["data_batch_2"]
    np.testing.assert_allclose(x, data[0].reshape(3, 32, 32) / 255.0, rtol=1e-6)
    assert y == labels[0]
    assert 0.0 <= test[0][0].min() and test[0][0].max() <= 1.0
    X, Y = next(iter(ndl.data.DataLoader(test, batch_size=3)))
    assert X.shape == (3, 3, 32, 32) and X.dtype == "float32"
    np.testing.assert_array_equal(Y.numpy(), batches["test_batch"][1])


def test_cifar10_transforms_see_hwc(tmp_path):
    folder = str(tmp_path / "cifar-10-batches-py")
    batches = write_cifar(folder, [1, 1, 1, 1, 1, 1], np.random.default_rng(1))
    dataset = ndl.data.CIFAR10Dataset(folder, train=False, transforms=[ndl.data.RandomFlipHorizontal(p=1.0)])
    x, _ = dataset[0]
    expected = batches["test_batch"][0][0].reshape(3, 32, 32)[:, :, ::-1] / 255.0  # width is the last axis of CHW
    np.testing.assert_allclose(x, expected, rtol=1e-6)


def test_cifar10_missing_batch_names_path_and_command(tmp_path):
    folder = str(tmp_path / "cifar-10-batches-py")
    with pytest.raises(FileNotFoundError) as info:
        ndl.data.CIFAR10Dataset(folder, train=True)
    message = str(info.value)
    assert os.path.join(folder, "data_batch_1") in message
    assert f"python -m needle.data.download cifar10 --dir {tmp_path}" in message


def test_restricted_unpickler_refuses_other_globals(tmp_path):
    # A pickle that would call os.system("echo pwned") on load; it must be refused before anything is called.
    evil = b"\x80\x02cos\nsystem\nq\x00X\x0a\x00\x00\x00echo pwnedq\x01\x85q\x02Rq\x03."
    path = tmp_path / "data_batch_1"
    path.write_bytes(evil)
    with pytest.raises(pickle.UnpicklingError, match="os.system"):
        ndl.data.load_cifar_batch(str(path))
    eval_pickle = b"\x80\x02cbuiltins\neval\nX\x04\x00\x00\x001+1\x85R."
    path.write_bytes(eval_pickle)
    with pytest.raises(pickle.UnpicklingError, match="builtins.eval"):
        ndl.data.load_cifar_batch(str(path))


def test_restricted_unpickler_accepts_both_numpy_module_names():
    for module in (b"numpy.core.multiarray", b"numpy._core.multiarray"):
        data = official_pickle({b"data": np.arange(4, dtype=np.uint8)})
        data = data.replace(b"numpy.core.multiarray", module)
        loaded = ndl.data.RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()
        np.testing.assert_array_equal(loaded[b"data"], np.arange(4))


# ----- Penn Treebank -------------------------------------------------------------------------------------------------
@pytest.fixture
def ptb_dir(tmp_path):
    base = tmp_path / "ptb"
    base.mkdir()
    (base / "train.txt").write_text(" the cat sat \n the dog sat on the mat \n\n a cat \n")
    (base / "test.txt").write_text(" the bird sat \n")
    return base


def test_corpus_tokenizes_with_eos(ptb_dir):
    corpus = ndl.data.Corpus(str(ptb_dir))
    words = corpus.dictionary.idx2word
    assert words[:4] == ["the", "cat", "sat", "<eos>"]
    assert [words[i] for i in corpus.train] == ("the cat sat <eos> the dog sat on the mat <eos> <eos> a cat <eos>"
                                                .split())
    assert [words[i] for i in corpus.test] == ["the", "bird", "sat", "<eos>"]
    assert len(corpus.dictionary) == 9 and corpus.dictionary.word2idx["bird"] == 8
    assert corpus.dictionary.add_word("cat") == 1 and len(corpus.dictionary) == 9
    short = ndl.data.Corpus(str(ptb_dir), max_lines=1)
    assert len(short.train) == 4 and len(short.test) == 4


def test_encode_and_decode_map_words_both_ways(ptb_dir):
    corpus = ndl.data.Corpus(str(ptb_dir))
    ids = corpus.encode("the cat sat on the mat")
    assert ids == [0, 1, 2, 5, 0, 6]
    assert corpus.decode(ids) == "the cat sat on the mat"
    # a line break is <eos>, as the files are read; decode keeps it as a word, one space between all
    assert corpus.encode("a cat\n the dog\n") == [corpus.dictionary.word2idx[w] for w in
                                                   "a cat <eos> the dog <eos>".split()]
    assert corpus.decode(corpus.train) == "the cat sat <eos> the dog sat on the mat <eos> <eos> a cat <eos>"
    assert corpus.decode(np.array([1.0, 3.0], dtype=np.float32)) == "cat <eos>"  # batchify's float ids


def test_encode_and_decode_refuse_what_the_vocabulary_lacks(ptb_dir):
    corpus = ndl.data.Corpus(str(ptb_dir))
    with pytest.raises(ValueError, match=r"not in the vocabulary of 9 words: 'Cat', 'zebra'"):
        corpus.encode("the zebra sat Cat")
    for bad in (9, -1, 1.5):
        with pytest.raises(ValueError, match=r"is not a word id of this vocabulary \(0..8\)"):
            corpus.decode([0, bad])


def test_corpus_missing_file_names_path_and_command(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        ndl.data.Corpus(str(tmp_path / "ptb"))
    message = str(info.value)
    assert os.path.join(str(tmp_path / "ptb"), "train.txt") + " not found" in message
    assert f"python -m needle.data.download ptb --dir {tmp_path}" in message


def test_batchify_is_column_major_and_trims():
    data = list(range(11))
    batches = ndl.data.batchify(data, batch_size=3, device=None, dtype="float32")
    assert batches.shape == (3, 3) and batches.dtype == np.float32
    np.testing.assert_array_equal(batches, [[0, 3, 6], [1, 4, 7], [2, 5, 8]])
    with pytest.raises(ValueError, match="fewer than batch_size"):
        ndl.data.batchify([1, 2], batch_size=3, device=None, dtype="float32")


def test_get_batch_inputs_and_next_token_targets():
    batches = ndl.data.batchify(list(range(20)), batch_size=2, device=None, dtype="float32")  # (10, 2)
    X, y = ndl.data.get_batch(batches, 1, 4, device=ndl.cpu_numpy())
    assert X.shape == (4, 2) and y.shape == (8,)
    assert not X.requires_grad and not y.requires_grad and X.device == ndl.cpu_numpy()
    np.testing.assert_array_equal(X.numpy(), [[1, 11], [2, 12], [3, 13], [4, 14]])
    np.testing.assert_array_equal(y.numpy(), [2, 12, 3, 13, 4, 14, 5, 15])
    X, y = ndl.data.get_batch(batches, 7, 4)  # only 2 rows left with a target
    assert X.shape == (2, 2) and y.shape == (4,)
    with pytest.raises(IndexError):
        ndl.data.get_batch(batches, 9, 4)


# ----- download: the verification logic, offline ---------------------------------------------------------------------
def remote_for(content, path, url="https://example.org/file", **kw):
    return download.RemoteFile(url, path, len(content), sha256=hashlib.sha256(content).hexdigest(), **kw)


@pytest.fixture
def served(monkeypatch):
    """Replace the network: `served[url] = bytes` is what fetch writes; the urls fetched are recorded."""
    content, fetched = {}, []

    def fake_fetch(url, path):
        fetched.append(url)
        with open(path, "wb") as f:
            f.write(content[url])

    monkeypatch.setattr(download, "fetch", fake_fetch)
    content["fetched"] = fetched
    return content


def test_download_keeps_a_file_whose_hash_matches(tmp_path, served, monkeypatch):
    good = b"the cat sat\n"
    served["https://example.org/file"] = good
    monkeypatch.setitem(download.DATASETS, "ptb", (remote_for(good, "ptb/train.txt"),))
    paths = download.download("ptb", str(tmp_path), log=lambda *_: None)
    assert paths == [str(tmp_path / "ptb" / "train.txt")]
    assert (tmp_path / "ptb" / "train.txt").read_bytes() == good
    assert not (tmp_path / "ptb" / "train.txt.part").exists()
    download.download("ptb", str(tmp_path), log=lambda *_: None)  # present and verified: not fetched again
    assert served["fetched"] == ["https://example.org/file"]


def test_download_deletes_a_file_whose_hash_differs(tmp_path, served, monkeypatch):
    served["https://example.org/file"] = b"tampered!!!!"
    monkeypatch.setitem(download.DATASETS, "ptb", (remote_for(b"the cat sat\n", "ptb/train.txt"),))
    with pytest.raises(download.ChecksumError, match="checksum mismatch .*SHA256.*deleted"):
        download.download("ptb", str(tmp_path), log=lambda *_: None)
    assert not (tmp_path / "ptb" / "train.txt").exists()
    assert not (tmp_path / "ptb" / "train.txt.part").exists()


def test_download_checks_size_and_md5_fallback(tmp_path, served, monkeypatch):
    content = b"0123456789"
    served["https://example.org/file"] = content + b"!"
    md5_remote = download.RemoteFile("https://example.org/file", "x.gz", len(content),
                                     md5=hashlib.md5(content).hexdigest())
    monkeypatch.setitem(download.DATASETS, "mnist", (md5_remote,))
    with pytest.raises(download.ChecksumError, match="size 11 bytes, expected 10"):
        download.download("mnist", str(tmp_path), log=lambda *_: None)
    served["https://example.org/file"] = content
    download.download("mnist", str(tmp_path), log=lambda *_: None)
    assert (tmp_path / "x.gz").read_bytes() == content
    served["https://example.org/file"] = b"9876543210"  # right size, wrong MD5
    (tmp_path / "x.gz").unlink()
    with pytest.raises(download.ChecksumError, match="MD5"):
        download.download("mnist", str(tmp_path), log=lambda *_: None)


def test_download_replaces_a_corrupt_existing_file(tmp_path, served, monkeypatch):
    good = b"good bytes"
    served["https://example.org/file"] = good
    (tmp_path / "f.txt").write_bytes(b"bad bytes!")
    monkeypatch.setitem(download.DATASETS, "ptb", (remote_for(good, "f.txt"),))
    download.download("ptb", str(tmp_path), log=lambda *_: None)
    assert (tmp_path / "f.txt").read_bytes() == good


def make_tar(members):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_download_cifar10_verifies_then_extracts(tmp_path, served, monkeypatch):
    rng = np.random.default_rng(2)
    members = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        members[f"cifar-10-batches-py/{name}"] = official_pickle(
            {b"data": rng.integers(0, 256, size=(1, 3072)).astype(np.uint8), b"labels": [7]})
    archive = make_tar(members)
    served["https://example.org/cifar.tar.gz"] = archive
    monkeypatch.setitem(download.DATASETS, "cifar10",
                        (remote_for(archive, "cifar-10-python.tar.gz", url="https://example.org/cifar.tar.gz"),))
    paths = download.download("cifar10", str(tmp_path), log=lambda *_: None)
    assert paths == [str(tmp_path / "cifar-10-batches-py")]
    dataset = ndl.data.CIFAR10Dataset(paths[0], train=True)
    assert len(dataset) == 5 and dataset[0][1] == 7


def test_download_refuses_archive_members_outside_the_folder(tmp_path, served, monkeypatch):
    archive = make_tar({"cifar-10-batches-py/data_batch_1": b"x", "../escape.txt": b"y"})
    served["https://example.org/cifar.tar.gz"] = archive
    monkeypatch.setitem(download.DATASETS, "cifar10",
                        (remote_for(archive, "cifar-10-python.tar.gz", url="https://example.org/cifar.tar.gz"),))
    with pytest.raises(ValueError, match="unexpected member '../escape.txt'"):
        download.download("cifar10", str(tmp_path), log=lambda *_: None)
    assert not (tmp_path.parent / "escape.txt").exists()


def test_download_cli_reports_a_mismatch(tmp_path, served, monkeypatch, capsys):
    served["https://example.org/file"] = b"tampered"
    monkeypatch.setitem(download.DATASETS, "ptb", (remote_for(b"original", "ptb/test.txt"),))
    assert download.main(["ptb", "--dir", str(tmp_path)]) == 1
    assert "checksum mismatch" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown data set"):
        download.download("imagenet", str(tmp_path))


def test_download_table_is_complete():
    expected_paths = {
        "ptb": {"ptb/train.txt", "ptb/valid.txt", "ptb/test.txt"},
        "mnist": {f"{s}-{k}-ubyte.gz" for s in ("train", "t10k") for k in ("images-idx3", "labels-idx1")},
        "cifar10": {"cifar-10-python.tar.gz"},
    }
    for name, remotes in download.DATASETS.items():
        assert {r.path for r in remotes} == expected_paths[name]
        for r in remotes:
            algorithm, digest = r.digest
            assert r.url.startswith("https://") and r.size > 0
            assert len(digest) == {"sha256": 64, "md5": 32}[algorithm] and int(digest, 16) >= 0


# ----- corrupt files: a clear error naming the file, never garbage, a NumPy reshape error or a crash -------------
def write_gz(path, content):
    with gzip.open(path, "wb") as f:
        f.write(content)
    return str(path)


def test_mnist_rejects_an_image_file_shorter_than_its_header_says(tmp_path):
    image_path, label_path = write_mnist(tmp_path, np.zeros((3, 28, 28)), np.zeros(3))
    with gzip.open(image_path, "rb") as f:
        content = f.read()
    write_gz(image_path, content[:-28 * 28])  # the last image is missing
    expected = f"{image_path}: the header gives sizes [3, 28, 28], i.e. 2352 bytes of data, but the file has 1568"
    with pytest.raises(ValueError, match=re.escape(expected + " after the header (truncated)")):
        ndl.data.MNISTDataset(image_path, label_path)


def test_mnist_rejects_a_label_file_longer_than_its_header_says(tmp_path):
    image_path, label_path = write_mnist(tmp_path, np.zeros((2, 28, 28)), np.zeros(2))
    write_gz(label_path, struct.pack(">ii", 2049, 2) + bytes(5))
    expected = f"{label_path}: the header gives sizes [2], i.e. 2 bytes of data, but the file has 5 after the header"
    with pytest.raises(ValueError, match=re.escape(expected + " (too long)")):
        ndl.data.parse_mnist(image_path, label_path)


def test_mnist_rejects_image_and_label_counts_that_differ(tmp_path):
    image_path, label_path = write_mnist(tmp_path, np.zeros((3, 28, 28)), np.zeros(3))
    write_gz(label_path, struct.pack(">ii", 2049, 2) + bytes(2))  # a valid file of 2 labels
    with pytest.raises(ValueError, match=re.escape(f"{image_path} holds 3 images but {label_path} holds 2 labels")):
        ndl.data.MNISTDataset(image_path, label_path)


def test_mnist_rejects_a_file_shorter_than_the_header(tmp_path):
    image_path, label_path = write_mnist(tmp_path, np.zeros((1, 28, 28)), np.zeros(1))
    write_gz(image_path, struct.pack(">ii", 2051, 1))  # magic and count, no rows/cols
    with pytest.raises(ValueError, match=re.escape(f"{image_path}: 8 bytes, shorter than the 16-byte idx header")):
        ndl.data.parse_mnist(image_path, label_path)


def test_mnist_rejects_sizes_below_one_in_the_header(tmp_path):
    image_path, label_path = write_mnist(tmp_path, np.zeros((1, 28, 28)), np.zeros(1))
    for sizes in [[-1, 28, 28], [1, 0, 28]]:
        write_gz(image_path, struct.pack(">iiii", 2051, *sizes))
        expected = f"{image_path}: the header gives sizes {sizes}; each must be at least 1"
        with pytest.raises(ValueError, match=re.escape(expected)):
            ndl.data.parse_mnist(image_path, label_path)


def test_mnist_rejects_a_file_that_is_not_complete_gzip(tmp_path):
    image_path, label_path = write_mnist(tmp_path, np.zeros((1, 28, 28)), np.zeros(1))
    with open(image_path, "rb") as f:
        compressed = f.read()
    for content in [b"plain bytes, not gzip", compressed[:len(compressed) // 2]]:
        with open(image_path, "wb") as f:
            f.write(content)
        with pytest.raises(ValueError, match=re.escape(f"{image_path}: not a complete gzip file")):
            ndl.data.parse_mnist(image_path, label_path)


def test_mnist_images_need_not_be_square(tmp_path):
    # The header's rows and cols give the H x W that transforms see.
    image_path, label_path = str(tmp_path / "images.gz"), str(tmp_path / "labels.gz")
    images = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    write_gz(image_path, struct.pack(">iiii", 2051, 2, 3, 4) + images.astype(np.uint8).tobytes())
    write_gz(label_path, struct.pack(">ii", 2049, 2) + bytes([7, 1]))
    dataset = ndl.data.MNISTDataset(image_path, label_path, transforms=[ndl.data.RandomFlipHorizontal(p=1.0)])
    x, y = dataset[1]
    assert x.shape == (12,) and y == 1
    np.testing.assert_allclose(x.reshape(3, 4), images[1][:, ::-1] / 255.0, rtol=1e-6)


def write_cifar_test_batch(tmp_path, content):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir(exist_ok=True)
    (folder / "test_batch").write_bytes(official_pickle(content))
    return str(folder), os.path.join(str(folder), "test_batch")


def test_cifar10_rejects_image_and_label_counts_that_differ(tmp_path):
    data = np.zeros((3, 3072), dtype=np.uint8)
    folder, path = write_cifar_test_batch(tmp_path, {b"data": data, b"labels": [1, 2]})
    with pytest.raises(ValueError, match=re.escape(f"{path}: 3 images but 2 labels")):
        ndl.data.CIFAR10Dataset(folder, train=False)


def test_cifar10_rejects_labels_outside_0_to_9(tmp_path):
    data = np.zeros((3, 3072), dtype=np.uint8)
    for labels, bad in [([1, 10, 2], 10), ([-1, 0, 0], -1)]:
        folder, path = write_cifar_test_batch(tmp_path, {b"data": data, b"labels": labels})
        expected = f"{path}: labels must be class ids 0..9; 1 are not (e.g. {bad})"
        with pytest.raises(ValueError, match=re.escape(expected)):
            ndl.data.CIFAR10Dataset(folder, train=False)


def test_cifar10_rejects_data_of_the_wrong_shape_or_content(tmp_path):
    cases = [
        ({b"data": np.zeros((2, 3000), dtype=np.uint8), b"labels": [0, 1]}, "data is uint8 of shape (2, 3000)"),
        ({b"data": np.full((1, 3072), 300), b"labels": [0]}, "pixel values must lie in 0..255, found 300..300"),
        ({b"labels": [0]}, "not a CIFAR-10 batch"),
    ]
    for content, message in cases:
        folder, path = write_cifar_test_batch(tmp_path, content)
        with pytest.raises(ValueError, match=re.escape(f"{path}: {message}")):
            ndl.data.CIFAR10Dataset(folder, train=False)


def test_cifar10_truncated_batch_names_the_file(tmp_path):
    content = official_pickle({b"data": np.zeros((2, 3072), dtype=np.uint8), b"labels": [0, 1]})
    path = tmp_path / "test_batch"
    for cut in [0, 100, len(content) - 1]:
        path.write_bytes(content[:cut])
        with pytest.raises(pickle.UnpicklingError, match=re.escape(f"{path}: ")):
            ndl.data.load_cifar_batch(str(path))


def test_get_batch_rejects_rows_out_of_range():
    batches = ndl.data.batchify(list(range(20)), batch_size=2, device=None, dtype="float32")  # (10, 2)
    for i in [-1, -9, 9, 10, 100]:
        expected = f"get_batch: i={i} is out of range for 10 rows of batches (valid: 0..8;"
        with pytest.raises(IndexError, match=re.escape(expected)):
            ndl.data.get_batch(batches, i, 4)
    with pytest.raises(ValueError, match="bptt=0 must be at least 1"):
        ndl.data.get_batch(batches, 0, 0)
    X, y = ndl.data.get_batch(batches, 8, 4)  # the last row with a target
    assert X.shape == (1, 2) and y.shape == (2,)


# ----- hostile or mistaken files: one clear error, bounded work (issue 26, items 3 and 10) ---------------------------
def test_mnist_rejects_labels_outside_0_to_9(tmp_path):
    image_path, label_path = write_mnist(tmp_path, np.zeros((3, 28, 28)), np.array([1, 12, 3]))
    with pytest.raises(ValueError, match=re.escape(f"{label_path}: label 12 at index 1 is outside 0..9")):
        ndl.data.MNISTDataset(image_path, label_path)


def test_mnist_does_not_inflate_a_gzip_bomb(tmp_path, monkeypatch):
    # A header promising 2 labels followed by 64 MiB of zeros (64 KiB compressed): the reader stops counting
    # after a bounded excess and never holds the inflated stream.
    image_path, label_path = write_mnist(tmp_path, np.zeros((2, 28, 28)), np.zeros(2))
    with gzip.open(label_path, "wb") as f:
        f.write(struct.pack(">ii", 2049, 2))
        zeros = bytes(1 << 20)
        for _ in range(64):
            f.write(zeros)
    reads = []
    real_read = gzip.GzipFile.read

    def read(self, size=-1):
        reads.append(size)
        return real_read(self, size)

    monkeypatch.setattr(gzip.GzipFile, "read", read)
    with pytest.raises(ValueError, match=r"has more than \d+ after the header \(too long\)"):
        ndl.data.parse_mnist(image_path, label_path)
    assert all(0 <= size <= 1 << 20 for size in reads)  # never "read everything"


def test_mnist_rejects_a_header_promising_more_than_gzip_can_hold(tmp_path):
    image_path, label_path = write_mnist(tmp_path, np.zeros((2, 28, 28)), np.zeros(2))
    write_gz(image_path, struct.pack(">iiii", 2051, 1_000_000, 28, 28))  # 784 MB promised from ~50 bytes
    with pytest.raises(ValueError, match="more than gzip can inflate to"):
        ndl.data.parse_mnist(image_path, label_path)


def test_corpus_that_is_not_utf8_names_the_file(ptb_dir):
    (ptb_dir / "test.txt").write_bytes(b"the cat\n\xff\xfe sat\n")
    with pytest.raises(ValueError, match=re.escape(f"{ptb_dir / 'test.txt'}: not UTF-8 text")):
        ndl.data.Corpus(str(ptb_dir))


@pytest.mark.parametrize("batch_size", [0, -2, 1.5, True])
def test_batchify_rejects_a_batch_size_that_is_not_a_positive_integer(batch_size):
    with pytest.raises(ValueError, match=re.escape(f"batch_size must be a positive integer, got {batch_size!r}")):
        ndl.data.batchify(list(range(10)), batch_size=batch_size, device=None, dtype="float32")
