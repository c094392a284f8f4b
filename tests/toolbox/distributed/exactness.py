"""What the exactness scripts of this folder share (run under mpiexec, not pytest: conftest is not theirs).

`compare`: a trained state dict against one process's, tensor by tensor, within a relative L2 bound; a tensor whose
exact gradient is zero (the attention's key pre-norm bias) follows rounding noise that Adam amplifies, so it is held
to |delta| <= 2 lr steps instead (issue #31).
"""
import numpy as np

ZERO_GRADIENT = ("attention.prenorm_k.bias",)  # exact gradient zero: rounding noise, amplified by Adam


def compare(state, reference, lr, steps, tolerance=1e-5):
    """The worst relative L2 over the tensors; an AssertionError naming the first tensor out of bounds."""
    assert list(state) == list(reference), (list(state), list(reference))
    worst = 0.0
    for name, ref in reference.items():
        got = state[name]
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        if name.endswith(ZERO_GRADIENT):
            assert np.abs(got - ref).max() <= 2 * lr * steps, name
            continue
        rel = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
        assert rel <= tolerance, (name, rel)
        worst = max(worst, rel)
    return worst
