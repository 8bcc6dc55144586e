"""Helpers and bitwise checks of benchmarks/h200_loop.py (the serving loop on the device):
timing, a profiler-trace kernel time, random caches at a context, and the `==` checks."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import dsa_jax
from benchmarks.harness import profile
from benchmarks.workloads import random_caches
from dsa_jax import bitwise_jit, serve
from dsa_jax.drafting import ModelDrafter
from dsa_jax.model import (
    ModelConfig,
    forward,
    forward_unrolled,
    init_model,
    init_model_state,
    stack_weights,
    unfold_state,
)
from dsa_jax.sampling import Sampling

# Compiler options of the loop program, side by side (issue 15: the scan's per-layer weight
# slices were copied, `memcpy128`, before the GEMMs): XLA's dynamic-slice fusion lets a GEMM
# or custom call read a slice of the stacked weights in place (cuBLAS GEMMs only, so also with
# XLA's Triton GEMMs off). "default" is `serve.Program`'s default (`IN_PLACE_WEIGHTS`);
# "copied" and the rest compile `Program(weights_in_place=False)`, the rest with these options.
CMD_WHILE = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
LOOP_VARIANTS = {
    "default": None,
    "copied": None,
    # The model on XLA's GEMMs (`gemm="xla"`: every forward over max_verify rows, weights in
    # place), as before the row-invariant GEMMs ran in the model.
    "gemm-xla": None,
    "dsfusion": {"xla_gpu_enable_dynamic_slice_fusion": True},
    "dsfusion+cublas": {"xla_gpu_enable_dynamic_slice_fusion": True,
                        "xla_gpu_enable_triton_gemm": False},
    "cublas": {"xla_gpu_enable_triton_gemm": False},
    # cuBLAS algorithms picked by heuristic, not by timing (the same in every program)
    "dsfusion+cublas+autotune0": {"xla_gpu_enable_dynamic_slice_fusion": True,
                                  "xla_gpu_enable_triton_gemm": False,
                                  "xla_gpu_autotune_level": 0},
    # The default's options with the scans' while loops inside the command buffer too (CUDA
    # graph conditional nodes): one graph per dispatch instead of one per loop iteration.
    "inplace+while": {**serve.IN_PLACE_WEIGHTS, "xla_gpu_enable_command_buffer": CMD_WHILE},
    "inplace+while+ds": {**serve.IN_PLACE_WEIGHTS,
                         "xla_gpu_enable_command_buffer": CMD_WHILE + ",DYNAMIC_SLICE_FUSION"},
}


def memcpy_share(top_kernels: list, tokens: int) -> dict:
    """Copy kernels (`memcpy*`) among a profile's top kernels, per token."""
    copies = [k for k in top_kernels if "memcpy" in k["name"].lower()]
    return {"memcpy_launches_per_token": sum(k["launches_per_step"] for k in copies) / tokens,
            "memcpy_us_per_token": sum(k["us_per_step"] for k in copies) / tokens}


# The scanned and the unrolled model, jitted once (their caches serve every section), with the
# compile options of every library program.
FORWARD_JITS = (bitwise_jit(forward, static_argnums=0, donate_argnums=2),
                bitwise_jit(forward_unrolled, static_argnums=0, donate_argnums=2))
# The same under the options of a `Program(weights_in_place=True)` (the default Program's).
FORWARD_JITS_IN_PLACE = tuple(
    bitwise_jit(f, static_argnums=0, donate_argnums=2, compiler_options=serve.IN_PLACE_WEIGHTS)
    for f in (forward, forward_unrolled))


def bits_equal(a, b) -> bool:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    if ta != tb:
        return False
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.tobytes() != y.tobytes():
            return False
    return True


def copy_tree(tree):
    return jax.tree.map(lambda a: a if a is None else jnp.copy(a), tree)


def device_kernels(call, calls: int, top: int = 12) -> dict:
    """Device kernel time per call (`benchmarks.harness.profile`: two untimed calls, then
    `calls` traced); empty off a GPU."""
    p = profile(call, calls, top=top)
    if "error" in p:
        return {}
    return {"kernel_us": p["kernel_us_per_step"], "launches": p["launches_per_step"],
            "top_kernels": p["top_kernels"]}


def wall_us(call, reps: int, prepare=None) -> float:
    """Median wall time of `call()` to completion (after one warm call); `prepare()` runs
    untimed before each."""
    if prepare is not None:
        prepare()
    jax.block_until_ready(call())
    ts = []
    for _ in range(reps):
        if prepare is not None:
            jax.block_until_ready(prepare())
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        ts.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(ts))


def model(cfg, vocab: int, seed: int = 0):
    mcfg = ModelConfig(cfg, vocab_size=vocab)
    weights = init_model(mcfg, jax.random.key(seed))
    return mcfg, weights, stack_weights(mcfg, weights)


def random_serving(prog: serve.Program, b: int, ctx: int, key) -> serve.Serving:
    """Caches filled with random values up to `ctx - 1` tokens, every slot live for N tokens
    (the timing depends on lengths, not on values)."""
    mcfg, cfg = prog.mcfg, prog.mcfg.dsa
    mb = cfg.blocks_per_seq
    ms = init_model_state(mcfg, b, b * mb, np.arange(b * mb, dtype=np.int32).reshape(b, mb))
    k = jax.random.split(key, 5)
    ms = random_caches(ms, k)._replace(
        lengths=jnp.full((b,), ctx - 1, jnp.int32))
    slots = serve.init_slots(mcfg, b)
    slots = slots._replace(last=jax.random.randint(k[4], (b,), 0, mcfg.vocab_size),
                           limit=jnp.full((b,), 10 ** 6, jnp.int32),
                           done=jnp.zeros((b,), bool))
    draft = prog.drafter.init_state(b, b * mb) if prog.speculate else None
    return serve.Serving(ms, slots, draft)


# ------------------------------------------------------------------------------ checks

def check_scan_equals_unrolled(cfg, vocab: int, b: int = 2, in_place: bool = True) -> bool:
    mcfg, weights, stacked = model(cfg, vocab, 1)
    nb = b * cfg.blocks_per_seq
    rng = np.random.default_rng(0)
    # One shuffled pool split between the sequences: no physical block mapped twice.
    tables = rng.permutation(nb)[:b * cfg.blocks_per_seq].reshape(b, cfg.blocks_per_seq)
    ms = init_model_state(mcfg, b, nb, tables.astype(np.int32))
    states = tuple(unfold_state(mcfg, ms))
    scanned, unrolled = FORWARD_JITS_IN_PLACE if in_place else FORWARD_JITS
    ok = True
    r = cfg.max_verify
    # A prompt chunk, verify-shaped rows, and a 1-row step (the plain loop's rows under the
    # row-invariant GEMMs).
    for rows, n_new in ((2 * r, [2 * r, r + 1]), (r, [1, r]), (r, [r - 1, 0]), (r, [1, 1]),
                        (1, [1, 1])):
        tokens = jnp.asarray(rng.integers(0, vocab, (b, rows)), jnp.int32)
        n = jnp.asarray(n_new[:b] + [1] * (b - len(n_new)), jnp.int32)
        a = scanned(mcfg, stacked, ms, tokens, n)
        u = unrolled(mcfg, weights, states, tokens, n)
        ms, states = a[1], u[1]
        ok &= bits_equal((a[0], a[2]), (u[0], u[2]))
        ok &= bits_equal(unfold_state(mcfg, ms), list(states))
    return bool(ok)


def _prompts(b: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    motif = rng.integers(0, vocab, (b, 5))  # repeats, so the n-gram drafter finds matches
    return [np.resize(m, int(rng.integers(9, 30))).tolist() for m in motif]


def check_loops(cfg, vocab: int, modes=("greedy", "sample"), in_place: bool = True) -> dict:
    """Device loop == Python loop and speculative == plain, per sampling mode; a draft model
    (the target itself) drafting for greedy decoding. in_place: every Program's
    `weights_in_place` (True: the default)."""
    mcfg, weights, stacked = model(cfg, vocab, 2)
    prompts = _prompts(3, vocab, 3)
    limits = [23, 9, 30]
    out, plain_tokens = {}, {}
    for name in modes:
        sampling = Sampling() if name == "greedy" else Sampling("sample", 0.8, 0.9)
        plain = serve.Program(mcfg, sampling, weights_in_place=in_place)
        want = serve.generate(plain, stacked, None, prompts, limits, tokens_per_dispatch=8)
        plain_tokens[name] = want
        sv, first = serve.start(plain, stacked, None, prompts, limits)
        sv, outs, _ = serve.run_python(plain, stacked, None, sv, 64)
        py = [[int(f)] + t for f, t in zip(np.asarray(first), serve.emitted_tokens(outs),
                                          strict=True)]
        out[f"device_loop_equals_python_loop[{name}]"] = want == py
        spec = serve.Program(mcfg, sampling, speculate=3, weights_in_place=in_place)
        got = serve.generate(spec, stacked, None, prompts, limits, tokens_per_dispatch=8)
        out[f"speculative_equals_plain[ngram,{name}]"] = got == want
    if "greedy" in plain_tokens:
        prog = serve.Program(mcfg, Sampling(), speculate=3, drafter=ModelDrafter(mcfg),
                             weights_in_place=in_place)
        got = serve.generate(prog, stacked, stacked, prompts, limits, tokens_per_dispatch=8)
        out["speculative_equals_plain[draft_model,greedy]"] = got == plain_tokens["greedy"]
    return out


def check_decode_k(cfg) -> bool:
    """Public `decode_k` (K rows) == K serial `decode`s, bitwise, K = 1 .. max_verify."""
    weights = dsa_jax.init_random_weights(cfg, jax.random.key(4))
    x = jax.random.normal(jax.random.key(5), (2, 20 + cfg.max_verify, cfg.hidden_size))
    _, base, _ = dsa_jax.prefill(cfg, weights, dsa_jax.init_state(cfg, 2), x[:, :20])
    ok = True
    for k in range(1, cfg.max_verify + 1):
        rows = x[:, 20:20 + k]
        y_k, st_k, sel_k = dsa_jax.decode_k(cfg, weights, copy_tree(base), rows)
        st = copy_tree(base)
        for r in range(k):
            y, st, sel = dsa_jax.decode(cfg, weights, st, rows[:, r])
            ok &= bits_equal((y, sel), (y_k[:, r], sel_k[:, r]))
        ok &= bits_equal(st, st_k)
    return bool(ok)




def check_written_rows(cfg, vocab: int, b: int, seed: int = 21) -> dict:
    """One decode-shaped forward of the scanned model and of the unrolled stack on the same
    random caches (every sequence near the end of its context): per layer, how many of the
    B new tokens' latent rows the two wrote differently in more than half their columns.
    A few bits apart (the scan check's subject) never reach half a row; a row written to the
    wrong place (an address past 2**31 bytes of the stacked pool computed in 32 bits) does.
    Also the stacked pool's size in bytes."""
    mcfg, weights, stacked = model(cfg, vocab, seed)
    prog = serve.Program(mcfg)
    ms = random_serving(prog, b, cfg.max_context - 8, jax.random.key(seed)).model
    states = tuple(unfold_state(mcfg, ms))
    pos = np.asarray(ms.lengths)  # [B] where the new token goes
    tables = np.asarray(ms.block_tables)
    slots = tables[np.arange(b), pos // cfg.block_size], pos % cfg.block_size  # [B] each
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (b, cfg.max_verify)),
                         jnp.int32)
    one = jnp.ones((b,), jnp.int32)
    scanned, unrolled = FORWARD_JITS
    pool_bytes = int(ms.latent.size * ms.latent.dtype.itemsize)
    _, ms2, _ = scanned(mcfg, stacked, ms, tokens, one)
    _, st2, _ = unrolled(mcfg, weights, states, tokens, one)
    out = {"pool_bytes": pool_bytes, "rows_far_apart_per_layer": []}
    for l in range(len(cfg.indexer_types)):
        a = np.asarray(ms2.latent[l][slots]).astype(np.float32)  # [B, C]
        u = np.asarray(st2[l].latent[slots]).astype(np.float32)
        far = ((a != u).mean(axis=1) > 0.5).sum()
        out["rows_far_apart_per_layer"].append(int(far))
    out["ok"] = not any(out["rows_far_apart_per_layer"])
    return out


@dataclasses.dataclass(frozen=True)
class ScriptedDrafter:
    """Proposes the known right token with probability `acceptance` (a fixed pseudo-random
    pattern over positions), a wrong one otherwise; its state is the right tokens [B, T]."""
    vocab: int
    acceptance: float

    def init_state(self, num_seqs, num_blocks):
        return None

    def admit(self, ds, mask, block_tables):
        return ds

    def prefill(self, dweights, ds, tokens, n_new):
        return ds

    def propose(self, dweights, ds, history, lengths, k, max_draft):
        t = ds.shape[1]
        at = jnp.clip(lengths[:, None] + 1 + jnp.arange(k), 0, t - 1)  # [B, k]
        right = jnp.take_along_axis(ds, at, axis=1)
        lucky = (at * 40503 % 65536).astype(jnp.float32) / 65536 < self.acceptance
        drafts = jnp.where(lucky, right, (right + 1) % self.vocab)
        count = jnp.minimum(max_draft, k).astype(jnp.int32)
        return jnp.where(jnp.arange(k) < count[:, None], drafts, 0), count, ds

    def commit(self, ds, lengths, accepted, new_lengths):
        return ds
