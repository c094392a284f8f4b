"""One Markdown table, as the benchmarks print it with `--markdown` (and benchmarks/figures.py writes into the pages).

Each benchmark keeps its console output for people; with `--markdown` that output goes to stderr instead
(`progress_to_stderr`) and stdout holds the table alone, which is what figures.py reads.
"""
import contextlib
import sys


def markdown_table(header, rows, right=()):
    """The lines of a Markdown table: `header` a list of column titles, `rows` lists of cells (any value, str()'d);
    the columns whose index is in `right` are right-aligned (numbers)."""
    cells = lambda row: "| " + " | ".join(str(c) for c in row) + " |"  # noqa: E731
    rule = "| " + " | ".join("---:" if i in right else "---" for i in range(len(header))) + " |"
    return "\n".join([cells(header), rule] + [cells(row) for row in rows])


def progress_to_stderr(markdown):
    """A context in which print() goes to stderr when `markdown` is set, so that stdout is the table alone."""
    return contextlib.redirect_stdout(sys.stderr) if markdown else contextlib.nullcontext()
