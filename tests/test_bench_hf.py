"""The benchmark suite's Hugging Face baseline (its cache fill, its batch in chunks, every step
point carrying an HF time), on the CPU."""

import json

import pytest

from benchmarks import hf_baseline
from benchmarks.__main__ import main as bench_main
from benchmarks.workloads import random_hf_tensors
from dsa_jax.shapes import tiny


@pytest.mark.long
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
