"""Markdown tables of bench results (used by benchmarks/render.py). Pure functions of the
JSON: each takes results as loaded and returns lines."""

from __future__ import annotations

import os

from benchmarks.schema import fmt_us, fmt_x

STAGES = ("project", "cache_writes", "pool_scores", "top_k", "expand", "attend",
          "output_projection")


def rel(path: str, out_md: str) -> str:
    """`path` relative to the folder of the Markdown file that links it."""
    return os.path.relpath(path, os.path.dirname(os.path.abspath(out_md)))


def link(path: str, out_md: str) -> str:
    r = rel(path, out_md)
    return f"[`{os.path.basename(path)}`]({r})"


def met_cell(met: bool | None) -> str:
    return "-" if met is None else "yes" if met else "**no**"


def time_cell(p: dict) -> str:
    """A point's figure: its time (with what its kind adds), or its memory."""
    if "value_MiB" in p:
        return f"{p.get('value_MiB', 0):.2f} MiB ({p.get('value_bytes')} B)"
    if p.get("group") == "loop" or p.get("median_us") is None:
        return loop_cell(p)
    extra = ""
    if p.get("TFLOPs") is not None:
        extra = f" ({p['TFLOPs']:.0f} TFLOP/s, {p.get('GBps', 0):.0f} GB/s)"
    if p.get("ratio_vs_k1") is not None:
        extra = f" ({p['ratio_vs_k1']:.2f}x the K=1 step)"
    if p.get("kernel_us") is not None:
        floor = p.get("call_floor_us")  # the host's least for this call (a one-fusion program)
        extra = (f" (kernels {fmt_us(p['kernel_us'])}"
                 + (f", call floor {fmt_us(floor)})" if floor is not None else ")"))
    if p.get("device_step_us") is not None:
        extra = f" (device step {fmt_us(p['device_step_us'])})"
    return fmt_us(p.get("median_us")) + extra


def loop_cell(p: dict) -> str:
    """The serving-loop points (benchmarks/loop.py): time per token (or step) per layer and
    its ratio to the layers' kernel time, or tokens/s for the speculation point."""
    over = p.get("wall_over_kernel")
    kern = f" ({over:.2f}x kernels)" if over is not None else ""
    if p.get("us_per_token_per_layer") is not None:
        return f"{fmt_us(p['us_per_token_per_layer'])} per token per layer{kern}"
    if p.get("per_step_per_layer_us") is not None:  # the engine's step
        return f"{fmt_us(p['per_step_per_layer_us'])} per step per layer{kern}"
    if p.get("tokens_per_s") is not None:
        return (f"{p['tokens_per_s']:.0f} tok/s ({p['speedup']:.2f}x plain, acceptance "
                f"{p['measured_acceptance']:.2f})")
    return "-"


def points_table(rows: list[tuple]) -> list[str]:
    """One row per (point, target, met)."""
    lines = ["| point | impl | time | floor | time / floor | bound | target | met | XLA | "
             "vs XLA | HF | vs HF |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p, target, met in rows:
        roof = p.get("roofline") or {}
        lines.append(
            f"| {p['name']} | {p.get('impl') or '-'} | {time_cell(p)} | "
            f"{fmt_us(p.get('floor_us'))} | {fmt_x(p.get('time_over_floor'))} | "
            f"{roof.get('bound', '-')} | {target} | {met_cell(met)} | "
            f"{fmt_us(p.get('xla_us'))} | {fmt_x(p.get('ratio_vs_xla'))} | "
            f"{fmt_us(p.get('hf_us'))} | {fmt_x(p.get('ratio_vs_hf'), 4)} |")
    return lines


def readme_rows(rows: list[tuple]) -> list[str]:
    lines = ["| point | time | floor | time / floor | met | vs XLA | vs HF |",
             "|---|---|---|---|---|---|---|"]
    for p, _, met in rows:
        cell = (f"{p.get('value_MiB', 0):.1f} MiB" if "value_MiB" in p
                else loop_cell(p) if p.get("group") == "loop" or p.get("median_us") is None
                else fmt_us(p.get("median_us")))
        lines.append(f"| {p['name']} | {cell} | {fmt_us(p.get('floor_us'))} | "
                     f"{fmt_x(p.get('time_over_floor'))} | {met_cell(met)} | "
                     f"{fmt_x(p.get('ratio_vs_xla'))} | {fmt_x(p.get('ratio_vs_hf'), 4)} |")
    return lines


def impl_table(points: list[dict]) -> list[str]:
    """Every implementation's time of each point (median, p10-p90, or its error)."""
    impls = sorted({i for p in points for i in (p.get("impls") or {})})
    if not impls:
        return []
    lines = ["| point | " + " | ".join(f"{i} median (p10-p90)" for i in impls) + " |",
             "|---|" + "---|" * len(impls)]
    for p in points:
        cells = []
        for i in impls:
            t = (p.get("impls") or {}).get(i)
            if t is None:
                cells.append("-")
            elif t.get("median_us") is None:
                err = (t.get("error") or "not measured").splitlines()[0][:80]
                cells.append(f"error: `{err}`")
            elif "p10_us" in t:
                cells.append(f"{fmt_us(t['median_us'])} ({fmt_us(t['p10_us'])}-"
                             f"{fmt_us(t['p90_us'])})")
            else:
                cells.append(fmt_us(t["median_us"]))
        if any(c != "-" for c in cells):
            lines.append(f"| {p['name']} | " + " | ".join(cells) + " |")
    return lines


def hf_table(res: dict) -> list[str]:
    hf = (res.get("baselines") or {}).get("hf") or {}
    fills = sorted({(r.get(i) or {}).get("cache_fill") for r in hf["contexts"].values()
                    for i in ("eager", "sdpa")} - {None})
    lines = [f"{hf.get('what', '')}; transformers {hf.get('transformers')}, torch "
             f"{hf.get('torch')}, {hf.get('device')}.", "",
             *[f"- cache filled by: {f}" for f in fills], "",
             "| context | eager | sdpa |", "|---|---|---|"]
    rows = sorted(hf["contexts"].items(), key=lambda kv: int(kv[0]))
    # The other points' counterparts (verify, a batch of decodes, a prompt), when measured.
    rows += [(f"{kind} {key}", r) for kind in ("verify", "batch", "prefill")
             for key, r in (hf.get(kind) or {}).items()]
    for what, r in rows:
        cells = []
        for impl in ("eager", "sdpa"):
            t = r.get(impl) or {}
            cells.append(fmt_us(t.get("median_us")) if t.get("median_us") is not None
                         else "error: `" + (t.get("error") or "-").splitlines()[0][:80] + "`")
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    return lines


def breakdown_table(res: dict) -> list[str]:
    """A run's stage breakdown of the decode, verify and prefill steps."""
    bd = res["breakdown"]
    lines = ["### Where the step's time goes", "",
             "Each stage of the step jitted alone at the step's shapes (decode `bN` and verify "
             f"`bN-kK` at context {(res.get('plan') or {}).get('ctx')}, rows padded to "
             "max_verify; `prefillS` from an empty context), median wall time; `sum` adds the "
             "stages; `step` is the whole jitted step (calls pipelined); `step, blocked` blocks "
             "after every call. `kernels` is the step's device kernel time from a profiler "
             "trace, `launches` its kernel count, `span` first kernel start to last kernel end "
             "(tracing adds gaps).", "",
             "| run | " + " | ".join(STAGES) + " | sum | step | step, blocked | kernels | "
             "launches | span |",
             "|---|" + "---|" * (len(STAGES) + 6)]
    for key, r in bd["runs"].items():
        if r.get("error"):
            lines.append(f"| {key} | error: `{r['error'].splitlines()[0][:100]}` |")
            continue
        cells = [fmt_us((r.get(s) or {}).get("median_us")) for s in STAGES]
        prof = r.get("profile") or {}
        launches = prof.get("launches_per_step")
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {fmt_us(r.get('sum_us'))} | "
                     f"{fmt_us(r.get('step_us'))} | "
                     f"{fmt_us(r.get('step_blocked_each_call_us'))} | "
                     f"{fmt_us(prof.get('kernel_us_per_step'))} | "
                     f"{'-' if launches is None else f'{launches:.0f}'} | "
                     f"{fmt_us(prof.get('first_to_last_kernel_us_per_step'))} |")
    pub = [(k, r["public_decode"]) for k, r in bd["runs"].items() if r.get("public_decode")]
    if pub:
        lines += ["", "Public `dsa_jax.decode` at batch 1 (host checks + row padding + the "
                  "step + slicing):", "",
                  "| run | host checks (host time) | row padding, blocked | decode() per call |",
                  "|---|---|---|---|"]
        for k, r in pub:
            lines.append(f"| {k} | {fmt_us(r.get('host_checks_us'))} | "
                         f"{fmt_us(r.get('row_padding_blocked_us'))} | "
                         f"{fmt_us(r.get('decode_us'))} |")
    return lines + [""]


def levers_section(res: dict) -> list[str]:
    lev = res.get("levers") or {}
    lines = []
    kvb = lev.get("kv_b_absorbed_vs_runtime") or {}
    if kvb:
        lines += ["### Absorbed vs run-time kv_b (byte counts)", "",
                  "| TP | run-time form: q_b + U_k + U_v + o_proj | absorbed: W_qb·U_k + "
                  "U_v·o_proj | run-time reads fewer | FLOPs/row run-time | absorbed |",
                  "|---|---|---|---|---|---|"]
        for tp, d in kvb.items():
            lines.append(f"| {tp} | {d['runtime_bytes'] / 1e6:.1f} MB | "
                         f"{d['absorbed_bytes'] / 1e6:.1f} MB | "
                         f"{100 * d['runtime_fewer_bytes_frac']:.0f}% | "
                         f"{d['runtime_flops_per_row'] / 1e6:.1f} M | "
                         f"{d['absorbed_flops_per_row'] / 1e6:.1f} M |")
        lines.append("")
    for key, title, base, other in (
            ("kv_b_absorbed_vs_runtime_measured", "Absorbed vs run-time kv_b (measured)",
             "runtime", "absorbed"),
            ("fused_projections_vs_separate", "Fused input GEMMs vs separate (measured)",
             "fused", "separate")):
        lines += two_forms_table(lev.get(key) or {}, title, base, other)
    return lines


def two_forms_table(lever: dict, title: str, base: str, other: str,
                    extra: tuple = ()) -> list[str]:
    """A measured lever with two forms: device kernel times, their ratio, wall times, and
    `extra` columns (header, key, format)."""
    if not lever.get("results"):
        return []
    lines = [f"### {title}", "", lever.get("note", ""), "",
             f"| case | {base} kernels | {other} kernels | {other} / {base} (kernels) | "
             f"{base} wall | {other} wall |" + "".join(f" {h} |" for h, _, _ in extra),
             "|---|---|---|---|---|---|" + "---|" * len(extra)]
    for case, r in lever["results"].items():
        lines.append(f"| {case} | {fmt_us(r.get(f'{base}_kernel_us'))} | "
                     f"{fmt_us(r.get(f'{other}_kernel_us'))} | "
                     f"{fmt_x(r.get(f'{other}_over_{base}_kernel'))} | "
                     f"{fmt_us(r.get(f'{base}_us'))} | {fmt_us(r.get(f'{other}_us'))} |"
                     + "".join(f" {f(r.get(k))} |" for _, k, f in extra))
    return lines + [""]


def peers_table(path: str, res: dict, out_md: str) -> list[str]:
    """The `peers` group of a run: ours and the peer per point, kernel time and wall."""
    peers = res["peers"]
    lines = ["## Against the peers, on the same card", "",
             f"Run {link(path, out_md)} ({peers.get('card', '?')}, jax "
             f"{res.get('jax_version')}, commit {res.get('commit') or '?'}): the peer and our "
             "kernels in one process on the same inputs (benchmarks/peers/README.md says what "
             "each side computes). `ratio` = ours / peer in device kernel time; target <= 1."
             + (f" Note: {res['note']}" if res.get("note") else ""), "",
             "| point | peer | ours kernels | peer kernels | ratio | ours wall | peer wall "
             "| agreement |", "|---|---|---|---|---|---|---|---|"]
    for name, r in peers.get("points", {}).items():
        if r.get("error"):
            lines.append(f"| {name} | error: `{r['error'].splitlines()[0][:100]}` |")
            continue
        agree = (f"overlap {r['overlap']:.3f}" if r.get("overlap") is not None else
                 f"rel. diff {r['rel_diff']:.1e}" if r.get("rel_diff") is not None else "-")
        ratio = fmt_x(r.get("ratio"))
        lines.append(f"| {name} | {r.get('peer', '?').split(' (')[0].split(',')[0]} | "
                     f"{fmt_us(r.get('ours_us'))} | {fmt_us(r.get('peer_us'))} | "
                     f"{ratio if (r.get('ratio') or 9) <= 1 else f'**{ratio}**'} | "
                     f"{fmt_us(r.get('ours_wall_us'))} | {fmt_us(r.get('peer_wall_us'))} | "
                     f"{agree} |")
    for name, why in peers.get("skipped", {}).items():
        lines.append(f"| {name} | skipped: {why[:100]} |")
    return lines + [""]


def peers_line(res: dict) -> str:
    """One README line: the range of ours / peer per kind of point."""
    kinds: dict = {}
    for name, r in res["peers"].get("points", {}).items():
        if r.get("ratio"):
            kind = "-".join(w for w in name.split("-") if w.isalpha())  # attend-decode, ...
            kinds.setdefault(kind, []).append(r["ratio"])
    parts = [f"{k} {min(v):.2f}-{max(v):.2f}x" if len(v) > 1 else f"{k} {v[0]:.2f}x"
             for k, v in kinds.items()]
    return (f"Against FlashMLA and DeepGEMM on the same card ({res['peers'].get('card', '?')}"
            f", kernel time, ours / peer): " + ", ".join(parts) + ".")


def fp8_table(path: str, res: dict, out_md: str) -> list[str]:
    """The `fp8` group of a run: per point the bf16- and fp8-weight step, kernels and wall,
    and the weight GEMMs against their fp8 bytes' floor."""
    r = res["fp8_weights"]
    b, rows = r.get("weight_bytes_per_layer") or {}, {}
    lines = ["## FP8 weights beside bf16, on the same card", "", f"Run {link(path, out_md)} ("
             f"{(res.get('machine') or {}).get('device', '?')}, jax {res.get('jax_version')}, "
             f"commit {res.get('commit') or '?'}): one fp8 checkpoint run as fp8 and dequantized"
             f" to bf16 at load, each point by the suite's own function. Weights a layer: bf16 "
             f"{b.get('bf16', 0) / 1e6:.1f} MB, fp8 {b.get('fp8', 0) / 1e6:.1f} MB; outputs "
             f"equal: {(r.get('same_outputs') or {}).get('equal')}.", ""]
    for name, p in r.get("points", {}).items():
        k, w = ("kernel_us", "median_us") if not name.startswith("loop") else (
            "kernel_us_per_token_per_layer", "us_per_token_per_layer")
        rows[name] = {f"{s}_{q}": (p.get(s) or {}).get(x) for s in ("bf16", "fp8")
                      for q, x in (("kernel_us", k), ("us", w))}
        rows[name]["fp8_over_bf16_kernel"] = p.get(f"fp8_over_bf16_{k}")
    return lines + two_forms_table({"results": rows}, "", "bf16", "fp8")[4:] + two_forms_table(
        (r.get("gemms") or {}), "The weight GEMMs", "bf16", "fp8",
        (("fp8 bytes' floor", "fp8_bytes_floor_us", fmt_us),
         ("fp8 / floor", "fp8_over_floor_kernel", fmt_x), ("bits == bf16", "same_bits", str)))
