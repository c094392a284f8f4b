"""The learning path (issue 50): every lesson in notebooks/ runs top to bottom in its quick mode and draws.

The notebooks are jupytext percent scripts; each is converted in memory, gets a cell after its one `parameters` cell
that sets small sizes (as papermill injects parameters), and runs in a Jupyter kernel of this interpreter through
nbclient. A notebook fails on any cell's error, on no picture (no image/png output), or on a quick mode slow enough
to threaten `make test`'s time. Nothing here needs ../shared/data: lesson 6 trains on a slice of PTB where it is
there and on its own toy corpus where it is not.
"""
import ast
import os
import sys
import time
from pathlib import Path

import jupytext  # these three and ipykernel: the test extra's (pip install -e '.[test]')
import nbclient
import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
# Each lesson's quick mode: the sizes the test puts in place of its parameters cell's (each name must be one the
# cell sets). The goal is 20 s a lesson on 2 cores; QUICK_LIMIT_S leaves room for `make test` running two tiers
# at once.
QUICK = {
    "01_graph_and_memory.py": dict(BATCH=8, FEATURES=64, HIDDEN=32),
    "02_lazy_and_drop.py": dict(LENGTH=5, ROWS=16, KEEP_EVERY=2),
    "03_policies_on_a_transformer_layer.py": dict(BATCH=2, SEQ=16, WIDTH=32, HEADS=2),
    "04_the_budget.py": dict(LAYERS=2, BATCH=4, SEQ=8, WIDTH=32, VOCAB=100, DEPTHS=(1, 2, 4)),
    "05_the_whole_step.py": dict(BATCH=8, SEQ=8, WIDTH=32, LAYERS=1, STEPS=1),
    "06_a_language_model_on_ptb.py": dict(MAX_LINES=150, EPOCHS=2, BATCH=8, SEQ=16, WIDTH=32, LAYERS=1, TOKENS=8),
}
QUICK_LIMIT_S = 60
CELL_TIMEOUT_S = 120


def lessons():
    return sorted(path.name for path in NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def parameters_cell(notebook):
    """The index of the notebook's one cell tagged `parameters`."""
    marked = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(marked) == 1, f"{len(marked)} cells tagged parameters: a lesson has exactly one"
    return marked[0]


def assigned_names(source):
    return {target.id for node in ast.parse(source).body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)}


def with_quick_parameters(notebook, overrides):
    """The notebook with a cell after its parameters cell that sets `overrides` and checks the kernel is this
    environment's (a kernel of another Python would test another installation)."""
    marked = parameters_cell(notebook)
    unknown = set(overrides) - assigned_names(notebook.cells[marked].source)
    assert not unknown, f"the parameters cell sets no {sorted(unknown)}: the quick mode would not apply"
    lines = [f"{name} = {value!r}" for name, value in overrides.items()]
    lines.append(f"assert __import__('sys').prefix == {sys.prefix!r}, 'the kernel runs another Python'")
    injected = nbformat.v4.new_code_cell("\n".join(lines), metadata={"tags": ["injected-parameters"]})
    notebook.cells.insert(marked + 1, injected)
    return notebook


def pictures(notebook):
    return sum("image/png" in output.get("data", {}) for cell in notebook.cells if cell.cell_type == "code"
               for output in cell.get("outputs", []))


def test_every_lesson_has_a_quick_mode():
    assert lessons() == sorted(QUICK)  # a new lesson gets its quick sizes here, or it would never run in make test
    assert len(QUICK) == 6


@pytest.mark.parametrize("name", sorted(QUICK))
def test_lesson_runs_in_its_quick_mode_and_draws(name):
    notebook = with_quick_parameters(jupytext.read(NOTEBOOKS / name), QUICK[name])
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    start = time.perf_counter()
    # The pictures come back as image/png from matplotlib's inline backend, which the kernel picks unless
    # MPLBACKEND names another (Agg, say, in a headless shell).
    client.execute(env={**os.environ, "MPLBACKEND": "module://matplotlib_inline.backend_inline"})
    # (a cell's error raises CellExecutionError, its traceback in the message)
    seconds = time.perf_counter() - start
    assert pictures(notebook) >= 1, f"{name} drew no picture"
    assert seconds <= QUICK_LIMIT_S, f"{name} took {seconds:.0f} s in its quick mode (goal: 20 s)"


def test_the_quick_mode_is_what_runs():
    """The injected cell comes after the parameters cell and before any other code, so the lesson runs with it."""
    notebook = with_quick_parameters(jupytext.read(NOTEBOOKS / "01_graph_and_memory.py"), {"BATCH": 3})
    marked = parameters_cell(notebook)
    assert notebook.cells[marked + 1].metadata["tags"] == ["injected-parameters"]
    assert notebook.cells[marked + 1].source.startswith("BATCH = 3\n")
    with pytest.raises(AssertionError, match="sets no"):
        with_quick_parameters(jupytext.read(NOTEBOOKS / "01_graph_and_memory.py"), {"NO_SUCH_NAME": 1})
