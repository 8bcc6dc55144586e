"""Shared fixtures: the implementations a test body runs under, the `gpu` and `long` markers,
and a compilation cache shared by the suite's processes.

`impl` runs a test over "xla", "pallas-interpret" and "pallas"; `kernel_impl` over the two
kernel ones. "pallas" carries the `gpu` marker: it is skipped unless jax's default backend is a
GPU, and `pytest -m gpu` runs exactly the GPU checks (see tests/test_kernels.py). A `long`
test runs only with `--long` (`scripts/test.sh --long`): the layer-level runs of the kernels in
interpret mode, the full property runs, the soak, the mesh sweeps; the default suite keeps
every guarantee on tiny shapes and every kernel against its twin.

The default suite compiles for the CPU at XLA's optimization level 0 (`FAST_CPU_FLAGS`; both
sides of every comparison alike); `--long` at XLA's default. On the CPU, compiled programs go
to jax's persistent compilation cache in `.pytest_cache/jax` (shared by the pytest-xdist
workers and later runs): the module-level `jax.clear_caches()` below would otherwise
recompile, in every module, the programs the modules share. A cached executable is the
program XLA compiled, so a test's bits are the same; tests that count compiles count traces
(jax traces whether or not the cache holds the program).
"""

import gc
import importlib.util
import os
import re

import jax
import pytest

jax.config.update("jax_enable_x64", False)

# XLA:CPU at optimization level 0 compiles the suite's programs faster (compiling is most of
# the suite's time).
# Every comparison's two sides (and every subprocess a test starts) compile under the same
# flags; `--long` runs at XLA's default level, the one a user's CPU program compiles at.
FAST_CPU_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def pytest_configure(config):
    # Before the first use of a backend: XLA reads XLA_FLAGS when it creates one.
    cuda = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    if not config.getoption("--long") and not cuda:  # a GPU machine compiles as users do
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_CPU_FLAGS}".strip()
    if jax.default_backend() == "cpu":
        jax.config.update("jax_compilation_cache_dir",
                          os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                       ".pytest_cache", "jax"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

PALLAS = pytest.param("pallas", marks=pytest.mark.gpu)


@pytest.fixture(params=["xla", "pallas-interpret", PALLAS])
def impl(request) -> str:
    return request.param


@pytest.fixture(params=["pallas-interpret", PALLAS])
def kernel_impl(request) -> str:
    return request.param


# A layer-level test body (whole steps, the model, the loop): its interpret-mode run compiles
# every kernel of the step for the CPU, so it runs under --long; the kernels themselves are
# checked in interpret mode by the default suite, the whole step compiled by `pytest -m gpu`.
LONG_INTERPRET = pytest.param("pallas-interpret", marks=pytest.mark.long)


@pytest.fixture(params=["xla", LONG_INTERPRET, PALLAS])
def layer_impl(request) -> str:
    return request.param


@pytest.fixture(params=[LONG_INTERPRET, PALLAS])
def layer_kernel_impl(request) -> str:
    return request.param


# Tests that run only with --long, by node id (a regular expression matched from the start),
# beside the ones marked in their files: the heavier of several cases of one property.
LONG = [
    r"tests/test_index_ring.py::test_the_kernel_with_a_ring_of_every_position_gives_the_same_bits"
    r"\[pallas-interpret-",
    r"tests/test_serve_loop.py::test_weights_in_place_programs",
    r"tests/test_serve_loop.py::test_scripted_speculation_equals_plain_on_random_caches",
    r"tests/test_engine_loop.py::test_sampled_snapshot_continues_identically",
    r"tests/test_model.py::test_new_rows_land_in_their_place_on_the_tiny_model",
    r"tests/test_reliability_findings.py::test_1_garbage_in_one_sequence_never_reaches_another"
    r"\[.*-pallas-interpret\]",
    r"tests/test_pool_scores_mgpu.py::test_kernel_lowers_for_cuda\[shape([3-9]|1[0-4])-",
    r"tests/test_write_kernels.py::test_xla_store_writes_the_kernels_bytes\[(24|64)-",
    r"tests/test_write_kernels.py::test_writes_read_stacked_weights_in_place\[xla\]",
    r"tests/test_merge_splits.py::test_merge_kernel_matches_twin\[(2-33|2-5|4-1)-",
    r"tests/test_merge_splits.py::test_merge_kernel_writes_the_padded_block\[(3-3-2|1-4-3)\]",
    r"tests/test_merge_splits.py::test_merge_kernel_scales_half_partials\[(4-1|3-3)-",
    r"tests/test_attend_prep.py::test_prep_is_bitwise_the_jnp_twin\[[12]\]",
    r"tests/test_attend_prep.py::test_prep_reads_the_first_rows_in_place\[2\]",
    r"tests/test_colaunch.py::test_readers_of_a_split_gemms_parts_give_the_summed_results",
    r"tests/test_pool_topk_triton.py::test_kernel_in_triton_interpreter_equals_the_total_order",
    r"tests/test_matmul_kernel.py::test_a_stacked_weight_read_in_place_gives_the_slice_bits",
    r"tests/test_matmul_kernel.py::test_a_bf16_result_is_the_f32_result_rounded",
    r"tests/test_kernels.py::test_layer_kernels_match_xla\[pallas-interpret\]",
    r"tests/test_kernels.py::test_sparse_attend_live_rows_hint_only_moves_the_split",
    r"tests/test_kernels.py::test_sparse_attend_split_counts_agree",
    r"tests/test_attend_kernel.py::test_prompt_rows_carry_the_scaled_q_only_where_the_attend",
    r"tests/test_engine_loop.py::test_stop_tokens_end_sequences",
    r"tests/test_engine_loop.py::test_draft_model_engine_equals_plain",
    r"tests/test_serve_loop.py::test_stop_token_ends_a_sequence_the_same_with_speculation",
    r"tests/test_index_ring.py::test_serving_loop_rewinds_stay_within_the_ring",
    r"tests/test_serving_paths.py::test_chunked_prefill_equals_one_prefill_and_per_row_selection"
    r"\[float32\]",
    r"tests/test_paged_vs_reference.py::test_bf16_weights_match_reference_within_bf16_rounding",
    r"tests/test_serve_loop.py::test_draft_model_cache_follows_the_sequence_through_rejections",
    r"tests/test_serve_loop.py::test_sampling_is_a_function_of_logits_key_and_position",
    r"tests/test_index_ring.py::test_ring_write_equals_the_full_row_write_bit_for_bit\[float32\]",
    r"tests/test_colaunch.py::test_topk_matmul_is_the_two_kernels_bit_for_bit\[pallas-interpret-",
    r"tests/test_select_property.py::SelectionTest::test_fast_selection_equals_reference_with_ties"
    r"__with_jit",
    r"tests/test_merge_splits.py::test_merge_kernel_scales_half_partials",
    r"tests/test_attend_kernel.py::test_scaled_q_abs_rounds_q_as_the_amax_scales_do",
    r"tests/test_attend_kernel.py::test_mosaic_arithmetic_meets_the_f16_bound",
    r"tests/test_kernels.py::test_pool_topk_equals_the_total_order\[pallas-interpret-",
    r"tests/test_serving_paths.py::test_speculate_reject_rewind_continue_equals_never_speculating"
    r"\[float32\]",
    r"tests/test_paged_vs_reference.py::test_fp32_cache_matches_reference\[4-False\]",
    r"tests/test_select_property.py::SelectionTest::test_fast_selection_equals_reference_with_ties"
    r"__without_jit",
    r"tests/test_index_ring.py::test_ring_kernel_matches_twin\[pallas-interpret-",
]


def _interpret_cases_after_the_first(items) -> set[str]:
    """Node ids of each test function's "pallas-interpret" cases but its first: the default
    suite runs a kernel's every property in interpret mode once, --long at every shape."""
    seen, rest = set(), set()
    for item in items:
        if "pallas-interpret" in item.nodeid.partition("[")[2] and "long" not in item.keywords:
            fn = item.nodeid.partition("[")[0]
            (rest if fn in seen else seen).add(item.nodeid if fn in seen else fn)
    return rest


def pytest_collection_modifyitems(config, items):
    long = pytest.mark.skip(reason="a long test: runs with --long (scripts/test.sh --long)")
    gpu = pytest.mark.skip(reason=f"needs a GPU; jax's backend is {jax.default_backend()!r}")
    on_gpu = jax.default_backend() == "gpu"
    later = _interpret_cases_after_the_first(items)
    for item in items:
        if item.nodeid in later or any(re.match(p, item.nodeid) for p in LONG):
            item.add_marker(pytest.mark.long)
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(gpu)
        elif "long" in item.keywords and not config.getoption("--long"):
            item.add_marker(long)


def pytest_addoption(parser):
    # The reliability property tests and soak (tests/test_reliability_*.py) run CI-sized by
    # default; --long runs them at full length.
    parser.addoption("--long", action="store_true", default=False,
                     help="also run the tests marked `long`, and the reliability property tests "
                          "and the engine soak at full length")


# Memory mappings a process may hold before the module-level release below drops jax's
# compiled programs: well under the kernel's limit (vm.max_map_count, 65530 by default), with
# room for one more heavy module (~15K).
MAPPINGS_BEFORE_RELEASE = 20_000


def _mappings() -> int | None:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After a test module, drop jax's compiled programs once the process holds many memory
    mappings. Every XLA:CPU executable maps its code into the process, and the suite's
    thousands of programs (interpret-mode kernels compile large ones) passed the kernel's
    limit of 65530 mappings per process (vm.max_map_count): LLVM then aborted the process
    inside a compile (SIGABRT, no message; ~15K mappings per heavy module). Cleared, a
    process's mappings go back to ~600; kept below the budget, the next modules reuse the
    programs they share with the earlier ones."""
    yield
    n = _mappings()
    if n is None or n > MAPPINGS_BEFORE_RELEASE:
        jax.clear_caches()
        gc.collect()
