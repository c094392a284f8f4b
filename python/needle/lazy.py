"""Toolbox names the core offers, loaded on first use, so that `import needle` stays the core.

    ndl.memory.record()                   # needle/__init__.py: "memory" -> needle.toolbox.memory, imported now
    checkpoint.compress(8)                # checkpoint.py: "compress" -> needle.toolbox.compress:compress

A core module lists the names it offers in a table and sets `__getattr__ = lazy.attributes(__name__, table)`;
Python calls it only for a name the module does not define. This is the one place the core reaches the toolbox
(needle/toolbox/), and only by name: no core module imports a toolbox module (tests/core/test_architecture.py).
"""
import importlib

__all__ = ["attributes", "load"]

TOOLBOX = "needle.toolbox"


def load(name):
    """The toolbox module `name` ("offload", "memory", "optim.adam8bit"; "": the toolbox package), imported on
    first use."""
    return importlib.import_module(f"{TOOLBOX}.{name}" if name else TOOLBOX)


def attributes(module_name, table):
    """A module `__getattr__` serving `table` ({attribute: "module" or "module:name"} in the toolbox)."""
    def __getattr__(name):
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        module, _, attribute = target.partition(":")
        found = load(module)
        return getattr(found, attribute) if attribute else found
    return __getattr__
