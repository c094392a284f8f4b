"""The memory toolbox's optimizers: 8-bit Adam and Adafactor (`ndl.optim.Adam8bit`, `ndl.optim.Adafactor`)."""
