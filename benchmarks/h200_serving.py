"""On the GPU: the serving invariants that must hold on the device, not only on CPU.

- decode_k (K = 1..4) is bit-identical (==) to K serial decode calls, for "xla" and "pallas",
  at GLM-5.3 shapes (TP 1: 64 heads; the TP 8 rank's 8 heads), bf16 weights, fp8 latent cache;
- the engine's speculative tokens equal its plain tokens (tiny config, both implementations);
- `dsa-jax parity` (kernels compiled, layer vs reference, HF when importable) passes.
Writes $OUT/h200-serving-checks.json (or ./h200-serving-checks.json) and prints a summary.

    PYTHONPATH=. python3 benchmarks/h200_serving.py
"""

from __future__ import annotations

import datetime
import io
import json
import os
import sys
import time
import traceback
from contextlib import redirect_stdout

import jax
import jax.numpy as jnp
import numpy as np

import dsa_jax
from dsa_jax import parity
from dsa_jax.engine import Engine, ModelConfig, init_model
from dsa_jax.shapes import glm53_flash, tiny


def _copy(tree):
    return jax.tree_util.tree_map(jnp.copy, tree)


def _leaves_equal(a, b) -> bool:
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        if x.dtype == jnp.float8_e4m3fn:
            x, y = x.astype(jnp.float32), y.astype(jnp.float32)
        if not bool(jnp.array_equal(x, y)):
            return False
    return True


def decode_k_bitwise(impl: str, tp: int) -> dict:
    """tp 1: 64 heads (the Mosaic GPU attend kernel for the fp8 cache); tp 8: 8 heads (Triton)."""
    cfg = glm53_flash(max_context=4096, tp_degree=tp, implementation=impl)
    weights = dsa_jax.init_random_weights(cfg, jax.random.key(0))
    b, prompt = 2, 1533  # 1533: rows 1533..1536 cross a pool boundary (KP = 4)
    x = jax.random.normal(jax.random.key(1), (b, prompt, cfg.hidden_size), jnp.bfloat16)
    _, base, _ = dsa_jax.prefill(cfg, weights, dsa_jax.init_state(cfg, b, kv_scale=1 / 64), x)
    results = {}
    for k in (1, 2, 3, 4):
        rows = jax.random.normal(jax.random.key(10 + k), (b, k, cfg.hidden_size), jnp.bfloat16)
        y_k, st_k, sel_k = dsa_jax.decode_k(cfg, weights, _copy(base), rows)
        st = _copy(base)
        same = True
        for r in range(k):
            y, st, sel = dsa_jax.decode(cfg, weights, st, rows[:, r])
            same &= bool(jnp.array_equal(y, y_k[:, r])) and bool(jnp.array_equal(sel,
                                                                                 sel_k[:, r]))
        same &= _leaves_equal(st, st_k)
        results[f"K={k}"] = same
    return {"config": f"glm5.3-flash tp{tp}, max_context 4096, bf16 weights, fp8 cache",
            "prompt": prompt, "bitwise_equal": results, "ok": all(results.values())}


def engine_speculation(impl: str) -> dict:
    cfg = tiny(implementation=impl)
    mcfg = ModelConfig(cfg, vocab_size=256)
    weights = init_model(mcfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in np.resize(rng.integers(0, 256, 8), n)] for n in (40, 90, 17)]
    outs = {}
    for spec in (0, 3):
        eng = Engine(mcfg, weights, max_seqs=2, num_blocks=64, speculate=spec)
        reqs = [eng.submit(p, 40) for p in prompts]
        eng.run_until_done()
        outs[spec] = ([r.output for r in reqs], eng.stats.accepted, eng.stats.drafted,
                      eng.stats.steps)
    return {"tokens_equal": outs[0][0] == outs[3][0], "accepted": outs[3][1],
            "drafted": outs[3][2], "steps_plain": outs[0][3], "steps_spec": outs[3][3],
            "ok": outs[0][0] == outs[3][0]}


def run_parity() -> dict:
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = parity.main([])
    return {"table": buf.getvalue(), "ok": code == 0}


def main() -> int:
    out_dir = os.environ.get("OUT", ".")
    report = {"command": "PYTHONPATH=. python3 benchmarks/h200_serving.py",
              "date": datetime.datetime.now(datetime.UTC).isoformat(),
              "jax_version": jax.__version__, "backend": jax.default_backend(),
              "device": str(jax.devices()[0].device_kind), "checks": {}}
    steps = [("parity", run_parity)]
    for impl in ("xla", "pallas"):
        steps += [(f"decode_k_bitwise[{impl},tp{tp}]", lambda i=impl, t=tp: decode_k_bitwise(i, t))
                  for tp in (1, 8)]
        steps += [(f"engine_speculation[{impl}]", lambda i=impl: engine_speculation(i))]
    for name, fn in steps:
        t0 = time.time()
        try:
            result = fn()
        except Exception as err:  # record and go on: one failure must not hide the others
            result = {"ok": False, "error": f"{type(err).__name__}: {err}",
                      "traceback": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.time() - t0, 1)
        report["checks"][name] = result
        print(f"{name:<32} {'ok' if result['ok'] else 'FAILED'}  ({result['seconds']} s)",
              flush=True)
        if name == "parity":
            print(result.get("table", result.get("error", "")), flush=True)
    with open(os.path.join(out_dir, "h200-serving-checks.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0 if all(c["ok"] for c in report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
