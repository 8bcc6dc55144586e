"""CPU smoke test of the benchmark suite: `dsa_jax.bench.main(["--smoke", ...])` runs on the
tiny config and writes one JSON whose every point a script can check. No GPU, no torch."""

import glob
import json
import math
import os
import sys

import pytest

from dsa_jax import bench

POINT_KEYS = ("name", "median_us", "floor_us", "target", "met")


def _num_or_none(v):
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                         and math.isfinite(v))


@pytest.fixture(scope="module")
def smoke_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # tp8 runs the same code as tp1 with another config, and the HF baseline needs torch:
    # both are left out here to keep the test short.
    rc = bench.main(["--smoke", "--no-hf", "--no-levers", "--no-progress", "--skip", "tp8",
                     "--out", str(out), "--name", "smoke.json"])
    assert rc == 0
    files = glob.glob(os.path.join(out, "*.json"))
    assert [os.path.basename(f) for f in files] == ["smoke.json"]
    with open(files[0]) as f:
        return json.load(f)


def test_every_point_has_the_schema(smoke_result):
    res = smoke_result
    for key in ("command", "date", "machine", "jax_version", "ceilings", "points"):
        assert key in res, key
    assert res["command"].startswith("dsa-jax bench --smoke")
    assert res["ceilings"]["copy_GBps"] > 0 and res["ceilings"]["matmul_bf16_TFLOPs"] > 0
    points = res["points"]
    assert points
    for p in points:
        for key in POINT_KEYS:
            assert key in p, (p.get("name"), key)
        assert isinstance(p["name"], str) and p["name"]
        assert isinstance(p["target"], str) and p["target"]
        assert isinstance(p["met"], bool), p["name"]
        assert _num_or_none(p["median_us"]) and _num_or_none(p["floor_us"]), p["name"]
        for key in ("xla_us", "hf_us", "ratio_vs_xla", "ratio_vs_hf"):
            assert key in p and _num_or_none(p[key]), (p["name"], key)


def test_the_table_rows_are_all_there(smoke_result):
    names = [p["name"] for p in smoke_result["points"]]
    for prefix in ("decode-b1-k1-tp1", "verify-b1-k3-tp1", "decode-b2-k1-tp1", "attend-kernel-",
                   "selection-b2", "prefill-", "scaling-b1-k1-ctx", "compile-b1-k1",
                   "memory-state-bytes-per-seq"):
        assert any(n.startswith(prefix) for n in names), prefix
    assert sum(n.startswith("attend-kernel-") for n in names) == 2
    assert sum(n.startswith("scaling-") for n in names) == 3


def test_timed_points_have_xla_times_and_a_floor(smoke_result):
    for p in smoke_result["points"]:
        if p["name"].startswith(("memory", "compile")):
            continue
        assert p["xla_us"] is not None and p["xla_us"] > 0, p["name"]
        assert p["floor_us"] is not None and p["floor_us"] > 0, p["name"]
        assert p["roofline"]["bound"] in ("bytes", "flops")
        assert p["median_us"] is not None and p["time_over_floor"] > 0


def test_pallas_off_gpu_is_recorded_not_fatal(smoke_result):
    p = next(p for p in smoke_result["points"] if p["name"] == "decode-b1-k1-tp1")
    assert p["impl"] == "xla"  # the pallas step cannot run on a CPU: recorded, run goes on
    assert "error" in p["impls"]["pallas"] and p["impls"]["pallas"]["median_us"] is None


def test_one_compile_across_contexts(smoke_result):
    p = next(p for p in smoke_result["points"] if p["name"] == "compile-b1-k1")
    assert p["impls"]["xla"]["compiles"] == 1 and p["met"]


def test_help_and_bad_group():
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    assert bench.main(["--only", "nonsense"]) == 2


def test_render_writes_markdown_and_plot(smoke_result, tmp_path):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    try:
        import render
    finally:
        sys.path.pop(0)
    results = tmp_path / "results"
    results.mkdir()
    (results / "smoke.json").write_text(json.dumps(smoke_result))
    md = tmp_path / "BENCHMARKS.md"
    png = results / "scaling.png"
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{render.README_BEGIN}\nold\n{render.README_END}\nrest\n")
    assert render.main(["--results", str(results), "--out", str(md), "--png", str(png),
                        "--readme", str(readme)]) == 0
    text = md.read_text()
    assert "decode-b1-k1-tp1" in text and "| point |" in text
    assert png.exists() and png.stat().st_size > 1000
    new = readme.read_text()
    assert new.startswith("intro\n") and new.endswith(f"{render.README_END}\nrest\n")
    assert "old" not in new and "| decode-b1-k1-tp1 |" in new
    # A launch-study file (benchmarks/h200_launch.py) is rendered as its own table.
    rows = [{"variant": "default-0", "impl": "pallas", "tp": 8, "k": 1, "step_us": 147.4,
             "kernel_us": 116.3, "idle_us": 31.1, "dispatch_us": 112.5},
            {"variant": "default-0", "impl": "trivial", "tp": 8, "k": 1, "dispatch_us": 70.9},
            {"variant": "off-1", "impl": "xla", "tp": 1, "k": 3, "error": "Boom: bad"}]
    (results / "h200-launch.json").write_text(json.dumps({"command": "c", "results": rows}))
    assert render.main(["--results", str(results), "--out", str(md), "--png", str(png),
                        "--readme", ""]) == 0
    text = md.read_text()
    assert "| default-0 | pallas | 8 | 1 | 1 | 147.4 us | 116.3 us | 31.1 us | 112.5 us |" in text
    assert "| default-0 | trivial | 8 | 1 | 1 | - | - | - | 70.9 us |" in text
    assert "error: `Boom: bad`" in text


def test_measured_levers(tmp_path):
    """The levers group (xla only on a CPU): the absorbed kv_b form and the separate input GEMMs
    compute the same function as the step's forms (tiny config: fp32 weights, so only fp32
    rounding apart), and both pool-key forms and both state forms are timed."""
    rc = bench.main(["--smoke", "--only", "levers", "--impls", "xla", "--no-progress",
                     "--out", str(tmp_path), "--name", "levers.json"])
    assert rc == 0
    with open(tmp_path / "levers.json") as f:
        lev = json.load(f)["levers"]
    kv_b = lev["kv_b_absorbed_vs_runtime_measured"]["results"]
    assert set(kv_b) == {"tp1-b1", "tp1-b2", "tp8-b1", "tp8-b2"}
    for res in kv_b.values():
        assert res["q_rel_diff"] < 1e-5 and res["o_rel_diff"] < 1e-5, res
        assert res["runtime_us"] > 0 and res["absorbed_us"] > 0
    keys = lev["pool_keys_cached_vs_recomputed"]["results"]
    assert set(keys) == {"xla-b1", "xla-b2"}
    assert all(r["cached_us"] > 0 and r["recomputed_us"] > 0 for r in keys.values())
    fused = lev["fused_projections_vs_separate"]["results"]
    assert set(fused) == {"tp1-b1", "tp1-b2", "tp8-b1", "tp8-b2"}
    for res in fused.values():  # the same projections (fp32 weights: rounding apart)
        assert res["max_rel_diff"] < 1e-5 and res["fused_us"] > 0 and res["separate_us"] > 0
    donated = lev["donated_state_vs_copied"]["results"]
    assert set(donated) == {"xla-b1", "xla-b2"}
    assert all(r["donated_us"] > 0 and r["copied_us"] > 0 for r in donated.values())


def test_hf_baseline_for_every_step_point(tmp_path):
    """The Hugging Face block is timed for the decode, verify, batch and prefill points (tiny
    config on the CPU), and each point carries its HF time and ratio."""
    rc = bench.main(["--smoke", "--only", "hf,decode,prefill", "--impls", "xla",
                     "--no-progress", "--out", str(tmp_path), "--name", "hf.json"])
    assert rc == 0
    with open(tmp_path / "hf.json") as f:
        res = json.load(f)
    hf = res["baselines"]["hf"]
    for kind in ("verify", "batch", "prefill"):
        (entry,) = hf[kind].values()
        assert any((entry.get(i) or {}).get("median_us") for i in ("eager", "sdpa")), entry
    for p in res["points"]:
        assert p["hf_us"] is not None and p["hf_us"] > 0, p["name"]
        assert p["ratio_vs_hf"] == pytest.approx(p["median_us"] / p["hf_us"])


def test_hf_cache_fill_tiles_a_real_forward():
    """The HF cache is filled by HF's own forward over a few tokens, then tiled along the
    sequence axis: the cache reports the context, and its tensors repeat with that period."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from dsa_jax.shapes import tiny

    cfg = tiny(implementation="xla")
    attn, config = bench._hf_block(cfg, bench.random_hf_tensors(cfg, 0), "cpu")
    gen = torch.Generator().manual_seed(0)
    cache, how = bench._hf_fill_tiled(cfg, attn, config, 42, "cpu", gen, fill_tokens=16)
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

    out = bench._hf_in_chunks(run, 64)
    assert calls == [64, 32, 16]
    assert out["median_us"] == 4 * 160.0 and out["min_us"] == 4 * 144.0
    assert out["chunks"]["sequences_per_call"] == 16 and out["chunks"]["calls"] == 4
    assert "out of memory" in out["chunks"]["why"]
    assert bench._hf_in_chunks(run, 8)["median_us"] == 80.0 and "chunks" not in (
        bench._hf_in_chunks(run, 8))


def test_breakdown_covers_decode_verify_prefill_and_tp8(smoke_result):
    """The stage breakdown runs the decode (1 and big_batch sequences), the K=3 verify, a
    prompt, and the batch-1 decode at TP 8 (one rank), each with every stage and the step."""
    runs = smoke_result["breakdown"]["runs"]
    for key in ("xla-b1", "xla-b2", "xla-b1-k3", "xla-prefill4", "xla-b1-tp8"):
        res = runs[key]
        assert "error" not in res, (key, res.get("error"))
        for stage in ("project", "cache_writes", "pool_scores", "top_k", "expand", "attend",
                      "output_projection"):
            assert res[stage]["median_us"] > 0, (key, stage)
        assert res["step_us"] > 0
    assert "public_decode" in runs["xla-b1"] and "public_decode" not in runs["xla-b1-tp8"]


def test_sweep_row_records_failures_and_keeps_going(tmp_path):
    """A device sweep's row that raises is recorded (row and errors), and the file holds every
    row written so far."""
    res = {"results": [], "errors": []}
    path = tmp_path / "sweep.json"

    def ok(row):
        row["us"] = 1.5

    def bad(row):
        raise RuntimeError("Triton could not compile this tile")

    bench.sweep_row(res, {"case": "a"}, ok, str(path))
    bench.sweep_row(res, {"case": "b"}, bad, str(path))
    saved = json.loads(path.read_text())
    assert [r["case"] for r in saved["results"]] == ["a", "b"]
    assert saved["results"][0]["us"] == 1.5
    assert "RuntimeError: Triton could not compile" in saved["results"][1]["error"]
    assert len(saved["errors"]) == 1 and "Traceback" in saved["errors"][0]


def test_sweep_times_counts_calls_and_reports_both_times():
    """A sweep row's times: the call runs the timing's warm-up plus groups x inner times and
    the trace's 2 warm-up plus its calls (fewer of each when heavy); the wall time is positive,
    and off a GPU there is no kernel time."""
    import jax
    import jax.numpy as jnp

    calls = []
    f = jax.jit(lambda v: v * 2.0)
    x = jnp.arange(7.0) + 1.0

    def call():
        calls.append(1)
        return f(x)

    t = bench.sweep_times(call, heavy=False)
    assert t["wall_us"] > 0 and t["kernel_us"] is None
    assert len(calls) == (2 + 15 * 10) + (2 + 20)
    calls.clear()
    bench.sweep_times(call, heavy=True, heavy_inner=2)
    assert len(calls) == (2 + 5 * 2) + (2 + 3)
