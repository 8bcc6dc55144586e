"""Selection under the total order, property-tested: the serving path's top-k + expansion
equals the reference's stable sort on scores full of ties (small integers, -0.0 and 0.0),
eagerly and under `jax.jit` (chex variants: the same body, both ways)."""

import chex
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_jax import reference
from dsa_jax.select import expand_selection, top_pools
from dsa_jax.shapes import ODD

# kpool, topk pairs; max_context 96 -> P = 96 / kpool pools.
CASES = [(1, 8), (3, 12), (4, 12), (4, 16), (16, 32)]


TIES = np.asarray([-2.0, -1.0, -0.0, 0.0, 1.0, 2.0, 3.0], np.float32)


def _select(cfg, scores):
    """The serving path's selection of every row t of one sequence: `scores [S, P]`."""
    s = scores.shape[0]
    pos = jnp.arange(s, dtype=jnp.int32)
    return expand_selection(cfg, top_pools(cfg, scores), pos, jnp.ones((s,), bool))


class SelectionTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    @settings(max_examples=40, deadline=None)
    @given(case=st.sampled_from(CASES), tail=st.booleans(), seed=st.integers(0, 2 ** 32 - 1),
           spread=st.integers(1, len(TIES)))
    def test_fast_selection_equals_reference_with_ties(self, case, tail, seed, spread):
        """Every row t of a max_context-long sequence, scores drawn from `spread` tie values."""
        kpool, topk = case
        cfg = ODD.replace(index_kpool=kpool, index_topk=topk, always_select_tail=tail)
        s, p = cfg.max_context, cfg.num_pools
        raw = np.random.default_rng(seed).choice(TIES[:spread], size=(s, p))
        # The reference's candidacy and -0.0 normalisation, on tie-heavy scores.
        t = np.arange(s)[:, None]
        candidate = (np.arange(p)[None, :] + 1) * kpool - 1 <= t
        scores = np.where(candidate, np.where(raw == 0, 0.0, raw), -np.inf).astype(np.float32)
        want = reference.select_tokens(cfg, jnp.asarray(scores))
        got = self.variant(_select, static_argnums=0)(cfg, jnp.asarray(scores))
        chex.assert_trees_all_equal(got, want, strict=True)
