"""The CMake build: it degrades instead of failing, and only the default build folder writes into the package.

Every configure here runs in a temporary folder, never in the repository's build/, and every check of "where do
the modules go" that would write into a package runs on a copy of the sources, so these tests never change the
modules that `import needle` loads. They need cmake and a C++ compiler (skipped without them).
"""
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PACKAGE_DIR = os.path.join("python", "needle", "backend_ndarray")
REASON = "needle: CUDA backend not built: "


@pytest.fixture(autouse=True)
def toolchain():
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    compilers = [os.environ.get("CXX"), "c++", "g++", "clang++"]
    if not any(shutil.which(c) for c in compilers if c):
        pytest.skip("no C++ compiler found (CXX, c++, g++, clang++)")


def cmake(*args):
    result = subprocess.run(["cmake", *args], capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, f"cmake {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def configure(source, build, *defines):
    # The interpreter running the tests, as `make` passes its own: CMakeLists.txt asks it for pybind11's CMake dir.
    return cmake("-S", source, "-B", build, f"-DPython_EXECUTABLE={sys.executable}", *defines)


def cache_value(build, name):
    with open(os.path.join(build, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split("=", 1)[1].strip()
    return None


def compiled_modules(directory):
    """{file name: (inode, mtime)} of the compiled backend modules in a folder: what a build would replace."""
    modules = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("ndarray_backend_c") and not name.endswith(".py"):
            stat = os.stat(os.path.join(directory, name))
            modules[name] = (stat.st_ino, stat.st_mtime_ns)
    return modules


def known_cuda_compiler():
    """-DCMAKE_CUDA_COMPILER=<nvcc> when build/ (which `make test` configured first) found a working one: then
    check_language(CUDA) need not test it again in a throw-away project (4 s); the CUDA language is still enabled,
    so find_package(CUDAToolkit) is reached as without it. Nothing when build/ has none."""
    nvcc = cache_value(os.path.join(REPO, "build"), "CMAKE_CUDA_COMPILER") if os.path.exists(
        os.path.join(REPO, "build", "CMakeCache.txt")) else None
    return [f"-DCMAKE_CUDA_COMPILER={nvcc}"] if nvcc and "NOTFOUND" not in nvcc and os.path.isfile(nvcc) else []


def cpu_backend_without_cuda_toolkit(folder):
    """Configure with find_package(CUDAToolkit) disabled, in a build folder other than build/, and build the CPU
    module: (configure's output, the build folder, the package's modules before)."""
    before = compiled_modules(os.path.join(REPO, PACKAGE_DIR))
    build = os.path.join(folder, "build-second")
    # Debug without -g: the quickest build (no -O3, no LTO, no debug info); what is tested is that it builds, not
    # how fast it runs or how it debugs.
    out = configure(REPO, build, "-DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON", "-DCMAKE_BUILD_TYPE=Debug",
                    "-DCMAKE_CXX_FLAGS_DEBUG=", *known_cuda_compiler())
    cmake("--build", build, "-j2", "--target", "ndarray_backend_cpu")
    return out, build, before


def copy_sources(root):
    """The files CMakeLists.txt needs for a CPU-only configure, under a new source root."""
    os.makedirs(os.path.join(root, "src"))
    shutil.copy(os.path.join(REPO, "CMakeLists.txt"), root)
    shutil.copy(os.path.join(REPO, "src", "ndarray_backend_cpu.cc"), os.path.join(root, "src"))
    return root


@pytest.mark.parametrize("folder, defines, into_package", [
    pytest.param("build", [], True, id="make"),  # make, cmake -S . -B build
    pytest.param("build/cp311-cp311-linux_x86_64", ["-DSKBUILD=2", "-DSKBUILD_STATE=editable"], True,
                 id="pip-install-e"),
    pytest.param("build-asan", [], False, id="second-folder"),
    pytest.param("build-asan", ["-DNEEDLE_INSTALL_INTO_PACKAGE=ON"], True, id="second-folder-asked"),
])
def test_only_the_default_build_folder_builds_into_the_package(tmp_path, folder, defines, into_package):
    # On a copy of the sources without the .cu file: configure-only, quick, and no real package is touched.
    source = copy_sources(str(tmp_path / "needle"))
    build = os.path.join(source, folder)
    out = configure(source, build, *defines)
    module_dir = os.path.join(source, PACKAGE_DIR) if into_package else build
    assert f"needle: modules go to {module_dir}\n" in out, out
    assert REASON + "src/ndarray_backend_cuda.cu does not exist" in out


def test_build_without_cuda_toolkit_builds_cpu_backend_and_leaves_the_package_alone(tmp_path):
    """find_package(CUDAToolkit) failing (here: disabled) is one status line, and the CPU module still builds;
    a build folder other than build/ keeps its module to itself."""
    out, build, before = cpu_backend_without_cuda_toolkit(str(tmp_path))
    reasons = [line for line in out.splitlines() if REASON in line]
    assert len(reasons) == 1 and reasons[0].split(REASON, 1)[1].strip(), out
    assert cache_value(build, "NEEDLE_INSTALL_INTO_PACKAGE") == "OFF"
    assert any(name.startswith("ndarray_backend_cpu") for name in compiled_modules(build))
    assert compiled_modules(os.path.join(REPO, PACKAGE_DIR)) == before  # no module replaced, added or removed
