"""The C++ CPU backend's copy thread (backend_ndarray/copy_thread.py, src/cpu/copy_thread.h): offloading's host
copies run beside the compute, in issue order, exact, with clear errors for what it cannot copy."""
import numpy as np
import pytest

import needle as ndl
from needle.backend_ndarray import NDArray, array_api
from needle.backend_ndarray.copy_thread import covers_its_buffer

DEVICE = ndl.cpu()
pytestmark = pytest.mark.skipif(not DEVICE.enabled(), reason="the compiled CPU backend is not built")


def device_array(shape, dtype="float32", seed=0):
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return NDArray(values, device=DEVICE).astype(dtype)


def test_only_the_cpp_cpu_backend_has_a_copy_thread():
    assert array_api.copy_thread(DEVICE) is not None
    assert array_api.copy_thread(ndl.cpu_numpy()) is None  # the reference: synchronous copies
    assert array_api.copy_thread(ndl.cuda()) is None  # cuda: its copy stream


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
def test_a_copy_to_the_host_and_back_is_the_same_bytes(dtype):
    thread = array_api.copy_thread(DEVICE)
    a = device_array((7, 33), dtype)
    host = np.empty(a.size * a.buffer.itemsize, dtype=np.uint8)
    thread.to_host(a, host).result()
    assert host.tobytes() == a.numpy().tobytes()
    back = array_api.empty(a.shape, dtype=dtype, device=DEVICE)
    thread.to_device(host, back).result()
    assert back.numpy().tobytes() == a.numpy().tobytes()


def test_copies_run_in_issue_order_so_a_copy_back_reads_what_the_one_before_wrote():
    thread = array_api.copy_thread(DEVICE)
    for seed in range(5):  # (an unordered queue would fail some of these without any wait in between)
        a = device_array((256, 257), seed=seed)
        host = np.zeros(a.size * 4, dtype=np.uint8)
        back = array_api.empty(a.shape, device=DEVICE)
        thread.to_host(a, host)
        copy = thread.to_device(host, back)
        copy.result()
        np.testing.assert_array_equal(back.numpy(), a.numpy())
        assert copy.result() is None  # waiting twice is harmless


def test_the_copy_thread_copies_whole_buffers_and_says_what_it_got_otherwise():
    thread = array_api.copy_thread(DEVICE)
    a = device_array((6, 8))
    view = a[1:3, :]  # a slice of the buffer, not all of it
    assert covers_its_buffer(a) and not covers_its_buffer(view) and not covers_its_buffer(a.permute((1, 0)))
    with pytest.raises(ValueError, match=r"CopyThread.to_host: needs a compact array.*shape \(2, 8\)"):
        thread.to_host(view, np.empty(64, dtype=np.uint8))
    with pytest.raises(ValueError, match="copy_thread_to_host"):
        thread.to_host(a, np.empty(10, dtype=np.uint8))  # too few bytes
    with pytest.raises(TypeError, match="C-contiguous"):
        thread.to_host(a, np.empty((48, 8), dtype=np.uint8)[:, ::2])
    with pytest.raises(ValueError, match="copy_thread_to_device"):
        thread.to_device(np.zeros(3, dtype=np.float32), a)
