"""backend_ndarray/threads.py: the CPU backend runs one thread per physical core, waiting passively, unless the
user says otherwise, and gc.py's header says when other work shares the machine (issue #27: a demo that does not
stall on a shared machine); and the C++ kernels give the same bits whatever the number of threads."""
import os
import subprocess
import sys

import pytest

import needle as ndl
from needle.backend_ndarray.threads import busy_machine_note, configure_openmp, physical_cores


def fake_sysfs(root, topology):
    """A /sys/devices/system/cpu with cpu<i>/topology/{physical_package_id,core_id} for each (package, core)."""
    for cpu, (package, core) in enumerate(topology):
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "physical_package_id").write_text(f"{package}\n")
        (folder / "core_id").write_text(f"{core}\n")
    return str(root)


def test_hyperthreads_of_one_core_count_once(tmp_path):
    sysfs = fake_sysfs(tmp_path, [(0, 0), (0, 1), (0, 0), (0, 1), (1, 0), (1, 0)])
    assert physical_cores(cpus=range(6), sysfs=sysfs) == 3
    assert physical_cores(cpus=[0, 2], sysfs=sysfs) == 1  # the process may run on two threads of one core


def test_without_topology_every_logical_cpu_counts(tmp_path):
    assert physical_cores(cpus=[0, 1, 2], sysfs=str(tmp_path)) == 3


def test_configure_openmp_fills_in_only_what_is_unset():
    environ = {}
    configure_openmp(environ)
    assert environ == {"OMP_NUM_THREADS": str(physical_cores()), "OMP_WAIT_POLICY": "PASSIVE"}
    environ = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}
    configure_openmp(environ)
    assert environ == {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}


@pytest.mark.parametrize("launcher", [{"MPI_LOCALNRANKS": "2", "PMI_SIZE": "2"},  # MPICH's hydra
                                      {"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "4"}])  # Open MPI
def test_ranks_on_one_machine_share_its_cores(launcher):
    # mpiexec -n 2 on 2 cores used to run 2 OpenMP threads per rank: 4 threads on 2 cores
    environ = dict(launcher)
    configure_openmp(environ, cores=2)
    assert environ["OMP_NUM_THREADS"] == "1"
    environ = dict(launcher)
    configure_openmp(environ, cores=1)  # never 0
    assert environ["OMP_NUM_THREADS"] == "1"
    environ = dict(launcher, OMP_NUM_THREADS="2")  # the user's choice stands
    configure_openmp(environ, cores=2)
    assert environ["OMP_NUM_THREADS"] == "2"


@pytest.mark.skipif(not ndl.cpu().enabled(), reason="the compiled CPU backend is not built")
@pytest.mark.parametrize("threads", [None, "1"])
def test_the_compiled_backend_starts_with_the_chosen_threads(threads):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    if threads:
        env["OMP_NUM_THREADS"] = threads
    code = ("import os, needle; print(needle.cpu().num_threads(), os.environ['OMP_NUM_THREADS'], "
            "os.environ['OMP_WAIT_POLICY'])")
    printed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    expected = threads or str(physical_cores())
    assert printed.stdout.split() == [expected, expected, "PASSIVE"]


def test_a_busy_machine_gets_a_note_and_a_quiet_one_none():
    note = busy_machine_note(load_average=1.4, cpus=2)
    assert "busy" in note and "load average 1.4" in note and "2 CPUs" in note
    assert busy_machine_note(load_average=0.3, cpus=2) is None


# Fused attention's and layer norm's C++ kernels, in one interpreter per thread count: attention_cases.run_attention
# (causal, with dropout), and layernorm_forward / layernorm_backward on a (300, 260) input, each output's bytes.
_KERNELS = """
import hashlib, sys
sys.path[:0] = ['tests/core', 'tests', 'python', 'apps']  # attention_cases, and the conftest it imports
import numpy as np
import attention_cases as t
from needle import backend_ndarray as nd

def digest(arrays):
    return hashlib.sha256(b''.join(a.tobytes() for a in arrays)).hexdigest()

out, grads = t.run_attention(nd.cpu(), t.make_arrays(3, 2, 150, 150, 8, 8, seed=7), True, True, dropout_p=0.1,
                             seed=5)
rng = np.random.default_rng(3)
x, g = (nd.array(rng.standard_normal((300, 260)).astype(np.float32)) for _ in range(2))
w, b = (nd.array(rng.standard_normal(260).astype(np.float32)) for _ in range(2))
norm = [nd.layer_norm(x, w, b, 1e-5), *nd.layer_norm_backward(x, w, g, 1e-5)]
print(digest([out] + grads), digest([a.numpy() for a in norm]))
"""


@pytest.mark.skipif(not ndl.cpu().enabled(), reason="the compiled CPU backend is not built")
def test_cpu_kernels_do_not_depend_on_the_thread_count():
    """The C++ kernels compute each element on one thread in a fixed order: OMP_NUM_THREADS=1 and 2 agree bit for
    bit (what makes gc on/off exact whatever the thread count). Attention; layer norm, whose rows, and columns for
    dw and db, are split over OpenMP threads."""
    repo = os.path.join(os.path.dirname(__file__), "..", "..")
    digests = []
    for threads in ("1", "2"):
        result = subprocess.run([sys.executable, "-c", _KERNELS], cwd=repo,
                                capture_output=True, text=True, timeout=300,
                                env=dict(os.environ, OMP_NUM_THREADS=threads), check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        digests.append(result.stdout.split())
    assert len(digests[0]) == 2 and digests[0] == digests[1], digests
