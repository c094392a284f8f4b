"""The 2-D convolution layer (NCHW in and out; ops.conv works in NHWC)."""
import math

from .. import init, ops
from .nn_module import Module, Parameter

__all__ = ["Conv"]


class Conv(Module):
    """Square-kernel 2-D convolution with "same" padding k // 2 and a stride: (N, C_in, H, W) -> (N, C_out, H', W').

    weight (k, k, C_in, C_out) = kaiming_uniform(C_in k^2, C_out k^2); bias (C_out,) = U(+-1 / sqrt(C_in k^2)).
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, bias=True, device=None, dtype="float32"):
        super().__init__()
        if isinstance(kernel_size, tuple):
            kernel_size = kernel_size[0]
        if isinstance(stride, tuple):
            stride = stride[0]
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = kernel_size
        self.stride = stride
        self.padding = kernel_size // 2
        fan_in, fan_out = in_channels * kernel_size**2, out_channels * kernel_size**2
        self.weight = Parameter(init.kaiming_uniform(
            fan_in, fan_out, shape=(kernel_size, kernel_size, in_channels, out_channels), device=device,
            dtype=dtype))
        self.bias = None
        if bias:
            bound = 1.0 / math.sqrt(fan_in)
            self.bias = Parameter(init.rand(out_channels, low=-bound, high=bound, device=device, dtype=dtype))

    def forward(self, x):
        shape = x.shape
        if len(shape) != 4 or shape[1] != self.in_channels:
            raise ValueError(f"Conv: expected input (N, {self.in_channels}, H, W), got {tuple(shape)}")
        nhwc = ops.transpose(ops.transpose(x, (1, 2)), (2, 3))  # (N, H, W, C_in)
        out = ops.conv(nhwc, self.weight, stride=self.stride, padding=self.padding)
        if self.bias is not None:
            k, p, s = self.kernel_size, self.padding, self.stride
            out_shape = (shape[0], (shape[2] + 2 * p - k) // s + 1, (shape[3] + 2 * p - k) // s + 1,
                         self.out_channels)
            bias = ops.reshape(self.bias, (1, 1, 1, self.out_channels))
            out = out + ops.broadcast_to(bias, out_shape)
        return ops.transpose(ops.transpose(out, (2, 3)), (1, 2))  # (N, C_out, H', W')
