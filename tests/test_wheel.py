"""A new user's path: the wheel, installed non-editable into a fresh venv, runs `dsa-jax run`
from a folder outside the repository (finding its shipped config), the README's usage
snippet (its reference comparison within the stated bound) and examples/serving_loop.py.

The venv borrows the running environment's installed dependencies (jax, numpy, ...) through a
path file instead of downloading them, so the test needs no network. That path file adds the
dependencies' folder without running its .pth files, so the checkout's editable install stays
invisible: the venv imports the wheel's copy of dsa_jax, which the test checks.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from importlib import metadata

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(args, cwd, env=None):
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _version(dist: str) -> tuple[int, ...]:
    return tuple(int(p) for p in metadata.version(dist).split(".")[:2] if p.isdigit())


def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    assert _version("setuptools") >= (70, 1), (
        "building the wheel without build isolation needs setuptools >= 70.1 (the 'test' "
        "extra: bash scripts/setup.sh test)")
    # Build from a copy holding only what the wheel is built from (a build in the checkout
    # would leave build/ and *.egg-info there).
    src = tmp_path / "src"
    shutil.copytree(ROOT / "dsa_jax", src / "dsa_jax",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(wheels), str(src)], cwd=tmp_path)
    (wheel,) = wheels.glob("dsa_jax-*.whl")

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                cwd=tmp_path).strip()
    # Installed before the dependencies are borrowed, so pip sees no other dsa_jax and never
    # touches the running environment.
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "-q", str(wheel)], cwd=tmp_path)
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    pathlib.Path(site, "borrowed_dependencies.pth").write_text("\n".join(sorted(deps)) + "\n")

    work = tmp_path / "elsewhere"  # outside the repository: nothing found relative to it
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    where = _run([str(python), "-c", "import dsa_jax; print(dsa_jax.__file__)"], cwd=work,
                 env=env).strip()
    assert pathlib.Path(where).is_relative_to(env_dir), where
    out = _run([str(env_dir / "bin" / "dsa-jax"), "run", "--num-seqs", "1", "--prompt-len",
                "12", "--steps", "3", "--speculate", "0", "--show", "1", "--quiet", "--out",
                str(work / "out")], cwd=work, env=env)
    assert "dsa-jax run: tiny " in out and "3 tokens in" in out, out
    assert (work / "out" / "selection_map.png").stat().st_size > 0

    # The README's usage snippet as a user pastes it: it prints the agreement with the
    # reference on the stored values (README: ~1e-6, fp32 rounding).
    readme = (ROOT / "README.md").read_text()
    (work / "snippet.py").write_text(re.search(r"## Usage\n\n```python\n(.*?)```", readme,
                                               re.S).group(1))
    agreement = float(_run([str(python), "snippet.py"], cwd=work, env=env).split()[-1])
    assert 0 < agreement < 1e-5, agreement
    # The example: a user's lax.scan loop with sampling == the eager decode calls.
    shutil.copy(ROOT / "examples" / "serving_loop.py", work)
    out = _run([str(python), "serving_loop.py", "--steps", "4", "--prompt", "12"], cwd=work,
               env=env)
    assert "bit for bit: y yes, sel yes, tokens yes, lengths yes, latent yes" in out, out
