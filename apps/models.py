"""The course's models: ResNet9 for CIFAR-10 and an Embedding -> RNN/LSTM/Transformer -> Linear language model
(and LMStage, a run of its Transformer layers as one pipeline stage)."""
import contextlib

import numpy as np

import needle as ndl
from needle import nn

__all__ = ["ConvBN", "LMStage", "LanguageModel", "ResNet9"]


class ConvBN(nn.Module):
    """Conv -> BatchNorm2d -> ReLU on NCHW input."""

    def __init__(self, in_channels, out_channels, kernel_size, stride, device=None, dtype="float32"):
        super().__init__()
        self.conv = nn.Conv(in_channels, out_channels, kernel_size, stride=stride, device=device, dtype=dtype)
        self.bn = nn.BatchNorm2d(out_channels, device=device, dtype=dtype)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


class ResNet9(nn.Module):
    """The course's small ResNet for 32 x 32 images: (N, 3, 32, 32) -> logits (N, 10)."""

    def __init__(self, device=None, dtype="float32"):
        super().__init__()

        def conv_bn(a, b, k, s):
            return ConvBN(a, b, k, s, device=device, dtype=dtype)

        self.model = nn.Sequential(
            conv_bn(3, 16, 7, 4),
            conv_bn(16, 32, 3, 2),
            nn.Residual(nn.Sequential(conv_bn(32, 32, 3, 1), conv_bn(32, 32, 3, 1))),
            conv_bn(32, 64, 3, 2),
            conv_bn(64, 128, 3, 2),
            nn.Residual(nn.Sequential(conv_bn(128, 128, 3, 1), conv_bn(128, 128, 3, 1))),
            nn.Flatten(),
            nn.Linear(128, 128, device=device, dtype=dtype),
            nn.ReLU(),
            nn.Linear(128, 10, device=device, dtype=dtype),
        )

    def forward(self, x):
        return self.model(x)


class LanguageModel(nn.Module):
    """Next-word prediction: Embedding -> sequence model ('rnn', 'lstm' or 'transformer') -> Linear.

    forward(x (T, B) word ids, h=None) -> (logits (T*B, output_size), h), where h is the sequence model's final
    state (for the transformer a placeholder of zeros). `use_gc=True` turns gradient checkpointing on for the
    whole model at construction (`enable_gc(segment_len=segment_len)`); `enable_gc(segment_len, policy)` can
    also be called later (it is Module's). `num_head`, `dim_head`, `dropout`, `activation` (its MLP's: "relu",
    "gelu", "gelu_tanh", "silu") and `activation_bits` configure the transformer (the course's defaults: 8 heads
    of 32, relu).
    """

    def __init__(self, embedding_size, output_size, hidden_size, num_layers=1, seq_model="rnn", seq_len=40,
                 device=None, dtype="float32", use_gc=False, segment_len=None, num_head=8, dim_head=32,
                 dropout=0.0, activation="relu", activation_bits=None):
        super().__init__()
        if seq_model != "transformer" and (activation != "relu" or activation_bits is not None):
            raise ValueError(f"LanguageModel: activation and activation_bits configure the transformer's MLP; "
                             f"seq_model {seq_model!r} has none (got activation {activation!r}, activation_bits "
                             f"{activation_bits!r})")
        self.embedding = nn.Embedding(output_size, embedding_size, device=device, dtype=dtype)
        if seq_model == "rnn":
            self.seq_model = nn.RNN(embedding_size, hidden_size, num_layers, device=device, dtype=dtype)
        elif seq_model == "lstm":
            self.seq_model = nn.LSTM(embedding_size, hidden_size, num_layers, device=device, dtype=dtype)
        elif seq_model == "transformer":
            self.seq_model = nn.Transformer(embedding_size, hidden_size, num_layers, device=device, dtype=dtype,
                                            sequence_len=seq_len, num_head=num_head,
                                            dim_head=dim_head, dropout=dropout, activation=activation,
                                            activation_bits=activation_bits)
            hidden_size = embedding_size  # the transformer keeps the embedding width
        else:
            raise ValueError(f"LanguageModel: seq_model must be 'rnn', 'lstm' or 'transformer', got {seq_model!r}")
        self.hidden_size = hidden_size
        self.output_size = output_size
        self.linear = nn.Linear(hidden_size, output_size, device=device, dtype=dtype)
        if use_gc:
            self.enable_gc(segment_len=segment_len)

    def forward(self, x, h=None):
        seq_len, batch = x.shape
        out, h = self.seq_model(self.embedding(x), h)
        logits = self.linear(ndl.reshape(out, (seq_len * batch, self.hidden_size)))
        return self.checkpoint(logits, [out]), h  # the head's input copy recomputed, as in loss()

    def loss(self, x, y, h=None, chunk_size=None):
        """(mean cross-entropy of forward's logits against y (T*B,), h), the logits never materialized.

        Runs the embedding and the sequence model as forward does, then the Linear head fused with the loss
        (ops.linear_cross_entropy, chunk by chunk over tokens) on the head's own weight and bias: the same loss
        and gradients as nn.SoftmaxLoss()(self(x, h)[0], y), with one chunk of logits alive at a time. The fused
        head has no interior for checkpointing to drop (its logits live inside the op).
        """
        seq_len, batch = x.shape
        out, h = self.seq_model(self.embedding(x), h)
        hidden = ndl.reshape(out, (seq_len * batch, self.hidden_size))
        loss = ndl.ops.linear_cross_entropy(hidden, self.linear.weight, self.linear.bias, y, chunk_size=chunk_size)
        # The head's input is a copy of the sequence model's output (a transposed view made compact): a region of
        # its own, so that checkpointing drops the copy and makes it again in backward from that output, which
        # backward holds anyway.
        return self.checkpoint(loss, [out]), h

    def generate(self, tokens, max_new_tokens, temperature=1.0, top_k=None, seed=None):
        """`tokens` (word ids) continued by `max_new_tokens` sampled ids: the whole sequence, as a list of ints.

        Each new word is drawn from softmax(logits / temperature) of the model's prediction after the words so far
        (temperature 0: always the likeliest word; `top_k`: only among the k likeliest), by a generator of its
        own seeded with `seed`: one seed, one text, and NumPy's global RNG is left as it was. The Transformer
        reads a window of the last seq_len words (its positions end there); the RNN and the LSTM carry their
        state, reading each word once. In eval mode (no dropout); nothing is kept for backward.

            ids = model.generate(corpus.encode("the company said"), 20, seed=0)
            print(corpus.decode(ids))
        """
        ids = self._word_ids(tokens, 1, "generate")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
                or max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
        if not (isinstance(temperature, (int, float)) and np.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"generate: temperature must be a finite number >= 0, got {temperature!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1):
            raise ValueError(f"generate: top_k must be None or a whole number >= 1, got {top_k!r}")
        rng = np.random.default_rng(seed)
        with _evaluating(self):
            fed, h = 0, None
            for _ in range(max_new_tokens):
                logits, h = self._next_logits(ids, fed, h)
                fed = len(ids)
                ids.append(_pick(logits, temperature, top_k, rng))
        return ids

    def perplexity(self, tokens):
        """exp of the mean negative log-likelihood of tokens[1:], each word predicted from the words before it as
        generate predicts it (the Transformer: from the last seq_len of them); in eval mode."""
        ids = self._word_ids(tokens, 2, "perplexity")
        nll, fed, h = [], 0, None
        with _evaluating(self):
            for i in range(1, len(ids)):
                logits, h = self._next_logits(ids[:i], fed, h)
                fed = i
                z = logits - logits.max()
                nll.append(np.log(np.exp(z).sum()) - z[ids[i]])
        return float(np.exp(np.mean(nll)))

    def _word_ids(self, tokens, least, caller):
        """`tokens` as a list of ints, checked: at least `least` of them, each a word of the vocabulary."""
        ids = np.asarray(tokens).reshape(-1) if not isinstance(tokens, ndl.Tensor) else tokens.numpy().reshape(-1)
        if len(ids) < least or np.any(ids != np.round(ids)) or np.any(ids < 0) or np.any(ids >= self.output_size):
            raise ValueError(f"{caller}: tokens must be at least {least} word id(s) in [0, {self.output_size}), "
                             f"got {np.asarray(tokens).tolist()!r}")
        return [int(i) for i in ids]

    def _next_logits(self, ids, fed, h):
        """(the logits of the word after `ids` (float64), the state after them): the Transformer reads the last
        seq_len words afresh; the RNN and the LSTM read ids[fed:] from their state h."""
        transformer = isinstance(self.seq_model, nn.Transformer)
        window = ids[-self.seq_model.sequence_len:] if transformer else ids[fed:]
        device = self.embedding.weight.device
        X = ndl.Tensor(np.array(window, dtype=np.float32).reshape(-1, 1), device=device, requires_grad=False)
        logits, h = self(X, None if transformer else h)
        h = None if transformer else tuple(x.detach() for x in h) if isinstance(h, tuple) else h.detach()
        return logits.numpy()[-1].astype(np.float64), h


def _pick(logits, temperature, top_k, rng):
    """One word id drawn from softmax(logits / temperature) over the top_k likeliest (temperature 0: the likeliest)."""
    if top_k is not None and top_k < len(logits):
        logits = np.where(logits >= np.partition(logits, -top_k)[-top_k], logits, -np.inf)
    if temperature == 0:
        return int(np.argmax(logits))
    p = np.exp((logits - logits.max()) / temperature)
    return int(rng.choice(len(p), p=p / p.sum()))


@contextlib.contextmanager
def _evaluating(model):
    """A block in which `model` is in eval mode; its training mode is restored after."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        if training:
            model.train()


class LMStage(nn.Module):
    """A run of the LanguageModel's Transformer layers as one pipeline stage.  The first stage also embeds the word
    ids and adds the positions, the last one turns the (B, T, D) stream back into (T*B, D) rows for the head, whose
    weights it holds (the loss function applies them): exactly the operations of LanguageModel.forward /
    Transformer.forward, cut between layers."""

    def __init__(self, model, layers, first, last):
        super().__init__()
        transformer = model.seq_model
        self.embedding = model.embedding if first else None
        self.positional_embedding = transformer.positional_embedding if first else None
        self.layers = layers
        self.linear = model.linear if last else None
        self.width = transformer.embedding_size
        self.checkpoint_policy = transformer.checkpoint_policy  # checkpointed as the transformer is

    def forward(self, x):
        if self.embedding is not None:  # word ids (T, B) -> the layers' input (B, T, D), as Transformer.forward
            T, B = x.shape
            x = self.embedding(x)
            positions = ndl.Tensor(np.arange(T).reshape(T, 1), device=x.device, dtype="float32", requires_grad=False)
            pos = ndl.reshape(self.positional_embedding(positions), (1, T, self.width))
            x = self.checkpoint(ndl.transpose(x, (0, 1)) + ndl.broadcast_to(pos, (B, T, self.width)), [x])
        for layer in self.layers:
            x = layer(x)
        if self.linear is not None:  # (B, T, D) -> (T*B, D), as LanguageModel.forward
            B, T, _ = x.shape
            x = ndl.reshape(ndl.transpose(x, (0, 1)), (T * B, self.width))
        return x
