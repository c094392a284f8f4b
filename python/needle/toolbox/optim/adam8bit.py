"""8-bit Adam (Dettmers et al. 2021, "8-bit Optimizers via Block-wise Quantization").

Adam's update, unchanged, with both moments stored in 8 bits between steps: block-wise quantization
(quantization.py) with a signed dynamic map for the first moment and an unsigned one for the second. A step
dequantizes a parameter's moments to float32, updates them and the parameter exactly as Adam does, and
quantizes them again; so the state costs 2 bytes per parameter plus 2 float32 absmax per block (2.03 bytes at
blocks of 256) instead of Adam's 8. As in the paper and bitsandbytes, tensors with fewer than `min_8bit_size`
elements keep float32 state (they are few bytes, and often the sensitive ones: biases, norms), and so do the
parameters named in `fp32_state_params` (the paper's "stable embedding" recipe keeps the embedding's 32-bit).
"""
from ...backend_selection import array_api
from ...optim.adam import Adam
from ...optim.optimizer import flat_view, widen
from .quantization import dequantize, device_code, dynamic_map


class Adam8bit(Adam):
    """Adam whose moments m, v are stored block-wise in 8 bits for parameters of at least `min_8bit_size`
    elements (not in `fp32_state_params`); the arithmetic of a step is Adam's, in float32.

    The second moment is stored as its square root, sqrt(v) (unsigned map), which has the dynamic range of m.
    Stored as v, its range is the square of m's: an element 1e-4 of its block's largest gradient has
    v / absmax(v) ~ 1e-8, below the map's smallest value (3e-7), and comes back 0 while its m (5e-7 resolves)
    does not, so m / (sqrt(v) + eps) is orders of magnitude too large. On the PTB Transformer LM, whose output
    layer mixes frequent and rare words in one block, storing v itself diverged to NaN within 16 steps.
    """

    def __init__(self, params, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, block_size=256,
                 min_8bit_size=4096, fp32_state_params=(), master_weights=None, stochastic_rounding=False,
                 offload_state=False, in_backward=False):
        super().__init__(params, lr, beta1, beta2, eps, weight_decay, master_weights, stochastic_rounding,
                         offload_state, in_backward)
        if isinstance(block_size, bool) or int(block_size) != block_size or block_size < 1 or \
                block_size & (block_size - 1):
            raise ValueError(f"Adam8bit: block_size must be a positive power of two, got {block_size!r}")
        if isinstance(min_8bit_size, bool) or int(min_8bit_size) != min_8bit_size or min_8bit_size < 0:
            raise ValueError(f"Adam8bit: min_8bit_size must be a non-negative integer, got {min_8bit_size!r}")
        self.block_size, self.min_8bit_size = int(block_size), int(min_8bit_size)
        self.fp32_state_params = set(fp32_state_params)
        optimized = {id(q) for q in self.params}
        unknown = [p for p in self.fp32_state_params if id(p) not in optimized]
        if unknown:
            raise ValueError(f"Adam8bit: {len(unknown)} of fp32_state_params are not among the optimized parameters")
        self.maps = {"m": dynamic_map(signed=True), "v": dynamic_map(signed=False)}  # v >= 0: no sign to store
        self._device_maps = {}  # (slot, device name) -> the map as an array on that device, made once

    def end_step(self):
        if self.offload_state:
            self._device_maps.clear()  # offloaded: not even the maps stay on the device between steps

    def _stored(self):
        yield from super()._stored()
        if not self.offload_state:
            yield from self._device_maps.values()  # the two 1 KiB maps are device state too

    def options(self):
        """Adam's options, and which parameters have 8-bit moments (fp32_state_params as their indices)."""
        fp32 = [i for i, p in enumerate(self.params) if p in self.fp32_state_params]
        return {**super().options(), "block_size": self.block_size, "min_8bit_size": self.min_8bit_size,
                "fp32_state_params": fp32}

    def _state_layout(self, p, slot):
        """An 8-bit moment is (uint8 codes of p's shape, float32 absmax per block of `block_size`)."""
        if slot in ("m", "v") and self.quantizes(p):
            shape = tuple(p.shape)
            return [(shape, "uint8"), ((-(-p.realize_cached_data().size // self.block_size),), "float32")]
        return super()._state_layout(p, slot)

    def quantizes(self, p):
        """Whether parameter p's moments are stored in 8 bits."""
        return p.realize_cached_data().size >= self.min_8bit_size and p not in self.fp32_state_params

    def _map(self, slot, device):
        key = (slot, str(device))
        if key not in self._device_maps:
            self._device_maps[key] = device_code(self.maps[slot], device)
        return self._device_maps[key]

    def allocate_state(self):
        """The moments (Optimizer.allocate_state), and the two code maps on each device with 8-bit moments (device
        state too, unless offloaded: then each step makes them for its updates and frees them at its end)."""
        super().allocate_state()
        for p in self.params:
            if p.requires_grad and self.quantizes(p) and not self.offload_state:
                self._map("m", p.device), self._map("v", p.device)

    def update_bytes(self, p):
        state, workspace = super().update_bytes(p)
        maps = sum(1024 for slot in ("m", "v") if (slot, str(p.device)) not in self._device_maps)  # 256 float32
        # Offloaded, a step's first quantized update makes the maps, which stay until the step ends: counted for
        # every update (at most 2 KiB over).
        return state, workspace + (maps if self.quantizes(p) else 0)

    def fused_in_place(self, p):
        if not self.quantizes(p):
            return super().fused_in_place(p)
        dtype = str(p.realize_cached_data().dtype)
        return dtype == "float32" or (dtype == "bfloat16" and not self._keeps_master(p))

    def update_parameter(self, p, theta, grad):
        if not self.quantizes(p):
            return super().update_parameter(p, theta, grad)
        (m, new), (v, _) = self._open(p, "m"), self._open(p, "v")
        if new:  # the first step: zero moments (a zero absmax turns every byte into 0)
            for array in m + v:
                array.fill(0)
        # Dequantize, Adam's update in float32, requantize: one pass per block in the backend (adam8bit_step),
        # the moments updated in place; the parameter too when it is float32, else a chunk of blocks at a time.
        codes = self._map("m", p.device), self._map("v", p.device)
        if self.fused_in_place(p) and str(grad.dtype) in ("float32", str(theta.dtype)):
            # float32, or a bfloat16 parameter without a master copy: widened, updated and rounded back (as
            # `_update` rounds) inside the kernel, in place (stochastic rounding: bfloat16 parameters only)
            array_api.adam8bit_step(theta, grad, m, v, *codes, self.block_size, *self._hyper(),
                                    weight_decay=self.weight_decay, out=theta, rounding_seed=self.rounding_seed(p))
        else:
            flat = [flat_view(a) for a in m + v]
            for start, th, g in self._chunks(theta, grad, align=self.block_size):
                blocks = slice(start // self.block_size, -(-(start + g.size) // self.block_size))
                chunk = [array_api.astype(a[start:start + g.size] if k % 2 == 0 else a[blocks], a.dtype)
                         for k, a in enumerate(flat)]  # copies of the chunk's bytes and absmax
                th = array_api.adam8bit_step(th, g, chunk[:2], chunk[2:], *codes, self.block_size, *self._hyper())
                for k, (a, c) in enumerate(zip(flat, chunk)):
                    a[slice(start, start + g.size) if k % 2 == 0 else blocks] = c
                self._update(p, theta, th, start)
        self._finish(p, theta, m=m, v=v)

    def _decode(self, p, slot, stored):
        """A stored moment as float32 (m, or v = sqrt(v) squared); the step itself works on the bytes."""
        if isinstance(stored, tuple):  # (q, absmax)
            value = dequantize(*stored, self._map(slot, p.device), self.block_size)
            return value * value if slot == "v" else value
        return widen(stored)
