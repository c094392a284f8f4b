"""Fused attention's kernels on the compiled backends: tests of tests/core/test_attention.py, run here on cpu() (and
cuda() with a GPU) against the same oracles (the unfused graph, central differences on the reference, the
contract's dropout hash, the allocator's exact peaks); see test_ops_compiled.py for how."""
from test_attention import (  # noqa: F401
    test_16bit_storage_float32_arithmetic,
    test_backends_check_their_arguments,
    test_dropout_mask_is_the_contracts_hash_and_the_same_on_every_device,
    test_eager_and_lazy_are_bit_identical,
    test_fused_matches_unfused_forward_and_gradients,
    test_fused_transformer_matches_unfused_in_training_mode,
    test_gradient_against_central_differences,
    test_outputs_are_out_and_the_float32_log_sum_exp_of_each_row,
    test_peak_inside_compute_is_exactly_outputs_plus_declared_workspace,
    test_peak_of_forward_and_backward_is_linear_in_T,
)
