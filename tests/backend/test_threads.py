"""backend_ndarray/threads.py: the CPU backend runs one thread per physical core, waiting passively, unless the
user says otherwise, and gc.py's header says when other work shares the machine (issue #27: a demo that does not
stall on a shared machine)."""
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
