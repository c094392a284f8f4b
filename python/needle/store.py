"""Where a saved value goes when it leaves memory: the one seam between the core and the toolbox.

A value backward will read is either kept in memory or leaves it after its last forward use. By default it is
forgotten, and backward recomputes it (checkpointing). A `Store` keeps it somewhere else instead and gives it
back before the step that reads it — PyTorch's `saved_tensors_hooks(pack, unpack)`. The toolbox's host memory
(offloading) and k-bit codes (compression) are stores; the core only calls the methods below.

Where a value is, is written on its node and nowhere else:

    node.cached_data   its array, in memory (None: not in memory)
    node.store         where it goes when it leaves memory (None: nowhere, so it is recomputed)
    node.stored        what `store.put` returned, while the store holds the value (None: it holds nothing)

`autograd.release` puts a value into its store before forgetting it (in the forward pass), and discards the stored
copy at the value's last use; backward's plan brings a stored value back (`Step.bring_back`) instead of recomputing
it. A leaf's `store` is where its complete gradient goes (backward.Compute.set_grad).
"""

__all__ = ["Store", "note_used", "take_traffic"]


class Store:
    """Keeps values that left memory. Subclasses override `put` and `get`, and what the ledger counts."""

    kind = "stored"  # how a value held here is named by keep_reason, print_saved_residuals and to_dot
    # Whether the stored copy stays until the value's last use in backward (True), or is let go of as soon as the
    # value is back in memory (False: nothing in the pass will ask for it again, rule 2).
    kept_until_last_use = True

    def detail(self):
        """A few words the DOT graph shows beside `kind` (a codec's: ", 8 bits")."""
        return ""

    def accepts(self, node):
        """Whether this store can hold `node`'s value (a policy's answer falls back to recompute if not)."""
        return True

    def put(self, node):
        """Keep `node.cached_data` (about to be forgotten); return what holds it (becomes `node.stored`)."""
        raise NotImplementedError

    def get(self, node, stored):
        """The value back in memory, from `stored`; it may still be filling until `ready()`."""
        raise NotImplementedError

    def ready(self):
        """Wait until the values `get` returned so far may be read."""

    def discard(self, node, stored):
        """The value's last use is over: let go of `stored`."""

    # ----- what the Budget's ledger counts, from a value's (shape, dtype, device) alone ---------------------------
    def device_bytes(self, spec):
        """Device bytes the stored copy of a value with this spec takes (codes kept on the device)."""
        return 0

    def host_bytes(self, spec):
        """Host bytes the stored copy takes (outside the device allocator)."""
        return 0

    def holds_while_copying(self, device):
        """Whether a put's device buffers stay alive until the next put or get on `device` (a copy running beside
        the compute still reads them)."""
        return False

    @classmethod
    def take_traffic(cls):
        """{name: number} the stores of this class did since they were last asked (bytes moved, seconds waited),
        then zeroed."""
        return {}


_used = []  # the classes of the stores that have held a value, in the order they first did, for take_traffic


def note_used(store):
    """Remember `store`'s class for `take_traffic` (autograd.release calls it when it puts a value)."""
    if type(store) not in _used:
        _used.append(type(store))


def take_traffic():
    """The traffic of every kind of store used so far, since the last call, merged (last_backward_stats)."""
    merged = {}
    for kind in _used:
        for key, value in kind.take_traffic().items():
            merged[key] = max(merged.get(key, 0), value) if key.endswith("peak_bytes") else merged.get(key, 0) + value
    return merged
