"""Device scripts run through on the CPU at tiny shapes (--smoke): benchmarks/h200_gaps.py in
this process and with a flag set in a child process, benchmarks/h200_profile.py,
benchmarks/h200_direct_out.py and benchmarks/h200_select_levers.py; every row written, none
failed."""

import json

from benchmarks import h200_direct_out, h200_gaps, h200_profile, h200_select_levers, harness

# On a CPU the launch kinds' section has its XLA row only and the launches' section its
# selection and argument rows only (the kernels lower for GPUs).
CALLS = {"kind-xla-fusion", "attend-a-bench", "attend-a-lean", "attend-a-x8",
         "selection-b64-bench", "selection-b64-bound", "selection-b64-3launch",
         "selection-b64-2launch-ncand", "selection-b64-1launch-scores", "selection-b64-floor",
         "selection-b64-r4-3launch", "selection-b64-r4-floor", "selection-b64-lib",
         "selection-b64-r4-lib", "args-1", "args-8", "args-16"}


def test_h200_gaps_smoke_writes_every_row(tmp_path):
    out = tmp_path / "gaps.json"
    assert h200_gaps.main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert not res["errors"], res["errors"]
    assert {r["call"] for r in res["rows"]} == CALLS
    for r in res["rows"]:
        assert r["wall_us"] > 0 and r["enqueue_us"] > 0, r
        assert r["kernel_us"] is None  # a CPU trace holds no device kernels
        assert r.get("equal_to_whole", True) is True, r  # a cut call's result
        # the host's side of a traced row: per event name, Python frames left out
        assert r["host"] and all(e["us_per_call"] >= 0 and not e["name"].startswith("$")
                                 for e in r["host"]), r["host"]


def test_h200_gaps_picks_calls_and_interleaves_rounds(tmp_path):
    out = tmp_path / "gaps.json"
    assert h200_gaps.main(["--smoke", "--sections", "launches", "--calls", "args-8,args-16",
                           "--rounds", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["call"], r["round"]) for r in res["rows"]] == [
        ("args-8", 0), ("args-16", 0), ("args-8", 1), ("args-16", 1)]
    lines = h200_gaps.medians(res).splitlines()  # one line per call, over its rounds
    assert [ln.split()[:3] for ln in lines] == [["args-8", "rounds", "2"],
                                                ["args-16", "rounds", "2"]]


def test_h200_gaps_times_each_call_at_each_inner(tmp_path):
    out = tmp_path / "gaps.json"
    assert h200_gaps.main(["--smoke", "--sections", "launches", "--calls", "args-8",
                           "--inners", "1,3", "--traced-rounds", "0", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["call"], r["inner"]) for r in res["rows"]] == [("args-8@1", 1), ("args-8@3", 3)]


def test_h200_gaps_flag_sets_run_in_fresh_processes(tmp_path):
    out = tmp_path / "gaps.json"
    assert h200_gaps.main(["--smoke", "--flags", "off", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {(r["call"], r["flag_set"]) for r in res["rows"]} == {(c, "off") for c in CALLS}
    assert all(r["flags"] == h200_gaps.FLAGS["off"] for r in res["rows"])


def test_h200_profile_smoke_writes_both_steps(tmp_path):
    out = tmp_path / "profile.json"
    assert h200_profile.main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert not res["errors"], res["errors"]
    assert [r["step"] for r in res["rows"]] == ["prefill-4", "decode-b1-k1-tp1"]
    assert all(r["wall_us"] > 0 and r["kernel_us"] is None for r in res["rows"])


def test_h200_direct_out_smoke_compares_both_paths(tmp_path):
    """The script's machinery on the CPU (the Triton kernel interpreted: both rows run the
    same kernel there, so they must agree bit for bit; on the H200 they are the two paths)."""
    out = tmp_path / "direct.json"
    assert h200_direct_out.main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["direct_out"] for r in res["rows"]] == [True, False]
    assert res["bitwise_equal"] is True and res["finite"] is True


def test_h200_select_levers_smoke_checks_and_times_every_variant(tmp_path):
    out = tmp_path / "levers.json"
    assert h200_select_levers.main(["--smoke", "--rounds", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    names = {f"{c}/{v}" for c in ("b64", "b64-r4") for v in ("xla", "xla-fused")}
    assert set(res["checks"]) == {f"{n} == first" for n in names}
    assert all(res["checks"].values())
    assert set(res["rounds"][0]) == names | {"round"}
    assert all(res["rounds"][0][n]["wall_us"] > 0 for n in names)


def test_h200_gaps_chains_lower_to_one_launch_each():
    """The launch section's chains (GPU rows, not run here) lower for CUDA on any host: n
    Pallas Triton or Mosaic GPU calls for a chain of n."""
    import jax
    import jax.numpy as jnp

    x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    for make, call, n in ((h200_gaps.chain, "custom_call @__gpu$xla.gpu.triton", 3),
                          (h200_gaps.mosaic_chain, "custom_call @mosaic_gpu", 4)):
        text = jax.jit(make(n)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count(call) == n


def test_call_floor_program_keeps_every_argument_and_the_outputs():
    """A floor row's program takes every argument of the call it bounds (none pruned by jit)
    and returns outputs of that call's shapes and dtypes."""
    import jax
    import jax.numpy as jnp

    def fn(a, b, c):
        return a * 2, (b[:3] + c[0, 0]).astype(jnp.int32)

    args = (jnp.arange(6.0).reshape(2, 3), jnp.arange(5.0), jnp.ones((4, 2), jnp.bfloat16))
    floor = harness.call_floor_program(fn, args)
    text = floor.lower(*args).as_text()
    main = next(ln for ln in text.splitlines() if "func.func public @main" in ln)
    assert main.count("%arg") == 3, main
    got, want = floor(*args), jax.eval_shape(fn, *args)
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
    assert float(got[0][0, 0]) == 0.0 + 0.0 + 1.0  # the sum of each argument's first element
