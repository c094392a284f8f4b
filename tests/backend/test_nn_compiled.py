"""Layers, optimizers, saving and checkpointing on the compiled backends: tests of tests/core, run here on cpu() (and
cuda() with a GPU) against the same oracles (PyTorch, the NumPy reference, bit-identical recomputation, the
allocator's exact bytes); see test_ops_compiled.py for how. Not here: what does not depend on the backend
(test_nn.py's test_cells_read_parameters_at_call_time: when parameters are read)."""
from test_checkpoint import (  # noqa: F401
    test_rule3_dropped_values_use_less_memory_at_backward_start,
    test_rule3_memory_returns_to_baseline,
    test_rule4_gradients_bit_identical,
)
from test_checkpoint_api import (  # noqa: F401
    test_rule3_checkpoint_holds_less_memory_before_backward,
    test_rule4_checkpoint_gradients_bit_identical,
)
from test_nn import (  # noqa: F401
    test_activations_flatten_identity_sequential_residual,
    test_attention_layer_matches_torch,
    test_batchnorm1d_train_eval_matches_torch,
    test_batchnorm2d_train_eval_matches_torch,
    test_conv_matches_torch,
    test_dropout_mask_convention,
    test_eager_and_lazy_give_identical_results,
    test_embedding_index_out_of_range_raises_at_call,
    test_embedding_matches_torch,
    test_layernorm_matches_torch,
    test_linear_is_one_op_that_reads_the_bias_in_place,
    test_linear_matches_torch,
    test_lstm_matches_torch,
    test_multihead_attention_matches_torch,
    test_rnn_matches_torch,
    test_softmax_loss_matches_one_hot_and_torch,
    test_transformer_layer_matches_torch,
    test_transformer_matches_torch,
)
from test_optim import (  # noqa: F401
    test_adam_matches_reference,
    test_adam_matches_torch,
    test_adam_state_dict_has_pytorchs_layout_and_loads_back_exactly,
    test_sgd_matches_reference,
    test_step_keeps_grad_dtype_and_graph,
)
from test_serialization import test_round_trip_through_save_and_load_gives_identical_outputs  # noqa: F401
