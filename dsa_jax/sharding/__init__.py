"""Tensor and data parallelism over a 2-D device mesh `(dp, tp)`.

Heads are split along `tp`: each rank holds its heads' `q_b`, `kv_b` and `o_proj` and computes
their partial output; one `psum` of `y` over `tp` is the step's only collective. The input
GEMM and the indexer are replicated and run with the same shapes at every tp degree, so the
selection `sel` is bitwise the same as on one device.

Sequences are split along `dp`: each dp shard holds only its own sequences' caches, block
tables and lengths, and a pool of physical latent blocks of its own (block tables hold
shard-local ids). A dp shard needs no communication at all.

What each axis divides: tp divides the weights' bytes and the attention's heads, not the
cache (every rank of a dp shard holds its whole state: the latent is shared by all heads) and
the selection only where it is split (`split_selection`: each rank scores and top-k's its
share of the sequences, then one all-gather of the pool ids); dp divides the sequences, their
caches and all per-sequence work, with no communication. Under dp a device runs a smaller
batch than one device would: `sel` stays equal to one device's as long as the kernels' bits
do not depend on the batch size (the Pallas kernels work per row; XLA:CPU's vectorized exp
differs from its scalar remainder loop, and its pool-score dots differ with the batch's shape,
so there pool keys and scores may differ in their last bits; the GEMMs feeding the indexer
are XLA's on every backend: `bitwise.BITWISE_OPTIONS` fixes their order on the GPU).

Placement (`layout.py`): `mesh`, `shard_weights`, `init_state` (made in place),
`shard_state` / `gather_state` (a whole state <-> split), `put`, `row_sharding`, the specs
`WEIGHT_SPEC`, `STATE_SPECS`, `ROW_SPEC`. Steps (`steps.py`): `local_step` and
`reduce_heads` (inside a caller's `shard_map`, e.g. a model step over all its layers),
`rank_weights`, `sharded_step` (traceable, pre-placed arrays: for a caller's jit or scan),
`dp_tp_prefill` / `dp_tp_decode` / `dp_tp_decode_k` (host checks per dp shard, padding, one
donated step), `rewind`. Everything runs unchanged under `jax.distributed` (several processes).
"""

from dsa_jax.sharding.layout import (
    DP,
    ROW_SPEC,
    STATE_SPECS,
    TP,
    WEIGHT_SPEC,
    ShardingError,
    check_config,
    degrees,
    gather_state,
    init_state,
    mesh,
    put,
    replicate,
    row_sharding,
    shard_state,
    shard_weights,
    state_shardings,
    tp_mesh,
)
from dsa_jax.sharding.steps import (
    dp_tp_decode,
    dp_tp_decode_k,
    dp_tp_prefill,
    local_step,
    rank_weights,
    reduce_heads,
    rewind,
    sharded_step,
    split_rule,
    split_select,
    tp_decode_k,
    tp_prefill,
)

__all__ = [
    "DP", "ROW_SPEC", "STATE_SPECS", "TP", "WEIGHT_SPEC", "ShardingError", "check_config",
    "degrees", "dp_tp_decode", "dp_tp_decode_k", "dp_tp_prefill", "gather_state", "init_state",
    "local_step", "mesh", "put", "rank_weights", "reduce_heads", "replicate", "rewind",
    "row_sharding",
    "shard_state", "shard_weights", "sharded_step", "split_rule", "split_select",
    "state_shardings", "tp_decode_k",
    "tp_mesh", "tp_prefill",
]
