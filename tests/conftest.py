"""Shared fixtures: the implementations a test body runs under, and the `gpu` marker.

`impl` runs a test over "xla", "pallas-interpret" and "pallas"; `kernel_impl` over the two
kernel ones. "pallas" carries the `gpu` marker: it is skipped unless jax's default backend is a
GPU, and `pytest -m gpu` runs exactly the GPU checks (see tests/test_kernels.py).
"""

import gc

import jax
import pytest

jax.config.update("jax_enable_x64", False)

PALLAS = pytest.param("pallas", marks=pytest.mark.gpu)


@pytest.fixture(params=["xla", "pallas-interpret", PALLAS])
def impl(request) -> str:
    return request.param


@pytest.fixture(params=["pallas-interpret", PALLAS])
def kernel_impl(request) -> str:
    return request.param


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU; jax's backend is {jax.default_backend()!r}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser):
    # The reliability property tests and soak (tests/test_reliability_*.py) run CI-sized by
    # default; --long runs them at full length.
    parser.addoption("--long", action="store_true", default=False,
                     help="run the reliability property tests and engine soak at full length")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop jax's compiled programs. Every XLA:CPU executable maps its
    code into the process, and the suite's thousands of programs (interpret-mode kernels
    compile large ones) passed the kernel's limit of 65530 mappings per process
    (vm.max_map_count): LLVM then aborted the process inside a compile (SIGABRT, no message;
    ~15K mappings per heavy module, measured). Cleared, a module's mappings go back to ~600."""
    yield
    jax.clear_caches()
    gc.collect()
