"""Element-wise broadcasting, the nd side: NDArray keeps its equal-shapes rule, and the gradient helper that
undoes NumPy broadcasting (NEEDLE_BACKEND=np, checked in np_backend_checks.py) leaves equal-shape graphs alone.
"""
import numpy as np
import pytest

import needle as ndl
from needle import autograd
from needle.ops.ops_mathematic import sum_to_shape

from op_cases import BINARY_OPS


@pytest.mark.parametrize("name", list(BINARY_OPS))
def test_nd_backend_requires_equal_shapes(name, device):
    for shape_a, shape_b in [((2, 3), (3,)), ((1, 3), (3,)), ((2, 3), (3, 2))]:
        a = ndl.Tensor(np.ones(shape_a), device=device)
        b = ndl.Tensor(np.ones(shape_b), device=device)
        with pytest.raises(ValueError, match=rf"shapes \({shape_a[0]}, .*\) and \({shape_b[0]},.*\) differ"):
            BINARY_OPS[name][0](a, b)


@pytest.mark.smoke
def test_sum_to_shape_returns_the_gradient_itself_when_shapes_match():
    g = ndl.Tensor(np.arange(6.0).reshape(2, 3))
    assert sum_to_shape(g, (2, 3), g.shape) is g
    np.testing.assert_array_equal(sum_to_shape(g, (3,), g.shape).numpy(), [3.0, 5.0, 7.0])
    np.testing.assert_array_equal(sum_to_shape(g, (1, 3), g.shape).numpy(), [[3.0, 5.0, 7.0]])
    np.testing.assert_array_equal(sum_to_shape(g, (2, 1), g.shape).numpy(), [[3.0], [12.0]])
    np.testing.assert_array_equal(sum_to_shape(g, (), g.shape).numpy(), 15.0)


@pytest.mark.parametrize("name", list(BINARY_OPS))
def test_equal_shape_gradients_have_no_reduction_nodes(name):
    # Gradient checkpointing compares graphs node for node: equal shapes must add no Summation/Reshape.
    rng = np.random.default_rng(0)
    a, b = ndl.Tensor(rng.uniform(0.5, 2.0, (2, 3))), ndl.Tensor(rng.uniform(0.5, 2.0, (2, 3)))
    BINARY_OPS[name][0](a, b).backward()
    ops_used = {type(n.op).__name__ for n in autograd.find_topo_sort([a.grad, b.grad]) if n.op is not None}
    assert not ops_used & {"Summation", "Reshape", "BroadcastTo"}, ops_used
    assert a.grad.shape == b.grad.shape == (2, 3)
