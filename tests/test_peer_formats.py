"""The peers' cache layouts (benchmarks/peers/formats.py) decoded as the peers document them
give back our values: the `peers` group's same-inputs promise rests on these."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.peers import formats
from dsa_jax.shapes import glm53_flash
from dsa_jax.state import quantize_latent


def fp8_latent(nb, bs, seed, scale):
    c = jax.random.normal(jax.random.key(seed), (nb, bs, formats.V32_NOPE), jnp.float32)
    cfg = glm53_flash()  # a 512-wide fp8 latent
    return quantize_latent(cfg, c, jnp.float32(scale))  # [NB, bs, 512] fp8


@pytest.mark.parametrize("scale", [1 / 64, 0.37])
def test_flashmla_v32_cache_decodes_to_our_latents(scale):
    nb, bs = 3, 5
    lat = fp8_latent(nb, bs, 1, scale)
    row = np.asarray(formats.flashmla_v32_cache(lat, jnp.float32(scale)))  # [NB, bs, 1, 656]
    assert row.shape == (nb, bs, 1, formats.V32_BYTES) and row.dtype == np.uint8
    row = row[:, :, 0]
    # FlashMLA's dequantize_k_cache (tests/quant.py), V32: nope * its tile's f32 scale; RoPE
    nope = row[..., :512].copy().view(jnp.float8_e4m3fn).astype(np.float32)
    tile_scales = row[..., 512:528].copy().view(np.float32)  # [NB, bs, 4]
    rope = row[..., 528:].copy().view(np.uint16)
    peer = nope * np.repeat(tile_scales, 128, axis=-1)
    ours = np.asarray(lat.astype(jnp.float32)) * np.float32(scale)
    np.testing.assert_array_equal(peer, ours)
    assert (rope == 0).all()
    assert (tile_scales == np.float32(scale)).all()


def test_flashmla_query_and_indices():
    q = jax.random.normal(jax.random.key(2), (2, 1, 3, 512), jnp.float32)
    q576 = np.asarray(formats.flashmla_query(q).astype(jnp.float32))
    np.testing.assert_array_equal(q576[..., :512], np.asarray(q.astype(jnp.bfloat16)
                                                              .astype(jnp.float32)))
    assert (q576[..., 512:] == 0).all() and q576.shape[-1] == 576
    slots = jnp.arange(2 * 2051, dtype=jnp.int32).reshape(1, 2, 2051) - 7
    idx = np.asarray(formats.padded_indices(slots))
    assert idx.shape == (1, 2, 2112)
    np.testing.assert_array_equal(idx[..., :2051], np.asarray(slots))
    assert (idx[..., 2051:] == -1).all()


def test_dequantized_latents_are_exact_at_a_power_of_two_scale():
    lat = fp8_latent(2, 4, 3, 1 / 64)
    kv = np.asarray(formats.dequantized_latents(lat, jnp.float32(1 / 64)).astype(jnp.float32))
    np.testing.assert_array_equal(kv.reshape(2, 4, 512),
                                  np.asarray(lat.astype(jnp.float32)) / 64)


def test_deepgemm_fp8_keys_decode_within_the_fp8_step():
    b, p, d, bk = 2, 128, 16, 64
    keys = (0.3 * jax.random.normal(jax.random.key(4), (b, p, d))).astype(jnp.bfloat16)
    packed, table = formats.deepgemm_fp8_keys(keys, bk)
    packed, table = np.asarray(packed), np.asarray(table)
    assert packed.shape == (b * p // bk, bk, 1, d + 4) and table.shape == (b, p // bk)
    flat = packed.reshape(b * p // bk, bk * (d + 4))
    vals = flat[:, :bk * d].copy().view(jnp.float8_e4m3fn).astype(np.float32).reshape(-1, bk, d)
    sf = flat[:, bk * d:].copy().view(np.float32).reshape(-1, bk, 1)
    back = (vals * sf)[table.reshape(-1)].reshape(b, p, d)  # through the block table
    k = np.asarray(keys.astype(jnp.float32))
    # e4m3: 3 mantissa bits, |error| <= 2^-4 of the value's binade; the amax maps to 448
    np.testing.assert_allclose(back, k, rtol=2 ** -4, atol=float(np.abs(k).max()) * 2 ** -9)
    np.testing.assert_allclose(sf[..., 0], np.maximum(np.abs(k).max(-1), 1e-4)
                               .reshape(sf.shape[:2]) / 448, rtol=1e-6)
    with pytest.raises(ValueError, match="multiple of 64"):
        formats.deepgemm_fp8_keys(keys[:, :100], bk)


def test_the_peers_group_says_why_it_skips_on_a_cpu():
    from benchmarks.peers import group

    class Suite:
        result: dict = {}

    group.run(Suite)
    assert Suite.result["peers"]["skipped"] == {"all": "no GPU (backend cpu)"}
    assert Suite.result["peers"]["points"] == {}


def test_a_peer_that_does_not_import_is_named():
    from benchmarks.peers import group

    mods = group.import_peers()
    for name in ("flash_mla", "deep_gemm"):  # never installed on the CPU machines
        assert isinstance(mods[name], str) and name in mods[name]


def test_importing_dsa_jax_imports_no_torch_and_no_peer():
    import subprocess
    import sys

    code = ("import sys, dsa_jax, dsa_jax.engine, dsa_jax.serve; "
            "print([m for m in ('torch', 'flash_mla', 'deep_gemm', 'benchmarks') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_token_slots_are_the_kernels_slots():
    from dsa_jax.pallas.sparse_attend import token_slots

    table = jnp.asarray(np.random.default_rng(0).permutation(12).astype(np.int32))  # [NB]
    tokens = jnp.asarray(np.random.default_rng(1).integers(-1, 12 * 16, (3, 50)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(formats.token_slots(tokens, table, 16)),
                                  np.asarray(token_slots(tokens, table, 16)))
