"""Where a command will write, checked before any work: a file where a file is expected (--json, --save-checkpoint),
a folder where a folder is (--out), and a place the process can create them.  A run that would train for an hour
and then find its JSON path is a folder fails at once, in one line, and leaves nothing behind."""
import os
import tempfile

from .console import fail


def writable_ancestor(path, flag):
    """The nearest existing folder at or above `path`, which must let this process create files (tried with an
    unnamed temporary file, so permissions, read-only file systems and root's rights all count as they will)."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        fail(f"{flag} {path}: {folder} is a file, so nothing can be created under it")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        fail(f"{flag} {path}: cannot write in {folder} ({err.strerror or err})")
    return folder


def check_output_file(path, flag):
    """`path` can be written as a file: not a folder, and its folder exists or can be created."""
    if os.path.isdir(path):
        fail(f"{flag} {path} is a folder; give a file name (in it, or beside it)")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        fail(f"{flag} {path}: the file exists and cannot be overwritten")
    writable_ancestor(os.path.dirname(os.path.abspath(path)), flag)


def check_output_folder(path, flag):
    """`path` is a folder, or can be created as one."""
    if os.path.exists(path) and not os.path.isdir(path):
        fail(f"{flag} {path} is a file; give a folder (its JSON files are written there)")
    writable_ancestor(path, flag)


def checkpoint_file(path, rank=0, world_size=1):
    """The file a rank saves or resumes: `path` (with ndl.save's .npz added) alone, or under mpiexec one per rank."""
    path = path if path.endswith(".npz") else path + ".npz"
    return path if world_size == 1 else f"{path[:-len('.npz')]}.rank{rank}.npz"


def check_outputs(config, default_out):
    """Every path `config`'s command writes: --json or --out (default_out when not given), --save-checkpoint."""
    if config.json:
        check_output_file(config.json, "--json")
    else:
        check_output_folder(config.out or default_out, "--out")
    if config.save_checkpoint:
        check_output_file(checkpoint_file(config.save_checkpoint), "--save-checkpoint")
