"""What sequence parallelism divides, counted: the layer norms' and dropouts' activations a step keeps.

Korthikanti et al. (2022) split the activations tensor parallelism leaves whole on every rank, those of the layer
norms and the dropouts (and the residual adds between them), along the sequence. `norm_and_dropout_bytes` reads
them off a recorded step (`ndl.memory.record()`): the buffers alive when backward starts that a LayerNorm op made,
that a Dropout module made (x * mask and its scaling), and the all-gathered copies of a norm's output in front of
a column-parallel matmul (what one process keeps as the norm's output, and what tensor + sequence parallelism
would keep whole unless it gathers again in backward: regions.not_kept). Dropout's masks are leaf tensors the
recorder gives no module, so they are left out; they are sharded as the values they mask.

    with ndl.memory.record() as snap:
        loss, _ = model.loss(X, y)
        loss.backward()
    kept = norm_and_dropout_bytes(snap)    # this rank's bytes
"""

__all__ = ["norm_and_dropout_bytes"]


def _is_norm_or_dropout(block):
    module = block["module"] or ""
    if block["op"] == "LayerNorm" or module.rsplit(".", 1)[-1] == "dropout":
        return True
    return block["op"] == "GatherFromRegion" and ".layers." in f".{module}"  # a layer's gathered norm output


def norm_and_dropout_bytes(snapshot):
    """Bytes of the layer norms' and dropouts' activations alive when `snapshot`'s backward starts (see the module
    docstring); ValueError if the snapshot has no backward phase."""
    starts = [p["start"] for p in snapshot.phases if p["phase"] == "backward"]
    if not starts:
        raise ValueError("norm_and_dropout_bytes: the snapshot has no backward phase (record the forward and the "
                         "backward)")
    alive = snapshot.alive_at(starts[0] - 1)
    return sum(b["bytes"] for b in alive if b["alloc"] is not None and _is_norm_or_dropout(b))
