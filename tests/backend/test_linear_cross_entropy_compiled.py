"""The fused LM head's kernels on the compiled backends: tests of tests/core/test_linear_cross_entropy.py, run here on
cpu() (and cuda() with a GPU) against the same oracles (the unfused head, central differences on the reference,
the allocator's exact peaks); see test_ops_compiled.py for how."""
from test_linear_cross_entropy import (  # noqa: F401
    test_fused_matches_unfused_forward_and_gradients,
    test_gradient_against_central_differences,
    test_out_of_range_target_raises_index_error_naming_it,
    test_peak_memory_is_what_the_op_declares_and_far_below_the_logits,
)
