"""The device script's --smoke mode (benchmarks/h200_parallel.py): 2 CPU host devices, tiny
shapes, every part runs and the parity checks pass."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_device_script_smoke(tmp_path):
    """benchmarks/h200_parallel.py --smoke: 2 host devices, tiny shapes, every part runs and
    the parity checks pass."""
    path = tmp_path / "parallel.json"
    # The script sets its device count; level 0 halves XLA:CPU's compile time.
    env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0 "
                                     "--xla_llvm_disable_expensive_passes=true",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "h200_parallel.py"),
                          "--smoke", "--steps", "2", "--out", str(path)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(path.read_text())
    assert res["errors"] == [] and res["parity_ok"], res["errors"]
    assert res["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert set(res["times"]) == {"b64_tp1", "b64_tp2", "b64_dp2", "b1_tp1", "b1_tp2", "b32_tp1",
                                 "b64_tp2_masked", "b64_tp2_replicated", "b64_tp2_before",
                                 "b1_tp2_before",
                                 "b8_tp2_split", "b8_tp2_replicated"}
    assert all(r["wall_us_per_step"] > 0 for r in res["times"].values())
    times = res["times"]
    assert times["b8_tp2_split"]["split_selection"] and not times["b8_tp2_replicated"][
        "split_selection"]
    # The compiled programs' collectives, found by name: the psum, and the split's all-gather.
    assert any(n.startswith("psum") for n in times["b64_tp2"]["collective_instructions"])
    assert any("gather" in n for n in times["b8_tp2_split"]["collective_instructions"])
    assert times["b64_tp1"]["collective_instructions"] == []
    for name in ("tp2", "tp2_split", "dp2"):
        assert all(v["sel_equal"] for v in res["parity"][name].values() if isinstance(v, dict))
    assert res["parity"]["tp2_split"]["split_selection"]
    assert res["parity"]["tp2"]["decode_k_equals_decodes"]
    assert res["parity"]["tp2_split"]["decode_k_equals_decodes"]
    # The B=64 loop's sel: TP=2 split (ranged and masked score kernel) == TP=1, bitwise.
    assert res["sel_b64_ok"] and res["sel_b64"]["tp2_split_vs_tp1"]["sel_equal"]
    assert times["b64_tp2_masked"]["split_selection"]
    bits = res["prefill_bits"]
    assert bits["default"]["half_batch_sel"] == 0.0 and bits["default"]["tp2_rank0_sel"] == 0.0
    assert "| b64_tp2 (dp 1 x tp 2, 4 seqs) |" in out.stdout


def test_collective_kernels_are_found_by_instruction_name():
    """The profile's filter: XLA's own all-reduce kernel is named after its instruction, NCCL's
    after NCCL; other kernels (a psum-like prefix of another name included) are not."""
    from benchmarks.parallel_probes import collective_names, is_collective

    hlo = ("%fused_psum.7.0.clone (param_0.538: f32[262144]) -> f32[262144] {\n"
           "  %param_0.538 = f32[262144]{0} parameter(0)\n"
           "  ROOT %psum.7.2 = f32[262144]{0} all-reduce(%param_0.538), channel_id=1\n"
           "}\n\n"
           "%fused_convert (p: f32[8]) -> bf16[8] {\n"
           "  ROOT %c = bf16[8]{0} convert(%p)\n"
           "}\n\n"
           "ENTRY %main.1 (a: f32[8]) -> f32[8] {\n"
           "  %all-gather-start = s32[64,4,512]{2,1,0} all-gather-start(%q), dimensions={0}\n"
           "  %fusion.2 = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_all_reduce_like\n"
           "}\n")
    names = collective_names(hlo)
    assert names == ["all_gather_start", "psum_7_0", "psum_7_2"], names
    assert is_collective("psum_7_0_fusion_1", names)  # the Triton collective fusion's kernel
    assert is_collective("all_gather_start", names)
    assert is_collective("ncclDevKernel_AllReduce_Sum_f32_RING_LL", [])
    assert not is_collective("psum_70_fusion", names)
    assert not is_collective("pool_scores", names)
    assert not is_collective("loop_convert_fusion_1", names)
