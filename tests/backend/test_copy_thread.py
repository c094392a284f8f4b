"""The C++ CPU backend's copy thread (backend_ndarray/copy_thread.py, src/cpu/copy_thread.h): offloading's host
copies run beside the compute, in issue order, exact, with clear errors for what it cannot copy."""
import subprocess
import sys
import textwrap

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


def _run(script):
    """`script` in a Python process of its own (a crash or a hang there fails the test, not the test run)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=60)


def test_a_copy_holds_its_arrays_until_a_wait_sees_it_done():
    """`to_host(a, host); del a; result()` freed the buffer the copy thread was still reading (a segfault once it was
    unmapped). A copy holds both arrays now, and lets go of them at the wait: an array dropped early is freed then,
    and one the caller keeps is freed when the caller drops it, as the ledger counts (offload.py's rules)."""
    out = _run("""
        import numpy as np
        import needle as ndl
        from needle.backend_ndarray import NDArray, array_api
        device = ndl.cpu()
        thread, current = array_api.copy_thread(device), lambda: device.memory_stats()["current_bytes"]
        values = np.random.default_rng(0).standard_normal(1 << 22).astype(np.float32)  # 16 MiB: mapped, unmapped
        device.mod.set_cache_limit(0)  # a freed buffer goes back to the OS at once
        base = current()
        a, host = NDArray(values, device=device), np.empty(values.nbytes, np.uint8)
        copy = thread.to_host(a, host)
        del a
        held = current() - base
        copy.result()
        print(held == values.nbytes, current() == base, host.view(np.float32).tobytes() == values.tobytes())
        back, host = array_api.empty(values.shape, device=device), values.copy()
        copy = thread.to_device(host, back)
        del host
        copy.result()
        print(back.numpy().tobytes() == values.tobytes())
        kept = NDArray(values, device=device)
        thread.to_host(kept, np.empty(values.nbytes, np.uint8)).result()
        before = current()
        del kept
        print(before - current() == values.nbytes)
    """)
    assert out.returncode == 0, out.stderr  # (-11: the segfault)
    assert out.stdout.split() == ["True"] * 5, out.stdout


def test_waiting_for_a_ticket_never_issued_is_an_error_not_a_hang():
    out = _run("""
        import needle as ndl
        mod = ndl.cpu().mod
        try:
            mod.copy_thread_wait(10**6)
        except ValueError as err:
            print(err)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("copy_thread_wait: ticket 1000000 was never issued (the last one issued is "), out
