"""needle's Transformer LanguageModel (apps/models.py) written again in PyTorch, with a needle model's parameters
copied in: the oracle of bench_perplexity.py (and of tests/integration/test_torch_lm.py, which holds the two to the
same loss and gradients).

Operation for operation it is needle's: word and position embeddings added in (B, T, D); per layer a pre-norm
attention with its own LayerNorm before each of q, k and v, projections without bias, softmax(q kᵀ / √d + a causal
mask of −max float32) v, an output projection, the residual; then LayerNorm, Linear, ReLU, Linear, the residual; no
final norm; the head a Linear over the vocabulary. needle's Linear holds its weight as (in, out) and its bias as
(1, out), so x @ W + b reads them as they are. PyTorch is imported by whoever imports this file.
"""
import numpy as np
import torch
import torch.nn.functional as F


class TorchLM(torch.nn.Module):
    """forward(x (T, B) word ids, int64) -> logits (T * B, vocabulary), as LanguageModel.forward (transformer)."""

    def __init__(self, model):
        super().__init__()
        transformer = model.seq_model
        attention = transformer.layers[0].attention
        self.width, self.heads, self.dim_head = transformer.embedding_size, attention.num_head, attention.dim_head
        self.num_layers = len(transformer.layers)
        self.names = list(model.state_dict())  # needle's names, in needle's parameter order
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.tensor(np.asarray(value, dtype=np.float32))) for value in
            model.state_dict().values())
        self.index = {name: i for i, name in enumerate(self.names)}

    def p(self, name):
        return self.weights[self.index[name]]

    def forward(self, x):
        T, B = x.shape
        h = self.p("embedding.weight")[x].transpose(0, 1) + self.p("seq_model.positional_embedding.weight")[:T]
        for i in range(self.num_layers):
            h = self.layer(h, f"seq_model.layers.{i}.")
        h = h.transpose(0, 1).reshape(T * B, self.width)
        return h @ self.p("linear.weight") + self.p("linear.bias")

    def norm(self, x, name):
        return F.layer_norm(x, (self.width,), self.p(f"{name}.weight"), self.p(f"{name}.bias"), eps=1e-5)

    def layer(self, x, at):
        B, T, _ = x.shape

        def heads(which):  # (B, T, H * Dh) -> (B, H, T, Dh)
            z = self.norm(x, f"{at}attention.prenorm_{which}") @ self.p(f"{at}attention.{which}_projection.weight")
            return z.reshape(B, T, self.heads, self.dim_head).transpose(1, 2)

        q, k, v = heads("q"), heads("k"), heads("v")
        mask = -torch.finfo(torch.float32).max * torch.triu(torch.ones(T, T), 1)
        probs = torch.softmax(q @ k.transpose(-1, -2) / self.dim_head ** 0.5 + mask, dim=-1)
        merged = (probs @ v).transpose(1, 2).reshape(B, T, self.heads * self.dim_head)
        h = x + merged @ self.p(f"{at}attention.out_projection.weight")
        normed = self.norm(h, f"{at}layernorm")
        hidden = torch.relu(normed @ self.p(f"{at}linear1.weight") + self.p(f"{at}linear1.bias"))
        return h + hidden @ self.p(f"{at}linear2.weight") + self.p(f"{at}linear2.bias")
