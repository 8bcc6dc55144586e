"""Tensor parallelism over 8 host devices equals the single-device block."""

import os
import subprocess
import sys


def test_tp8_over_devices_matches_one_device():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, os.path.join(here, "tp_check.py")], env=env,
                         capture_output=True, text=True, timeout=600,
                         cwd=root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "tp8 == tp1: ok" in out.stdout
