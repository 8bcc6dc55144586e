"""Two processes under `jax.distributed` (a coordinator on 127.0.0.1, 4 CPU devices each): the
sharded steps against one device, dp x tp = 2 x 4 and 1 x 8, the latter with the selection split
over the ranks (tests/multihost_check.py)."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LIMIT_S = 90  # both processes together; ~35 s on two loaded cores


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.long
def test_two_processes_match_one_device():
    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4 "
                         "--xla_backend_optimization_level=0 "
                         "--xla_llvm_disable_expensive_passes=true",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_check.py"),
                               address, str(i), "2"], env=env, cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for i in range(2)]
    outputs = ["", ""]
    deadline = time.monotonic() + LIMIT_S
    try:
        for i, p in enumerate(procs):
            outputs[i], _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:  # a process still running past the limit: end it and its children
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    codes = [p.returncode for p in procs]
    report = "\n".join(f"--- process {i} (exit {codes[i]}):\n{outputs[i][-2500:]}"
                       for i in range(2))
    assert codes == [0, 0], report
    for i in range(2):
        for case in ("dp 2 x tp 4 (split selection False)", "dp 1 x tp 8 (split selection True)"):
            assert f"process {i}: {case}: ok" in outputs[i], report
