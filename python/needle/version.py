"""needle's version: pyproject.toml's `version`, read from the source tree when there is one, else from the
installed package's metadata.

The source tree wins because it is always current: an editable install's metadata is frozen at install time.
pyproject.toml is read with a regular expression, not tomllib, which only Python >= 3.11 has (needle supports 3.9).
"""
import re
from importlib import metadata
from pathlib import Path

__all__ = ["package_version"]

_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"  # python/needle/version.py -> the repository


def package_version(pyproject=_PYPROJECT):
    """The version string of the needle project ("0.1.0"); None only if neither source names one."""
    if pyproject.is_file():
        match = re.search(r'^\[project\][^\[]*?^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M | re.S)
        if match:
            return match.group(1)
    try:
        return metadata.version("needle")
    except metadata.PackageNotFoundError:
        return None
