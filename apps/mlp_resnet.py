"""Homework 2: a residual MLP trained on MNIST with needle's DataLoader and optimizers."""
import numpy as np

import needle as ndl
from needle import nn

__all__ = ["MLPResNet", "ResidualBlock", "epoch", "train_mnist"]


def ResidualBlock(dim, hidden_dim, norm=nn.BatchNorm1d, drop_prob=0.1):
    """ReLU(x + norm(Linear(Dropout(ReLU(norm(Linear(x))))))) : (N, dim) -> (N, dim)."""
    return nn.Sequential(
        nn.Residual(nn.Sequential(
            nn.Linear(dim, hidden_dim),
            norm(hidden_dim),
            nn.ReLU(),
            nn.Dropout(drop_prob),
            nn.Linear(hidden_dim, dim),
            norm(dim),
        )),
        nn.ReLU(),
    )


def MLPResNet(dim, hidden_dim=100, num_blocks=3, num_classes=10, norm=nn.BatchNorm1d, drop_prob=0.1):
    """Linear(dim, hidden) -> ReLU -> num_blocks ResidualBlocks (inner width hidden // 2) -> Linear(hidden, classes)."""
    return nn.Sequential(
        nn.Linear(dim, hidden_dim),
        nn.ReLU(),
        *[ResidualBlock(hidden_dim, hidden_dim // 2, norm, drop_prob) for _ in range(num_blocks)],
        nn.Linear(hidden_dim, num_classes),
    )


def _on_device(tensor, device):
    return tensor if tensor.device == device else ndl.Tensor(tensor.numpy(), device=device, requires_grad=False)


def epoch(dataloader, model, opt=None):
    """One pass over `dataloader`: trains with `opt` if given, else evaluates. Returns (error rate, avg loss)."""
    np.random.seed(4)
    model.train() if opt is not None else model.eval()
    loss_fn = nn.SoftmaxLoss()
    params = model.parameters()
    device = params[0].device if params else ndl.default_device()
    errors = total_loss = 0.0
    seen = 0
    for X, y in dataloader:
        X, y = _on_device(X, device), _on_device(y, device)
        if opt is not None:
            opt.reset_grad()
        logits = model(X)
        loss = loss_fn(logits, y)
        # Read the forward pass's values before backward releases them.
        n = y.shape[0]
        errors += float(np.sum(logits.numpy().argmax(axis=1) != y.numpy()))
        total_loss += np.asarray(loss.numpy()).item() * n
        seen += n
        if opt is not None:
            loss.backward()
            opt.step()
    return errors / seen, total_loss / seen


def train_mnist(batch_size=100, epochs=10, optimizer=ndl.optim.Adam, lr=0.001, weight_decay=0.001, hidden_dim=100,
                data_dir="data"):
    """Train MLPResNet(784, hidden_dim) on MNIST; returns (train_err, train_loss, test_err, test_loss)."""
    np.random.seed(4)
    train_set = ndl.data.MNISTDataset(f"{data_dir}/train-images-idx3-ubyte.gz",
                                      f"{data_dir}/train-labels-idx1-ubyte.gz")
    test_set = ndl.data.MNISTDataset(f"{data_dir}/t10k-images-idx3-ubyte.gz", f"{data_dir}/t10k-labels-idx1-ubyte.gz")
    train_loader = ndl.data.DataLoader(train_set, batch_size, shuffle=True)
    test_loader = ndl.data.DataLoader(test_set, batch_size)
    model = MLPResNet(784, hidden_dim)
    opt = optimizer(model.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(epochs):
        train_err, train_loss = epoch(train_loader, model, opt)
    test_err, test_loss = epoch(test_loader, model)
    return train_err, train_loss, test_err, test_loss
