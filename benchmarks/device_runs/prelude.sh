# Sourced by a device call's script: strict pipes, unbuffered Python, $OUT, the card's name in
# $gpu (the tool may place an `nvidia-h200` call on an H100), the jax-triton wheel (a prompt's
# rows use the raw Triton top-k by default) and PYTHONPATH.
set -o pipefail
export PYTHONUNBUFFERED=1
mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "gpu: $gpu"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site benchmarks/wheels/jax_triton-0.3.1-py3-none-any.whl || exit 1
export PYTHONPATH=.:/tmp/site
