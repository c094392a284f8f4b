"""Which array library backs Tensors, chosen once at import by the NEEDLE_BACKEND environment variable.

`nd` (default): needle's own NDArray (C++ `cpu()`, CUDA `cuda()`, NumPy-reference `cpu_numpy()`).
`np`: plain numpy.ndarray values, as in the course's early homeworks.

`array_api` is the module of NumPy-like functions ops call: `backend_ndarray.array_api` or `backend_numpy`.
"""
import os

BACKEND = os.environ.get("NEEDLE_BACKEND", "nd")

if BACKEND == "nd":
    from .backend_ndarray import array_api  # the NumPy-like functions ops call, on NDArrays
    from .backend_ndarray import (
        BackendDevice as Device,
        NDArray,
        all_devices,
        cpu,
        cpu_numpy,
        cuda,
        default_device,
    )

    def device_of(array):
        return array.device

elif BACKEND == "np":
    import numpy

    from . import backend_numpy as array_api
    from .backend_numpy import Device, all_devices, cpu, cpu_numpy, cuda, default_device, device_of

    NDArray = numpy.ndarray
else:
    raise RuntimeError(f"NEEDLE_BACKEND must be 'nd' or 'np', got {BACKEND!r}")

__all__ = ["BACKEND", "Device", "NDArray", "all_devices", "array_api", "cpu", "cpu_numpy", "cuda",
           "default_device", "device_of"]
