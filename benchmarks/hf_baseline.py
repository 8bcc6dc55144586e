"""The Hugging Face baseline: `Glm5NextTextAttention` (bf16, torch, eager and sdpa) holding the
same random weights as the JAX block: one decode step at batch 1 at each context (its cache
filled by its own forward, then tiled), and the counterparts of the K=3 verify, the
64-sequence decode and the prefill. The suite runs it after every JAX point (torch's
allocations slowed the JAX steps timed after it) and attaches its times to the points.
"""

from __future__ import annotations

from .harness import err_text, torch_time


def hf_block(cfg, hf_tensors: dict, dev: str):
    """HF `Glm5NextTextAttention` (bf16, eager to start with) holding `hf_tensors`, and its
    config (`dsa_jax.hf_oracle.make_config` at the block's shapes)."""
    import torch
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

    from dsa_jax import hf_oracle

    config = hf_oracle.make_config(
        hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        v_head_dim=cfg.v_head_dim, index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        index_kpool=cfg.index_kpool, always_select_tail=cfg.always_select_tail,
        rms_norm_eps=cfg.rms_norm_eps)
    with torch.device(dev):
        attn = Glm5NextTextAttention(config, 0)
    attn = attn.to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, prm in attn.named_parameters():
            prm.copy_(torch.tensor(hf_tensors[name]).to(prm.device, prm.dtype))
    return attn, config


def hf_decode_times(cfg, hf_tensors: dict, plan, seed: int, tqdm_fn) -> dict:
    """One decode step of the HF block (bf16, batch 1) at each of `plan.hf_ctx`, its cache
    prefilled to the context (`fill_tiled`); eager and sdpa. The cache layer is restored to its
    prefilled contents before every timed call. Then the verify, batch and prefill points'
    counterparts."""
    import torch
    import transformers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    attn, config = hf_block(cfg, hf_tensors, dev)
    res: dict = {"transformers": transformers.__version__, "torch": torch.__version__,
                 "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                 "layer_type": config.layer_types[0],
                 "what": "Glm5NextTextAttention bf16, batch 1, one decode step, DynamicCache "
                         "prefilled to the context, layer type "
                         f"{config.layer_types[0]!r}, attention_mask = bool ones [B, S] (the "
                         "indexer mask)",
                 "contexts": {}}

    def attempt(entry: dict, impl: str, fn) -> None:
        try:
            config._attn_implementation = impl
            fn()
        except Exception as e:
            entry[impl] = {"error": err_text(e), "median_us": None}
        if dev == "cuda":
            torch.cuda.empty_cache()

    runs = [(ctx, impl) for ctx in plan.hf_ctx for impl in ("eager", "sdpa")]
    for ctx, impl in tqdm_fn(runs, "HF glm5_next"):
        entry = res["contexts"].setdefault(str(ctx), {})

        def decode_at(entry=entry, impl=impl, ctx=ctx):
            reps = plan.groups if ctx <= 16384 else plan.long_groups
            finite, timing, fill = time_step(cfg, attn, config, ctx, dev, seed, max(2, reps))
            entry[impl + "_finite"] = finite
            entry[impl] = dict(timing, cache_fill=fill)

        attempt(entry, impl, decode_at)
    # The other points' counterparts, at the decode context: a K=3 verify and a batch of
    # decodes (the cache filled for one sequence, repeated), and a prompt from empty.
    ctx = plan.ctx
    extra = [("verify", f"b1-k3-ctx{ctx}", dict(batch=1, rows=3)),
             ("batch", f"b{plan.big_batch}-k1-ctx{ctx}", dict(batch=plan.big_batch, rows=1)),
             ("prefill", f"s{plan.prefill_tokens}", None)]
    runs = [(kind, key, kw, impl) for kind, key, kw in extra for impl in ("eager", "sdpa")]
    for kind, key, kw, impl in tqdm_fn(runs, "HF glm5_next, other points"):
        entry = res.setdefault(kind, {}).setdefault(key, {})

        def other(entry=entry, impl=impl, kw=kw):
            if kw is None:
                entry[impl] = time_prefill(cfg, attn, config, plan.prefill_tokens, dev, seed,
                                           max(2, plan.long_groups))
            else:
                entry[impl] = in_chunks(
                    lambda b: time_step(cfg, attn, config, ctx, dev, seed,
                                        max(2, plan.groups), batch=b, rows=kw["rows"]),
                    kw["batch"])

        attempt(entry, impl, other)
    return res


def fill_tiled(cfg, attn, config, ctx: int, dev: str, gen, fill_tokens: int = 1024):
    """A DynamicCache holding `ctx` tokens: the HF block's own forward over `n` random tokens
    (n <= fill_tokens, a multiple of KP), then every cache tensor tiled along its sequence axis
    to `ctx` (pools stay aligned). Layout-agnostic: transformers 5.17 caches per-head keys and
    values [B, H, S, D], 5.23 the latent [B, 1, S, C]; the sequence axis is the one that grows
    when KP more tokens go in. Returns (cache, description)."""
    import torch
    from transformers import DynamicCache

    kp = cfg.index_kpool
    n = max(2 * kp, min(ctx, fill_tokens) // kp * kp)
    cache = DynamicCache(config=config)

    def forward(count):
        x = torch.randn(1, count, cfg.hidden_size, device=dev, generator=gen,
                        dtype=torch.bfloat16)
        with torch.no_grad():
            attn(x, attention_mask=torch.ones(1, count, dtype=torch.bool, device=dev),
                 past_key_values=cache)

    def shapes():
        return {k: tuple(v.shape) for k, v in cache.layers[0].__dict__.items()
                if isinstance(v, torch.Tensor) and v.dim() > 1}

    forward(n - kp)
    before = shapes()
    forward(kp)
    layer = cache.layers[0]
    for name, shape in shapes().items():
        old = before.get(name, ())
        grown = ([d for d, (a, b) in enumerate(zip(old, shape, strict=True)) if b - a == kp]
                 if len(old) == len(shape) else [])
        if len(grown) != 1 or shape[grown[0]] != n:
            raise RuntimeError(f"HF cache tensor {name!r} {shape}: no single sequence axis "
                               f"of length {n} (before the last {kp} tokens: "
                               f"{before.get(name)})")
        if ctx > n:
            t, d = getattr(layer, name), grown[0]
            reps = [1] * t.dim()
            reps[d] = -(-ctx // n)
            setattr(layer, name, t.repeat(*reps).narrow(d, 0, ctx).contiguous())
    if cache.get_seq_length() != ctx:
        raise RuntimeError(f"HF cache length {cache.get_seq_length()} after the fill, "
                           f"expected {ctx}")
    how = (f"HF forward over {n} random tokens" +
           (f", its cache tensors tiled along the sequence to {ctx}" if ctx > n else ""))
    return cache, how


def in_chunks(run, batch: int) -> dict:
    """`run(b)` -> (finite, timing, fill) for `b` sequences at once. When `batch` sequences do
    not fit in GPU memory, halve until they do and report `batch / b` calls of `b` (the time
    of running all `batch` sequences through HF on this GPU), saying so."""
    import torch

    b, why = batch, None
    while True:
        try:
            finite, timing, fill = run(b)
            break
        except torch.cuda.OutOfMemoryError as e:
            if b == 1:
                raise
            why = why or f"{batch} at once: {type(e).__name__}: {str(e)[:160]}"
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            b //= 2
    out = dict(timing, finite=finite, cache_fill=fill)
    if b != batch:
        calls = -(-batch // b)
        for key in ("median_us", "min_us", "max_us"):
            out[key] = timing[key] * calls
        out["chunks"] = {"sequences_per_call": b, "calls": calls, "per_call_us":
                         timing["median_us"], "why": why}
    return out


def batched_cache_state(state: dict, batch: int) -> dict:
    """A cache layer's attributes with every batch-1 tensor repeated to `batch` sequences (the
    same context in each: the timing, not the values, matters)."""
    import torch

    if batch == 1:
        return state
    return {k: (v.repeat(batch, *([1] * (v.dim() - 1)))
                if isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[0] == 1 else v)
            for k, v in state.items()}


def time_step(cfg, attn, config, ctx: int, dev: str, seed: int, reps: int, batch: int = 1,
              rows: int = 1) -> tuple[bool, dict, str]:
    """One context: a cache holding `ctx` tokens (filled for one sequence, repeated to `batch`),
    then timed steps of `rows` new tokens per sequence (1: a decode; K: a K-token verify), each
    starting from that cache (the cache layer's attributes are restored before every call)."""
    import torch

    gen = torch.Generator(device=dev).manual_seed(seed + ctx)
    xs = [torch.randn(batch, rows, cfg.hidden_size, device=dev, generator=gen,
                      dtype=torch.bfloat16) for _ in range(3)]
    mask = torch.ones(batch, rows, dtype=torch.bool, device=dev)
    cache, fill = fill_tiled(cfg, attn, config, ctx, dev, gen)
    layer = cache.layers[0]
    saved = batched_cache_state(dict(layer.__dict__), batch)
    count = [0]

    def step():
        layer.__dict__.clear()
        layer.__dict__.update(saved)
        x = xs[count[0] % len(xs)]
        count[0] += 1
        with torch.no_grad():
            return attn(x, attention_mask=mask, past_key_values=cache)

    out = step()
    finite = bool(torch.isfinite(out[0]).all())
    timing = torch_time(step, reps, warmup=1)
    if cache.get_seq_length() != ctx + rows:
        raise RuntimeError(f"HF cache length {cache.get_seq_length()} after a step at context "
                           f"{ctx}, expected {ctx + rows}")
    if out[0].shape[0] != batch:
        raise RuntimeError(f"HF output batch {out[0].shape[0]}, expected {batch}")
    return finite, timing, fill


def time_prefill(cfg, attn, config, tokens: int, dev: str, seed: int, reps: int) -> dict:
    """One forward of the HF block over a `tokens`-token prompt from an empty cache, timed."""
    import torch
    from transformers import DynamicCache

    gen = torch.Generator(device=dev).manual_seed(seed + tokens)
    x = torch.randn(1, tokens, cfg.hidden_size, device=dev, generator=gen, dtype=torch.bfloat16)
    mask = torch.ones(1, tokens, dtype=torch.bool, device=dev)

    def step():
        with torch.no_grad():
            return attn(x, attention_mask=mask, past_key_values=DynamicCache(config=config))

    out = step()
    timing = torch_time(step, reps, warmup=1)
    timing["finite"] = bool(torch.isfinite(out[0]).all())
    return timing
