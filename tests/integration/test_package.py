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
