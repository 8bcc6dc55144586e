"""The benchmark harness's Hugging Face baseline (its cache fill, its batch in chunks, every
step point carrying an HF time) and the device sweeps' row helpers, on the CPU."""

import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks import hf_baseline
from benchmarks.__main__ import main as bench_main
from benchmarks.harness import sweep_row, sweep_times
from benchmarks.workloads import random_hf_tensors
from dsa_jax.shapes import tiny


def test_hf_baseline_for_every_step_point(tmp_path):
    """The Hugging Face block is timed for the decode, verify, batch and prefill points (tiny
    config on the CPU), and each point carries its HF time and ratio."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    rc = bench_main(["--smoke", "--only", "hf,decode,prefill", "--impls", "xla",
                     "--no-progress", "--out", str(tmp_path), "--name", "hf.json"])
    assert rc == 0
    with open(tmp_path / "hf.json") as f:
        res = json.load(f)
    hf = res["baselines"]["hf"]
    for kind in ("verify", "batch", "prefill"):
        (entry,) = hf[kind].values()
        assert any((entry.get(i) or {}).get("median_us") for i in ("eager", "sdpa")), entry
    for p in res["points"]:
        if p["hf_key"] is None:  # the public-decode point has no HF counterpart
            assert p["name"] == "public-decode-b1" and p["hf_us"] is None
            continue
        assert p["hf_us"] is not None and p["hf_us"] > 0, p["name"]
        assert p["ratio_vs_hf"] == pytest.approx(p["median_us"] / p["hf_us"])


def test_hf_cache_fill_tiles_a_real_forward():
    """The HF cache is filled by HF's own forward over a few tokens, then tiled along the
    sequence axis: the cache reports the context, and its tensors repeat with that period."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    cfg = tiny(implementation="xla")
    attn, config = hf_baseline.hf_block(cfg, random_hf_tensors(cfg, 0), "cpu")
    gen = torch.Generator().manual_seed(0)
    cache, how = hf_baseline.fill_tiled(cfg, attn, config, 42, "cpu", gen, fill_tokens=16)
    assert cache.get_seq_length() == 42 and "tiled" in how
    tensors = {k: v for k, v in cache.layers[0].__dict__.items()
               if isinstance(v, torch.Tensor) and v.dim() > 1}
    assert tensors
    for name, t in tensors.items():
        (d,) = [i for i, n in enumerate(t.shape) if n == 42]
        assert torch.equal(t.narrow(d, 16, 16), t.narrow(d, 0, 16)), name
        assert torch.equal(t.narrow(d, 32, 10), t.narrow(d, 0, 10)), name
        assert t.numel() == 0 or t.float().std() > 0, name  # 5.23 keeps an empty rope part


def test_hf_batch_in_chunks_when_it_does_not_fit():
    """64 sequences that do not fit run as calls of fewer; the time is per 64 and says so."""
    torch = pytest.importorskip("torch")
    calls = []

    def run(b):
        calls.append(b)
        if b > 16:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 32 GiB")
        return True, {"median_us": 10.0 * b, "min_us": 9.0 * b, "max_us": 11.0 * b}, "fill"

    out = hf_baseline.in_chunks(run, 64)
    assert calls == [64, 32, 16]
    assert out["median_us"] == 4 * 160.0 and out["min_us"] == 4 * 144.0
    assert out["chunks"]["sequences_per_call"] == 16 and out["chunks"]["calls"] == 4
    assert "out of memory" in out["chunks"]["why"]
    small = hf_baseline.in_chunks(run, 8)
    assert small["median_us"] == 80.0 and "chunks" not in small




def test_sweep_row_records_failures_and_keeps_going(tmp_path):
    """A device sweep's row that raises is recorded (row and errors), and the file holds every
    row written so far."""
    res = {"results": [], "errors": []}
    path = tmp_path / "sweep.json"

    def ok(row):
        row["us"] = 1.5

    def bad(row):
        raise RuntimeError("Triton could not compile this tile")

    sweep_row(res, {"case": "a"}, ok, str(path))
    sweep_row(res, {"case": "b"}, bad, str(path))
    saved = json.loads(path.read_text())
    assert [r["case"] for r in saved["results"]] == ["a", "b"]
    assert saved["results"][0]["us"] == 1.5
    assert "RuntimeError: Triton could not compile" in saved["results"][1]["error"]
    assert len(saved["errors"]) == 1 and "Traceback" in saved["errors"][0]


def test_sweep_times_counts_calls_and_reports_both_times():
    """A sweep row's times: the call runs the timing's warm-up plus groups x inner times and
    the trace's 2 warm-up plus its calls (fewer of each when heavy); the wall time is positive,
    and off a GPU there is no kernel time."""
    calls = []
    f = jax.jit(lambda v: v * 2.0)
    x = jnp.arange(7.0) + 1.0

    def call():
        calls.append(1)
        return f(x)

    t = sweep_times(call, heavy=False)
    assert t["wall_us"] > 0 and t["kernel_us"] is None
    assert len(calls) == (2 + 15 * 10) + (2 + 20)
    calls.clear()
    sweep_times(call, heavy=True, heavy_inner=2)
    assert len(calls) == (2 + 5 * 2) + (2 + 3)
