# needle build entry points.  `make` builds the compiled backends into python/needle/backend_ndarray/.
PYTHON ?= python3
BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= 2
# The CUDA module is built where it can run (this machine has a GPU) or where asked (`make cuda`); `make test`
# builds it wherever nvcc is, as the check that it compiles. Without it, `make` and `make demo` build the CPU one.
NEEDLE_CUDA ?= $(if $(wildcard /dev/nvidia0),ON,OFF)
# The CUDA module is compiled for the GPU of this machine, or, with none, as PTX for one virtual architecture: checked
# to compile (front end, device and host code, link) without ptxas's machine code, which nothing here could run
# (about a quarter less of the CUDA compile, the longest step of `make lib` on 2 cores); `make cuda-all` compiles it
# for every architecture CMakeLists.txt lists.
CUDA_ARCHS ?= $(if $(wildcard /dev/nvidia0),native,75-virtual)
CMAKE_ARGS ?=

# Re-installing is skipped while a stamp is newer than pyproject.toml and the package is still installed.
# DEPS_STAMP: everything `make test` needs (the package, its dependencies, the test, torch, distributed and
# experiment extras); DEMO_STAMP: what gc.py needs (the package, its runtime dependencies and the experiment extra);
# CORE_STAMP: what tests/core needs (the package, the test and torch extras). A full install covers them all.
DEPS_STAMP := $(BUILD_DIR)/.deps-installed
DEMO_STAMP := $(BUILD_DIR)/.deps-demo-installed
CORE_STAMP := $(BUILD_DIR)/.deps-core-installed

.PHONY: lib cuda cuda-off cuda-all install-deps install-demo-deps install-core-deps deps demo-deps core-deps browser-deps \
	test test-core demo figures clean

lib: pybind11
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DNEEDLE_CUDA=$(NEEDLE_CUDA) -DNEEDLE_MODULES=ON \
	  -DCMAKE_CUDA_ARCHITECTURES="$(CUDA_ARCHS)" -DNEEDLE_INSTALL_INTO_PACKAGE=ON \
	  -DPython_EXECUTABLE="$$(command -v $(PYTHON))" $(CMAKE_ARGS)
	cmake --build $(BUILD_DIR) -j$(JOBS)

# Both modules: the CUDA one for this machine's GPU, or without one as the compile check (PTX, see CUDA_ARCHS).
cuda:
	$(MAKE) lib NEEDLE_CUDA=ON

cuda-off:
	$(MAKE) lib NEEDLE_CUDA=OFF

# Every architecture of CMakeLists.txt's list (an empty CMAKE_CUDA_ARCHITECTURES selects it).
cuda-all:
	$(MAKE) lib NEEDLE_CUDA=ON CUDA_ARCHS=

# The CUDA backend on a GPU in one go (issue 51, docs/gpu.md): build for this GPU, its tests, compute-sanitizer,
# the tables, a summary in OUT. Without a GPU: `make cuda` (make test's compile check) and one line saying so.
OUT ?= gpu-check
.PHONY: gpu-check
gpu-check:
ifeq ($(wildcard /dev/nvidia0)$(shell command -v nvidia-smi 2>/dev/null),)
	@$(MAKE) --no-print-directory cuda
	@$(PYTHON) benchmarks/gpu_check.py --dry-run
else
	$(PYTHON) benchmarks/gpu_check.py --out $(OUT)
endif

# The in-tree build needs pybind11 in this interpreter (pip-installed if missing).
.PHONY: pybind11
pybind11:
	@$(PYTHON) -c "import pybind11" 2>/dev/null || $(PYTHON) -m pip install pybind11

# Everything pyproject.toml declares: the package (editable), its dependencies and the test, torch, distributed
# (mpi4py + MPICH wheels, so the MPI tests run) and experiment (gc.py's, which the tests run) extras.
# The editable install builds no module (NEEDLE_MODULES=OFF): `make lib`, the next step of test and demo, builds
# them in build/, so the C++ and CUDA code is compiled once, not twice.
install-deps:
	NEEDLE_MODULES=OFF $(PYTHON) -m pip install -e ".[test,torch,distributed,experiment]"
	@mkdir -p $(BUILD_DIR) && touch $(DEPS_STAMP) $(DEMO_STAMP) $(CORE_STAMP)

# The demo's: the package, its runtime dependencies (numpy, ml_dtypes) and the experiment extra (tqdm, matplotlib,
# GPUtil); no test tools or torch.
install-demo-deps:
	NEEDLE_MODULES=OFF $(PYTHON) -m pip install -e ".[experiment]"
	@mkdir -p $(BUILD_DIR) && touch $(DEMO_STAMP)

# tests/core's: the test tools and PyTorch (its oracle); no MPI, no plotting.
install-core-deps:
	NEEDLE_MODULES=OFF $(PYTHON) -m pip install -e ".[test,torch]"
	@mkdir -p $(BUILD_DIR) && touch $(CORE_STAMP)

$(DEPS_STAMP): pyproject.toml
	$(MAKE) install-deps

# A full install newer than pyproject.toml already holds everything the demo needs.
$(DEMO_STAMP): pyproject.toml
	@if [ $(DEPS_STAMP) -nt pyproject.toml ]; then touch $@; else $(MAKE) install-demo-deps; fi

# Like install-deps, but quick when nothing changed since the last install.  An editable install's import hook
# wins over sys.path, so the check also makes sure `needle` resolves to *this* checkout (not another clone).
deps: $(DEPS_STAMP)
	@$(PYTHON) -c "$$NEEDLE_IS_HERE" 2>/dev/null || $(MAKE) install-deps

demo-deps: $(DEMO_STAMP)
	@$(PYTHON) -c "$$NEEDLE_IS_HERE" 2>/dev/null || $(MAKE) install-demo-deps

$(CORE_STAMP): pyproject.toml
	@if [ $(DEPS_STAMP) -nt pyproject.toml ]; then touch $@; else $(MAKE) install-core-deps; fi

core-deps: $(CORE_STAMP)
	@$(PYTHON) -c "$$NEEDLE_IS_HERE" 2>/dev/null || $(MAKE) install-core-deps

define NEEDLE_IS_HERE
import importlib.util, os, sys
spec = importlib.util.find_spec("needle")
sys.exit(not (spec and spec.origin and os.path.samefile(spec.origin, "python/needle/__init__.py")))
endef
export NEEDLE_IS_HERE

# The memory timeline page's browser tests (tests/toolbox/test_memory_html.py) drive headless Chromium with chromedriver
# (Debian's chromium and chromium-driver). Installed where this is root with apt-get (the package lists are
# refreshed only if the install fails without); elsewhere those tests skip, saying why. Never fails `make test`.
BROWSER_PACKAGES := chromium chromium-driver
browser-deps:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y --no-install-recommends $(BROWSER_PACKAGES) \
	  || { apt-get update && apt-get install -y --no-install-recommends $(BROWSER_PACKAGES); } \
	  || echo "browser-deps: installing $(BROWSER_PACKAGES) failed: the browser tests will skip"; \
	else echo "browser-deps: no chromium/chromedriver and no root apt-get to install them: the browser tests will skip"; \
	fi

# The linter first (seconds), then every tier of tests/ (tests/conftest.py says what each holds), two processes at a
# time, one per core: tests/core (as if nothing were compiled, as `make test-core` runs it) beside the build, then
# tests/integration beside tests/backend and tests/toolbox (143 s and 225 s in a fresh-clone CI run; with backend
# beside integration instead, 368 s beside toolbox's 147 s); last, alone, the browser tests (they time a page's
# first draw). Each one's output comes whole when it ends; the last line adds them up (from their JUnit files in
# build/tests/).
TIER_REPORTS := $(BUILD_DIR)/tests
PYTEST = $(PYTHON) -m pytest -q
test: deps browser-deps
	$(PYTHON) -m ruff check python tests apps benchmarks notebooks gc.py
	@rm -rf $(TIER_REPORTS) && mkdir -p $(TIER_REPORTS)
	@$(MAKE) --no-print-directory -j2 --output-sync=target test-tier-core cuda
	@$(MAKE) --no-print-directory -j2 --output-sync=target test-tier-integration test-tiers-backend-toolbox
	$(PYTEST) --junitxml=$(TIER_REPORTS)/browser.xml -m browser tests/toolbox
	@$(PYTHON) -c "$$TALLY" $(TIER_REPORTS)/*.xml

# tests/core imports no compiled module (NEEDLE_TESTS_WITHOUT_COMPILED) and starts no process that would: the build
# may replace them meanwhile.
.PHONY: test-tier-core test-tier-integration test-tiers-backend-toolbox
test-tier-core:
	NEEDLE_TESTS_WITHOUT_COMPILED=1 $(PYTEST) --junitxml=$(TIER_REPORTS)/core.xml tests/core
test-tier-integration:
	$(PYTEST) --junitxml=$(TIER_REPORTS)/integration.xml tests/integration
test-tiers-backend-toolbox:
	$(PYTEST) --junitxml=$(TIER_REPORTS)/backend-toolbox.xml -m "not browser" tests/backend tests/toolbox

define TALLY
import sys, xml.etree.ElementTree as ET
n = dict(tests=0, failures=0, errors=0, skipped=0)
for path in sys.argv[1:]:
    for suite in ET.parse(path).getroot().iter("testsuite"):
        n = {key: n[key] + int(suite.get(key, 0)) for key in n}
failed = n["failures"] + n["errors"]
print(f"tests: {n['tests'] - failed - n['skipped']} passed, {failed} failed, {n['skipped']} skipped")
endef
export TALLY

# tests/core alone: the graph core on the NumPy reference device, as if nothing were compiled (whatever is built
# here), so it runs in a fresh clone with no build; about half a minute on 2 cores, once the dependencies are in.
test-core: core-deps
	NEEDLE_TESTS_WITHOUT_COMPILED=1 $(PYTEST) tests/core

# The install (mostly waiting on downloads) beside the compile (pybind11 first: the one thing the build needs).
demo:
	@$(MAKE) --no-print-directory pybind11
	@$(MAKE) --no-print-directory -j2 demo-deps lib
	$(if $(wildcard gc.py),$(PYTHON) gc.py,$(PYTHON) apps/train_demo.py)

# Every table of measured figures in README.md and docs/, run and stamped (long: see benchmarks/figures.py;
# `python benchmarks/figures.py --stale` lists those whose code changed since their stamp, `--run-stale` reruns
# only those; a stale figure does not fail `make test`).
figures: deps
	$(MAKE) lib
	$(PYTHON) benchmarks/figures.py

clean:
	rm -rf $(BUILD_DIR) python/needle/backend_ndarray/*.so
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
