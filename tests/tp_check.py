"""Run in a subprocess with 8 host devices (XLA_FLAGS set by tests/test_sharding.py): the
tensor-parallel step over 8 devices against the single-device step."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import dsa_jax
from dsa_jax import sharding
from dsa_jax.shapes import ODD


def main() -> int:
    assert jax.device_count() == 8, jax.device_count()
    cfg1 = ODD.replace(num_heads=8, cache_dtype="float8_e4m3fn")
    cfg8 = cfg1.replace(tp_degree=8)
    hf = dsa_jax.init_random_hf_tensors(cfg1, jax.random.key(0))
    mesh = sharding.tp_mesh(cfg8)
    w8 = sharding.shard_weights(cfg8, hf, mesh)
    w1 = dsa_jax.fold_weights(cfg1, hf)
    x = jax.random.normal(jax.random.key(1), (2, 40, cfg1.hidden_size))
    rows = jax.random.normal(jax.random.key(2), (2, 3, cfg1.hidden_size))

    s8 = sharding.replicate(dsa_jax.init_state(cfg8, 2, kv_scale=0.1), mesh)
    y8, s8, sel8 = sharding.tp_prefill(cfg8, mesh, w8, s8, x)
    yk8, s8, selk8 = sharding.tp_decode_k(cfg8, mesh, w8, s8, rows)
    yd8, s8, seld8 = sharding.tp_decode_k(cfg8, mesh, w8, s8, x[:, 5])

    s1 = dsa_jax.init_state(cfg1, 2, kv_scale=0.1)
    y1, s1, sel1 = dsa_jax.prefill(cfg1, w1, s1, x)
    yk1, s1, selk1 = dsa_jax.decode_k(cfg1, w1, s1, rows)
    yd1, s1, seld1 = dsa_jax.decode(cfg1, w1, s1, x[:, 5])

    for a, b in ((sel8, sel1), (selk8, selk1), (seld8, seld1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The o_proj sum runs as 8 partial sums + psum instead of one GEMM: fp32 reordering only.
    for a, b in ((y8, y1), (yk8, yk1), (yd8, yd1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    for name in ("latent", "index_k", "index_g", "pool_keys", "lengths"):
        a, b = getattr(s8, name), getattr(s1, name)
        if a.dtype == jnp.float8_e4m3fn:
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    assert float(jnp.linalg.norm(y8)) > 0
    print("tp8 == tp1: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
