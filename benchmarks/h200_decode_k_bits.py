"""H200: `decode_k` == K serial `decode`s at GLM-5.3-Flash per-rank shapes, per K, row and
sequence, for tensor-parallel degrees run one after another in one process (the order matters:
a TP 1 4-row verify differed from its serial decodes after a TP 8 run, and not alone).

    PYTHONPATH=. python3 benchmarks/h200_decode_k_bits.py 8 1

Prints, per K and row, how many of each sequence's y elements differ in their bits and
whether its `sel` is equal (`tests/test_serving_paths.py` asserts the same with `==`).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import dsa_jax
from dsa_jax.shapes import glm53_flash
from dsa_jax.testing import copy_tree, random_rows, random_state


def compare(tp: int) -> None:
    cfg = glm53_flash(max_context=4096, tp_degree=tp, implementation="pallas")
    weights = dsa_jax.init_random_weights(cfg, jax.random.key(0))
    base = random_state(cfg, weights, 2, 1533, 1, kv_scale=1 / 64, dtype=jnp.bfloat16)
    print("tp", tp, flush=True)
    for k in (1, 2, 3, 4):
        rows = random_rows(10 + k, 2, k, cfg.hidden_size, dtype=jnp.bfloat16)  # [2, K, D]
        y_k, _, sel_k = dsa_jax.decode_k(cfg, weights, copy_tree(base), rows)
        state = copy_tree(base)
        out = []
        for r in range(k):
            y, state, sel = dsa_jax.decode(cfg, weights, state, rows[:, r])
            a, b = np.asarray(y_k[:, r]), np.asarray(y)  # [2, D]
            ys = [int((a[s].view(np.uint32) != b[s].view(np.uint32)).sum()) for s in range(2)]
            ss = [bool((np.asarray(sel_k[:, r])[s] == np.asarray(sel)[s]).all())
                  for s in range(2)]
            out.append(f"r{r}: y_diff/seq {ys} sel_eq {ss}")
        print(f"k={k}: " + "; ".join(out), flush=True)


if __name__ == "__main__":
    for tp in [int(a) for a in sys.argv[1:]] or [8, 1]:
        compare(tp)
