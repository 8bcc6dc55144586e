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
    assert set(res["times"]) == {"b64_tp1", "b64_tp2", "b64_dp2", "b1_tp1", "b1_tp2"}
    assert all(r["wall_us_per_step"] > 0 for r in res["times"].values())
    for name in ("tp2", "dp2"):
        assert all(v["sel_equal"] for v in res["parity"][name].values() if isinstance(v, dict))
    assert res["parity"]["tp2"]["decode_k_equals_decodes"]
    assert "| b64_tp2 (dp 1 x tp 2, 4 seqs) |" in out.stdout
