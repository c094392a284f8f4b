"""Neural-network layers (`needle.nn`): Module and Parameter, the layers, and `annotate` for checkpointing."""
from ..checkpoint import annotate
from .nn_basic import (
    GELU, BatchNorm1d, BatchNorm2d, Dropout, Flatten, Identity, LayerNorm1d, Linear, ReLU, Residual, Sequential, SiLU,
    Sigmoid, SoftmaxLoss, Tanh,
)
from .nn_conv import Conv
from .nn_module import Module, Parameter
from .nn_sequence import LSTM, RNN, Embedding, LSTMCell, RNNCell
from .nn_transformer import AttentionLayer, MultiHeadAttention, Transformer, TransformerLayer

__all__ = [
    "AttentionLayer", "BatchNorm1d", "BatchNorm2d", "Conv", "Dropout", "Embedding", "Flatten", "GELU", "Identity",
    "LSTM", "LSTMCell", "LayerNorm1d", "Linear", "Module", "MultiHeadAttention", "Parameter", "RNN", "RNNCell", "ReLU",
    "Residual", "Sequential", "SiLU", "Sigmoid", "SoftmaxLoss", "Tanh", "Transformer", "TransformerLayer", "annotate",
]
