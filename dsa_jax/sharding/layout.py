"""Where the arrays live on a `(dp, tp)` mesh: the mesh, the weights, the state, the rows.

- Weights: every leaf stacked `[tp, ...]` over the ranks (`fold_weights(cfg, hf, r)`), split
  along `tp`, replicated along `dp`. Inside `shard_map` a device sees `[1, ...]` leaves.
- State: sequences split along `dp`, replicated along `tp` (the latent and the indexer are
  shared by all heads, so every rank of a dp shard writes the same rows). The paged latent
  cache's physical blocks are split along `dp` too: each dp shard owns a pool of `NB / dp`
  blocks, and its sequences' block-table entries are *shard-local* ids in `[0, NB / dp)`.
  Inside `shard_map` a device therefore sees an ordinary `DsaState` of its `B / dp` sequences
  and its own pool, and `layer.step` runs on it unchanged.
- Rows (`x`, `n_new`, `y`, `sel`, `shared_sel`): split along `dp` on their sequence axis.

Every placement here also works under `jax.distributed` (several processes, each holding some
of the mesh's devices): host values are handed to each process's own devices only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dsa_jax import state as state_mod
from dsa_jax.config import DsaConfig
from dsa_jax.errors import ShardingError
from dsa_jax.state import DsaState
from dsa_jax.weights import DsaWeights, fold_weights

DP, TP = "dp", "tp"

# Per-field specs of the state (a prefix pytree for shard_map and jit).
STATE_SPECS = DsaState(latent=P(DP), kv_scale=P(), block_tables=P(DP), index_k=P(DP),
                       index_g=P(DP), pool_keys=P(DP), lengths=P(DP), index_lengths=P(DP))
WEIGHT_SPEC = P(TP)  # every leaf of the stacked weights
ROW_SPEC = P(DP)  # x, n_new, y, sel: split on the sequence axis


def mesh(dp: int = 1, tp: int = 1, devices=None) -> Mesh:
    """A `(dp, tp)` mesh with axes named "dp" and "tp".

    devices: exactly `dp * tp` devices, row-major (a tp group is `tp` consecutive devices);
    default the first `dp * tp` of `jax.devices()` ordered by process, then id, so that a tp
    group stays inside one process (one host's fast links) whenever `tp` divides the devices
    per process.
    """
    for name, v in (("dp", dp), ("tp", tp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ShardingError(f"{name} must be a positive integer, got {v!r}")
    n = dp * tp
    if devices is None:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        if len(devices) < n:
            raise ShardingError(f"a {dp} x {tp} (dp x tp) mesh needs {n} devices; jax sees "
                                f"{len(devices)}")
        devices = devices[:n]
    devices = list(devices)
    if len(devices) != n:
        raise ShardingError(f"a {dp} x {tp} (dp x tp) mesh needs {n} devices; {len(devices)} "
                            f"were given")
    return Mesh(np.asarray(devices, dtype=object).reshape(dp, tp), (DP, TP))


def tp_mesh(cfg: DsaConfig, devices=None) -> Mesh:
    """A `(1, cfg.tp_degree)` mesh: tensor parallelism only."""
    return mesh(1, cfg.tp_degree, devices)


def degrees(m: Mesh) -> tuple[int, int]:
    """`(dp, tp)` of a mesh made by `mesh`."""
    if tuple(m.axis_names) != (DP, TP):
        raise ShardingError(f"the mesh has axes {tuple(m.axis_names)}; expected ('dp', 'tp') "
                            f"(make it with dsa_jax.sharding.mesh)")
    return m.shape[DP], m.shape[TP]


def check_config(cfg: DsaConfig, m: Mesh) -> tuple[int, int]:
    """The mesh's `(dp, tp)`, after checking that `cfg.tp_degree` is its tp size."""
    dp, tp = degrees(m)
    if cfg.tp_degree != tp:
        raise ShardingError(f"cfg.tp_degree is {cfg.tp_degree} but the mesh's tp axis has {tp} "
                            f"devices (use cfg.replace(tp_degree={tp}))")
    return dp, tp


def put(value, sharding: NamedSharding) -> jax.Array:
    """Place a whole (global) value with `sharding`. A host or single-device value must be the
    same in every process; each process transfers only its own devices' pieces."""
    if isinstance(value, jax.Array):
        if value.sharding == sharding:
            return value
        if not value.is_fully_addressable or sharding.is_fully_addressable:
            return jax.device_put(value, sharding)
    elif sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def state_shardings(m: Mesh) -> DsaState:
    """The `NamedSharding` of every state field on mesh `m`."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(m, s), STATE_SPECS)


def row_sharding(m: Mesh) -> NamedSharding:
    return NamedSharding(m, ROW_SPEC)


def shard_weights(cfg: DsaConfig, hf, m: Mesh) -> DsaWeights:
    """HF tensors of one layer -> every rank's folded weights, stacked `[tp, ...]`, split along
    tp and replicated along dp."""
    _, tp = check_config(cfg, m)
    ranks = [jax.tree_util.tree_map(np.asarray, fold_weights(cfg, hf, tp_rank=r))
             for r in range(tp)]
    stacked = jax.tree_util.tree_map(lambda *leaves: np.stack(leaves), *ranks)
    sharding = NamedSharding(m, WEIGHT_SPEC)
    return jax.tree_util.tree_map(lambda a: put(a, sharding), stacked)


def replicate(tree, m: Mesh):
    """Put a pytree on every device of the mesh (e.g. a TP-only state on a dp=1 mesh)."""
    sharding = NamedSharding(m, P())
    return jax.tree_util.tree_map(lambda a: put(a, sharding), tree)


def _shard_sizes(m: Mesh, num_seqs: int, num_blocks: int) -> tuple[int, int, int]:
    dp, _ = degrees(m)
    if num_seqs % dp:
        raise ShardingError(f"{num_seqs} sequences do not split over dp={dp} shards "
                            f"(num_seqs must be a multiple of dp)")
    if num_blocks % dp:
        raise ShardingError(f"{num_blocks} physical blocks do not split over dp={dp} shards "
                            f"(num_blocks must be a multiple of dp)")
    return dp, num_seqs // dp, num_blocks // dp


def init_state(cfg: DsaConfig, m: Mesh, num_seqs: int, *, blocks_per_shard: int | None = None,
               kv_scale: float = 1.0, block_tables=None, has_indexer: bool = True) -> DsaState:
    """An empty state for `num_seqs` sequences (a multiple of dp), made in place on the mesh.

    Sequence `b` lives on dp shard `b // (num_seqs / dp)`. Each shard owns `blocks_per_shard`
    physical blocks (default `num_seqs / dp * cfg.blocks_per_seq`); `block_tables [B, MB]`
    holds shard-local ids (default: each sequence owns `blocks_per_seq` contiguous blocks of
    its shard's pool). An allocator keeps one free list per shard.
    """
    check_config(cfg, m)
    dp, _ = degrees(m)
    if num_seqs <= 0 or num_seqs % dp:
        raise ShardingError(f"num_seqs must be a positive multiple of dp={dp}, got {num_seqs}")
    bl, mb = num_seqs // dp, cfg.blocks_per_seq
    nbl = bl * mb if blocks_per_shard is None else int(blocks_per_shard)
    if nbl <= 0:
        raise ShardingError(f"blocks_per_shard must be positive, got {nbl}")
    if block_tables is None:
        block_tables = np.tile(np.arange(bl * mb, dtype=np.int32).reshape(bl, mb), (dp, 1))
    tables = np.asarray(block_tables, np.int32)

    def build():
        return state_mod.init_state(cfg, num_seqs, num_blocks=dp * nbl, kv_scale=kv_scale,
                                    block_tables=tables, has_indexer=has_indexer, shards=dp)

    return jax.jit(build, out_shardings=state_shardings(m))()


def shard_state(cfg: DsaConfig, m: Mesh, state: DsaState) -> DsaState:
    """A whole state (one device or host; the same in every process) -> split over the mesh.

    Sequences go to dp shards in order (`B / dp` each); the physical blocks each shard's
    sequences reference are gathered into its own pool of `NB / dp` blocks and its block
    tables rewritten to shard-local ids (entries outside `[0, NB)`, never handed out, become
    -1). A shard whose sequences reference more than `NB / dp` blocks raises ShardingError.
    When every shard's blocks already lie in its own range `[s*NB/dp, (s+1)*NB/dp)` (as with
    `dsa_jax.init_state`'s default tables) the pool is split as it is, with no gather.
    """
    check_config(cfg, m)
    b, nb = state.num_seqs, state.latent.shape[0]
    dp, bl, nbl = _shard_sizes(m, b, nb)
    tables = np.asarray(jax.device_get(state.block_tables)).astype(np.int64)  # [B, MB]
    local = np.full(tables.shape, -1, np.int32)
    perm = np.arange(nb)  # [NB]: global block behind each slot of the split pool
    for s in range(dp):
        t = tables[s * bl:(s + 1) * bl]
        ok = (t >= 0) & (t < nb)
        used = np.unique(t[ok])
        if len(used) > nbl:
            raise ShardingError(f"dp shard {s} (sequences {s * bl}..{(s + 1) * bl - 1}) "
                                f"references {len(used)} physical blocks; a shard holds "
                                f"{nbl} ({nb} blocks / dp {dp})")
        lo = s * nbl
        if len(used) == 0 or (used[0] >= lo and used[-1] < lo + nbl):
            local[s * bl:(s + 1) * bl] = np.where(ok, t - lo, -1)
        else:
            perm[lo:lo + nbl] = np.concatenate([used, np.full(nbl - len(used), used[0])])
            local[s * bl:(s + 1) * bl] = np.where(ok, np.searchsorted(used, t), -1)
    latent = state.latent
    if not np.array_equal(perm, np.arange(nb)):
        latent = jnp.take(latent, jnp.asarray(perm), axis=0)
    whole = state._replace(latent=latent, block_tables=local)
    return jax.tree_util.tree_map(put, whole, state_shardings(m))


def gather_state(m: Mesh, state: DsaState, device=None) -> DsaState:
    """The inverse of `shard_state` up to block numbering: a whole state on one device
    (default the first), shard s's pool at blocks `[s*NB/dp, (s+1)*NB/dp)`. Needs every
    device of the mesh in this process (tests, checks)."""
    b, nb = state.num_seqs, state.latent.shape[0]
    _, bl, nbl = _shard_sizes(m, b, nb)
    host = jax.device_get(state)
    t = np.asarray(host.block_tables)
    offset = (np.arange(b) // bl * nbl)[:, None]
    tables = np.where((t >= 0) & (t < nbl), t + offset, t).astype(np.int32)
    device = jax.devices()[0] if device is None else device
    return jax.device_put(host._replace(block_tables=tables), device)
