"""needle's memory toolbox: what practitioners reach for beside checkpointing, loaded only when used.

The core (autograd, backward, ops, nn, optim's SGD and Adam, checkpointing and its Budget) never imports it; it
plugs in through the core's seams: a `Store` (needle/store.py) keeps a value that left memory — host memory
(offload.py) or k-bit codes (compress.py); `memory_hook` lets the recorder (memory/) watch every allocation; the
Budget is extended (budget_offload.py) to offload, park gradients and price with a measured cost model
(cost_model.py); checkpoint_optimal.py solves the same choice exactly. Beside them: few-bit activations
(fewbit.py), mixed precision (amp.py), 8-bit and factored optimizers (optim/), and parallel training (distributed/).
Their public names stay where they were (`ndl.memory`, `ndl.autocast`, `checkpoint.compress`, `optim.Adam8bit`,
...), served on first use by needle/lazy.py.
"""
