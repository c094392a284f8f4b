"""The ops' kernels on the compiled backends: tests of tests/core, run here on cpu() (and cuda() with a GPU).

In tests/core these tests take `device` without parametrizing it and run on the NumPy reference device; imported
here, conftest's tier hook (TIER_DEVICES) runs them on the compiled devices against the same oracles: central
differences on the reference (conftest.check_gradients), the reference's bytes, the unfused graph, PyTorch. Not
here: what does not depend on the backend (test_autograd.py's lazy shape inference).
"""
import numpy as np
import pytest

from needle import backend_ndarray as nd

from test_activations import (  # noqa: F401
    KINDS,
    inputs,
    test_rule_1_bfloat16_is_the_float32_result_rounded_once,
    test_rule_1_huge_inputs_saturate_and_nan_stays_nan,
    test_rule_1_kernels_match_pytorch_in_float32,
    test_rule_3_bad_kernel_input_is_a_clear_error,
)
from test_autograd import test_lazy_and_eager_give_identical_numbers, test_op_gradient  # noqa: F401
from test_dropout import test_every_backend_gives_the_reference_bytes  # noqa: F401
from test_fused_linear import test_ledger_predicts_a_linear_step_exactly, test_linear_has_the_composite_bytes  # noqa: F401
from test_layernorm import (  # noqa: F401
    test_bad_shapes_and_dtypes_are_clear_errors,
    test_kernels_match_the_formula,
    test_op_equals_the_composite_forward_and_gradients,
    test_the_op_allocates_only_its_outputs,
)
from test_np_broadcast import test_nd_backend_requires_equal_shapes  # noqa: F401


# ----- test_activations.py's rule 2: the compiled backends agree with the reference ----------------------------------
@pytest.mark.skipif(not nd.cpu().enabled(), reason="C++ backend not built (run `make`)")
@pytest.mark.parametrize("kind", KINDS)
def test_rule_2_cpu_agrees_with_the_numpy_reference(kind):
    x, g = inputs(np.random.default_rng(3))
    results = []
    for device in (nd.cpu(), nd.cpu_numpy()):
        a = nd.array(x, device=device)
        results.append((a.activation(kind).numpy(), a.activation_grad(nd.array(g, device=device), kind).numpy()))
    (y, dx), (ref_y, ref_dx) = results
    np.testing.assert_allclose(y, ref_y, rtol=4e-6, atol=1e-7)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-5, atol=1e-6)
