"""One process of the two-process test (tests/test_multihost.py): `jax.distributed` over a
local coordinator, 4 CPU devices per process, 8 in all.

Usage: multihost_check.py COORDINATOR_ADDRESS PROCESS_ID NUM_PROCESSES

Every process builds the same inputs, runs the sharded steps (the same code as on one host),
and checks the pieces of `y` and `sel` it holds against its own one-device run of all
sequences: `sel` bitwise, `y` within the bound of `dsa_jax.sharding.check`. Cases: dp 2 x tp 4
(each dp shard inside one process: no collective crosses processes) and dp 1 x tp 8 with the
selection split over the ranks (the psum of `y` and the all-gather of the pool ids cross
processes, through XLA:CPU's gloo collectives).
"""

import sys


def main() -> int:
    address, pid, nproc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    import jax

    # gloo is already jax 0.10's default for CPU collectives; set so that the test says so.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, num_processes=nproc, process_id=pid,
                               initialization_timeout=60)
    import numpy as np

    import dsa_jax
    from dsa_jax import sharding
    from dsa_jax.shapes import ODD
    from dsa_jax.sharding import check

    assert jax.process_count() == nproc and jax.device_count() == 4 * nproc, (
        jax.process_count(), jax.device_count())
    cfg1 = ODD.replace(num_heads=8, cache_dtype="float8_e4m3fn", param_dtype="bfloat16",
                       index_cache_dtype="bfloat16")
    b, d = 8, cfg1.hidden_size
    hf = dsa_jax.init_random_hf_tensors(cfg1, jax.random.key(0))
    x = np.asarray(jax.random.normal(jax.random.key(1), (b, 21, d)))
    num_tokens = np.array([21, 13, 21, 8, 21, 2, 17, 21], np.int32)
    rows = np.asarray(jax.random.normal(jax.random.key(2), (b, 2, d)))
    xd = np.asarray(jax.random.normal(jax.random.key(3), (b, d)))

    w1 = dsa_jax.fold_weights(cfg1, hf)
    s1 = dsa_jax.init_state(cfg1, b, kv_scale=0.1)
    tolerance = jax.jit(check.y_tolerance, static_argnums=0)
    ref = []
    y, s1, sel = dsa_jax.prefill(cfg1, w1, s1, x, num_tokens=num_tokens)
    ref.append((y, sel, tolerance(cfg1, w1, s1, x, sel)))
    y, s1, sel = dsa_jax.decode_k(cfg1, w1, s1, rows)
    ref.append((y, sel, tolerance(cfg1, w1, s1, rows, sel)))
    y, s1, sel = dsa_jax.decode(cfg1, w1, s1, xd)
    ref.append((y, sel, tolerance(cfg1, w1, s1, xd[:, None], sel[:, None])[:, 0]))

    for dp, tp, split in ((2, 4, None), (1, 8, True)):
        cfg = cfg1.replace(tp_degree=tp)
        m = sharding.mesh(dp, tp)
        w = sharding.shard_weights(cfg, hf, m)
        s = sharding.init_state(cfg, m, b, kv_scale=0.1)
        got = []
        y, s, sel = sharding.dp_tp_prefill(cfg, m, w, s, x, num_tokens=num_tokens,
                                           split_selection=split)
        got.append((y, sel))
        y, s, sel = sharding.dp_tp_decode_k(cfg, m, w, s, rows, split_selection=split)
        got.append((y, sel))
        y, s, sel = sharding.dp_tp_decode(cfg, m, w, s, xd, split_selection=split)
        got.append((y, sel))
        held = 0
        for (y, sel), (y1, sel1, tol) in zip(got, ref, strict=True):
            for ys, ss in zip(y.addressable_shards, sel.addressable_shards, strict=True):
                i = ys.index[0]
                np.testing.assert_array_equal(np.asarray(ss.data), np.asarray(sel1)[i])
                err = np.abs(np.asarray(ys.data, np.float64) - np.asarray(y1, np.float64)[i])
                assert (err <= np.asarray(tol, np.float64)[i]).all(), (dp, tp, err.max())
                held += 1
        assert held == 3 * 4, held  # 4 local devices, each holding a piece of every output
        print(f"process {pid}: dp {dp} x tp {tp} (split selection "
              f"{sharding.split_rule(cfg, b // dp, split)}): ok", flush=True)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
