"""What gc.py says besides its results: one-line errors (exit status 2), progress bars on stderr, and lines
printed above the bars.  tqdm (the `experiment` extra) is imported where a bar is drawn."""
import sys

BAD_INPUT_EXIT = 2
INTERRUPTED_EXIT = 130  # Ctrl-C, as a shell reports a process SIGINT ended (128 + 2)
OOM_EXIT = 3  # exit status of a run that hit --memory-limit-mb (max-batch reads it)


def fail(message):
    """A bad input: one line on stderr, exit status 2, no traceback."""
    print(f"gc.py: {message}", file=sys.stderr)
    sys.exit(BAD_INPUT_EXIT)


def tqdm_class():
    """tqdm.auto's bar class: a widget in a notebook, a text bar in a terminal."""
    try:
        from tqdm.auto import tqdm
    except ImportError as err:
        raise ImportError("gc.py draws its progress bars with tqdm, which is not installed: "
                          "pip install -e '.[experiment]' (or make demo)") from err
    return tqdm


def progress_on(flag):
    """--progress / --no-progress, or by default: on when stderr is a terminal or this runs in a notebook."""
    return flag if flag is not None else (sys.stderr.isatty() or "ipykernel" in sys.modules)


def note(line):
    """A progress line on stderr, above the progress bar."""
    tqdm_class().write(line, file=sys.stderr)


def say(line):
    """A result line on stdout, above the progress bar."""
    tqdm_class().write(line, file=sys.stdout)
