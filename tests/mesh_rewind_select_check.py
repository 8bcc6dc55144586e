"""Run in a subprocess with 4 host devices (tests/test_sharding.py sets XLA_FLAGS).

1. `sharding.split_select` with the Pallas kernels (interpret mode) at tp = 2 and 4: the score
   kernel runs for a rank's sequences only, its first sequence traced from `axis_index`; the
   pool ids against `layer.select_pools` on one device, bitwise.
2. `sharding.rewind` to pool boundaries far below the ring mark (more than Rr rows) on a
   dp 2 x tp 2 mesh: the kept mark is bounded at `lengths + Rr - G` (`ring_mark_after_rewind`),
   so the decodes after it go on (without the bound the second one is refused on its own fresh
   row) and give the bits of a state prefilled to those lengths; a rewind below a boundary to
   a non-boundary length is still refused.
3. The row-invariant GEMMs (bf16 weights, the kernels) inside the mesh's shard_map: a decode
   on its one row, a 3-row decode_k == 3 decodes, bitwise.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import dsa_jax
from dsa_jax import layer, sharding
from dsa_jax import testing as T
from dsa_jax.layer import StepError
from dsa_jax.shapes import ODD
from dsa_jax.state import ring_guard, ring_rows

CFG = ODD.replace(num_heads=4)


def split_select_kernels() -> None:
    cfg1 = CFG.replace(implementation="pallas-interpret")
    b, r = 8, 3
    qi, w, keys, _ = T.pool_inputs(21, b, r, cfg1.index_n_heads, cfg1.index_head_dim,
                                   cfg1.num_pools)
    rng = np.random.default_rng(22)
    pos = jnp.asarray(rng.integers(0, cfg1.max_context, (b, r)), jnp.int32)  # [B, R]
    valid = jnp.asarray(rng.random((b, r)) < 0.8)  # [B, R]
    want = jax.jit(lambda *a: layer.select_pools(cfg1, *a))(qi, w, keys, pos, valid)
    assert (np.asarray(want) >= 0).any()
    for tp in (2, 4):
        cfg = cfg1.replace(tp_degree=tp)
        spec = jax.sharding.PartitionSpec()
        f = jax.shard_map(lambda *a, cfg=cfg: sharding.split_select(cfg, *a),
                          mesh=sharding.mesh(1, tp), in_specs=(spec,) * 5, out_specs=spec,
                          check_vma=False)
        got = jax.jit(f)(qi, w, keys, pos, valid)
        T.assert_trees_bitwise_equal({f"tp {tp} pools": got}, {f"tp {tp} pools": want})
    print("split select kernels: ok", flush=True)


def sharded_rewind_far() -> None:
    cfg = CFG.replace(tp_degree=2)
    m = sharding.mesh(2, 2)
    b, d = 4, cfg.hidden_size
    w = sharding.shard_weights(cfg, dsa_jax.init_random_hf_tensors(cfg, jax.random.key(10)), m)
    x = T.random_rows(11, b, 40, d)  # [B, 40, D]
    xs = T.random_rows(12, b, 3, d)  # [B, 3, D] the decodes after the rewind
    s = sharding.init_state(cfg, m, b)
    _, s, _ = sharding.dp_tp_prefill(cfg, m, w, s, x)
    to = np.array([16, 20, 24, 16], np.int32)  # pool boundaries 16..24 rows below the mark 40
    s = sharding.rewind(cfg, s, to)
    marks = np.asarray(jax.device_get(s.index_lengths))
    assert marks.tolist() == np.minimum(40, to + ring_rows(cfg) - ring_guard(cfg)).tolist(), marks
    ref = sharding.init_state(cfg, m, b)
    _, ref, _ = sharding.dp_tp_prefill(cfg, m, w, ref, x[:, :24], num_tokens=to)
    for t in range(xs.shape[1]):
        y, s, sel = sharding.dp_tp_decode(cfg, m, w, s, xs[:, t])
        y_ref, ref, sel_ref = sharding.dp_tp_decode(cfg, m, w, ref, xs[:, t])
        T.assert_trees_bitwise_equal({f"decode {t}": (y, sel)}, {f"decode {t}": (y_ref, sel_ref)})
    try:
        sharding.rewind(cfg, s, to - 2)
    except StepError as e:
        assert "holds raw rows only from position" in str(e), str(e)
    else:
        raise AssertionError("a rewind below the boundary to a non-boundary length was allowed")
    print("sharded rewind far: ok", flush=True)


def row_gemms_on_a_mesh() -> None:
    """bf16 weights under the kernels (interpret mode) on a dp 2 x tp 2 mesh: the GEMMs are the
    row-invariant ones inside the shard_map, a decode runs its one row (`layer.decode_rows`),
    and a 3-row `dp_tp_decode_k` equals 3 `dp_tp_decode` calls, bit for bit."""
    cfg = CFG.replace(tp_degree=2, implementation="pallas-interpret", param_dtype="bfloat16",
                      cache_dtype="float8_e4m3fn", index_cache_dtype="bfloat16")
    assert layer.decode_rows(cfg, "decode") == 1
    m = sharding.mesh(2, 2)
    b, d = 4, cfg.hidden_size
    w = sharding.shard_weights(cfg, dsa_jax.init_random_hf_tensors(cfg, jax.random.key(13)), m)
    s = sharding.init_state(cfg, m, b, kv_scale=0.1)
    _, s, _ = sharding.dp_tp_prefill(cfg, m, w, s, T.random_rows(14, b, 21, d))
    rows = T.random_rows(15, b, 3, d)  # [B, 3, D]
    y_k, s_k, sel_k = sharding.dp_tp_decode_k(cfg, m, w, T.copy_tree(s), rows)
    for t in range(rows.shape[1]):
        y, s, sel = sharding.dp_tp_decode(cfg, m, w, s, rows[:, t])
        T.assert_trees_bitwise_equal({f"row {t}": (y_k[:, t], sel_k[:, t])},
                                     {f"row {t}": (y, sel)})
    T.assert_trees_bitwise_equal(jax.device_get(s_k.latent), jax.device_get(s.latent))
    print("row gemms on a mesh: ok", flush=True)


def main() -> int:
    assert jax.device_count() == 4, jax.device_count()
    split_select_kernels()
    sharded_rewind_far()
    row_gemms_on_a_mesh()
    return 0


if __name__ == "__main__":
    sys.exit(main())
