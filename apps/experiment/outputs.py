"""Where a command will write, checked before any work: a file where a file is expected (--json, --save-checkpoint),
a folder where a folder is (--out), and a place the process can create them.  A run that would train for an hour
and then find its JSON path is a folder fails at once, in one line, and leaves nothing behind.

The three flags alike: a missing folder on the way is created when the first file is written (make_folder_of);
an existing folder is never taken for a file's name (not even by adding .npz beside it).  Files are written
atomically (a temporary file renamed over the name), which would replace whatever node the name is: so a name
that exists must be a regular file (`/dev/null` as root would become one), and a symbolic link is written through,
to the file it points at (regular_file_target)."""
import os
import stat
import tempfile

from needle import distributed as dist

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


def regular_file_target(path):
    """The file an atomic write of `path` replaces: `path`, or the file a symbolic link there points at; a
    ValueError saying why where that exists and is not a regular file (a folder, a device, a FIFO, a socket)."""
    target = os.path.realpath(path) if os.path.islink(path) else path
    try:
        mode = os.stat(target).st_mode
    except (FileNotFoundError, NotADirectoryError):  # a new file (or a path that cannot be: writable_ancestor says)
        return target
    if stat.S_ISDIR(mode):
        raise ValueError("is a folder; give a file name (in it, or beside it)")
    if not stat.S_ISREG(mode):
        raise ValueError(f"is {'a device' if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else 'not a regular file'}: "
                         f"writing it would replace that node with a file; give a file name")
    return target


def check_output_file(path, flag):
    """`path` can be written as a file: new or a regular file (through a symbolic link), its folder existing or
    creatable."""
    if path.endswith(os.sep):
        fail(f"{flag} {path} names a folder; give a file name (in it, or beside it)")
    try:
        target = regular_file_target(path)
    except ValueError as why:
        fail(f"{flag} {path} {why}")
    if os.path.exists(target) and not os.access(target, os.W_OK):
        fail(f"{flag} {path}: the file exists and cannot be overwritten")
    writable_ancestor(os.path.dirname(os.path.abspath(target)), flag)


def make_folder_of(path):
    """Create the folder a file `path` goes in, where it is missing (as --out creates its folder)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


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
        if os.path.isdir(config.save_checkpoint):  # ndl.save would add .npz and write beside it
            fail(f"--save-checkpoint {config.save_checkpoint} is a folder; give a file name (in it, or beside it)")
        check_output_file(checkpoint_file(config.save_checkpoint, *dist.comm.launcher_rank_and_size()),
                          "--save-checkpoint")
