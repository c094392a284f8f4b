"""What an installed or checked-out needle says about itself: its version."""
from pathlib import Path

import pytest

import needle as ndl
from needle.version import package_version

REPO = Path(__file__).resolve().parents[2]


def test_version_is_pyprojects():
    tomllib = pytest.importorskip("tomllib", reason="the oracle: Python >= 3.11 (needle reads it without tomllib)")
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert ndl.__version__ == declared
    assert package_version() == declared


def test_version_reads_the_project_table_not_another_tables_version(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[tool.other]\nversion = "9.9"\n\n[project]\nname = "needle"\nversion = "1.2.3"\n')
    assert package_version(pyproject) == "1.2.3"


def test_the_toolbox_names_keep_working_from_where_they_always_were():
    """Issue 44: the toolbox moved to needle/toolbox/, loaded on first use; every public name is where it was."""
    from needle import checkpoint, checkpoint_budget
    from needle.toolbox import amp, compress, distributed, fewbit, memory, offload
    from needle.toolbox.optim import adafactor, adam8bit
    from needle.toolbox.checkpoint_optimal import optimal
    served = {"ndl.memory": (ndl.memory, memory), "ndl.amp": (ndl.amp, amp), "ndl.autocast": (ndl.autocast,
              amp.autocast), "ndl.distributed": (ndl.distributed, distributed),
              "checkpoint.OFFLOAD": (checkpoint.OFFLOAD, offload.OFFLOAD),
              "checkpoint.compress": (checkpoint.compress, compress.compress),
              "checkpoint.offload_all": (checkpoint.offload_all, offload.offload_all),
              "checkpoint_budget.optimal": (checkpoint_budget.optimal, optimal),
              "ndl.optim.Adam8bit": (ndl.optim.Adam8bit, adam8bit.Adam8bit),
              "ndl.optim.Adafactor": (ndl.optim.Adafactor, adafactor.Adafactor),
              "ndl.ops.FewBitActivation": (ndl.ops.FewBitActivation, fewbit.FewBitActivation)}
    assert {name: a is b for name, (a, b) in served.items()} == {name: True for name in served}
    assert type(checkpoint.Budget(1 << 20, offload=True)).__module__ == "needle.toolbox.budget_offload"
    assert type(checkpoint.Budget(1 << 20)) is checkpoint.Budget
    assert checkpoint.resolve_policy("offload") is offload.offload_all
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        ndl.nothing_here
