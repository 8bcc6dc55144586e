"""Tensor parallelism over devices: attention heads split along a mesh axis.

Every device holds one rank's folded weights (`cfg.local_heads` heads of q_b, kv_b and o_proj;
the latent projection and the indexer replicated), a full copy of the state (the latent cache
and the indexer are shared by all heads, so every rank writes the same values), and computes
its heads' partial output; one `psum` over the axis gives the block output. Selection runs on
every rank from replicated inputs, so it is the same everywhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dsa_jax.config import DsaConfig
from dsa_jax.layer import RowLayout, StepError, prepare_step, step
from dsa_jax.state import DsaState
from dsa_jax.weights import DsaWeights, fold_weights


def tp_mesh(cfg: DsaConfig, devices=None, axis_name: str = "tp") -> Mesh:
    """A one-axis mesh of `cfg.tp_degree` devices."""
    devices = jax.devices()[:cfg.tp_degree] if devices is None else list(devices)
    if len(devices) != cfg.tp_degree:
        raise StepError(f"tp_degree {cfg.tp_degree} needs that many devices; "
                        f"{len(devices)} given (jax sees {jax.device_count()})")
    return Mesh(np.asarray(devices), (axis_name,))


def shard_weights(cfg: DsaConfig, hf, mesh: Mesh) -> DsaWeights:
    """HF tensors -> every rank's folded weights, stacked `[tp, ...]` and placed one per device."""
    ranks = [fold_weights(cfg, hf, tp_rank=r) for r in range(cfg.tp_degree)]
    stacked = jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *ranks)
    axis = mesh.axis_names[0]
    return jax.tree_util.tree_map(
        lambda a: jax.device_put(a, NamedSharding(mesh, P(axis))), stacked)


def replicate(tree, mesh: Mesh):
    """Put a state (or any pytree) on every device of the mesh."""
    return jax.tree_util.tree_map(lambda a: jax.device_put(a, NamedSharding(mesh, P())), tree)


@functools.cache
def _sharded_step(cfg: DsaConfig, mesh: Mesh, layout: RowLayout, has_shared: bool):
    axis = mesh.axis_names[0]

    def per_rank(weights, state, x, n_new, shared_sel):
        local = jax.tree_util.tree_map(lambda a: a[0], weights)  # this rank's weights
        x_rows, sel_rows = layout.pad(x, shared_sel)
        y, state, sel = step(cfg, local, state, x_rows, n_new, sel_rows)
        y, sel = layout.unpad(y, sel)
        return jax.lax.psum(y, axis), state, sel

    sharded = jax.shard_map(
        per_rank, mesh=mesh,
        in_specs=(P(axis), P(), P(), P(), P() if has_shared else None),
        out_specs=(P(), P(), P()),
        check_vma=False,  # state and sel are equal on every rank by construction
    )
    return jax.jit(sharded, donate_argnums=(1,))


def _tp_step(cfg, mesh, weights, state, x, kind, shared_sel, check):
    layout, n_new = prepare_step(cfg, weights, state, x, kind=kind, shared_sel=shared_sel,
                                 check=check)
    run = _sharded_step(cfg, mesh, layout, shared_sel is not None)
    return run(weights, state, x, jnp.asarray(n_new), shared_sel)


def tp_decode_k(cfg: DsaConfig, mesh: Mesh, weights: DsaWeights, state: DsaState,
                x: jax.Array, *, shared_sel: jax.Array | None = None, check: bool = True
                ) -> tuple[jax.Array, DsaState, jax.Array]:
    """`dsa_jax.decode_k` across the mesh: x [B, K, D] (or [B, D] for a decode) -> the full
    output `y`, the new (replicated) state and `sel`. `weights` from `shard_weights`."""
    kind = "decode" if x.ndim == 2 else "verify"
    return _tp_step(cfg, mesh, weights, state, x, kind, shared_sel, check)


def tp_prefill(cfg: DsaConfig, mesh: Mesh, weights: DsaWeights, state: DsaState,
               x: jax.Array, *, shared_sel: jax.Array | None = None, check: bool = True
               ) -> tuple[jax.Array, DsaState, jax.Array]:
    """`dsa_jax.prefill` across the mesh: x [B, S, D]."""
    return _tp_step(cfg, mesh, weights, state, x, "prefill", shared_sel, check)
