"""Render the benchmark results: benchmarks/results/*.json -> BENCHMARKS.md + scaling.png.

    python benchmarks/render.py [--results benchmarks/results] [--out BENCHMARKS.md]
                                [--png benchmarks/results/scaling.png]

The newest full (non-smoke) result is the main table; every result file is listed. A
hand-written analysis, benchmarks/notes.md, is appended when present.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dsa_jax.bench import fmt_us  # noqa: E402  (one formatter for the run and the tables)


def fmt_x(r, digits=2) -> str:
    return "-" if r is None else f"{r:.{digits}f}x"


def load(results_dir: str) -> list[tuple[str, dict]]:
    out = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            print(f"render: skipping {path}: {e}", file=sys.stderr)
            continue
        if isinstance(data, dict) and isinstance(data.get("points"), list):
            out.append((path, data))
    return out


def pick_main(results: list[tuple[str, dict]]) -> tuple[str, dict] | None:
    """The full (non-smoke) run with the most points, the newest of those; partial runs
    (`--only ...`) are listed below it."""
    pool = [r for r in results if not r[1].get("smoke")] or results
    if not pool:
        return None
    return max(pool, key=lambda r: (len(r[1]["points"]), r[1].get("date", "")))


def reruns_section(results, main, out_md: str) -> list[str]:
    """Other full runs' points that repeat the main table's (same name): the run-to-run
    spread."""
    base = {p["name"]: p for p in main[1]["points"]}
    lines = []
    for path, res in results:
        if path == main[0] or res.get("smoke"):
            continue
        same = [p for p in res["points"] if p["name"] in base and p.get("median_us")]
        if not same:
            continue
        rel = os.path.relpath(path, os.path.dirname(os.path.abspath(out_md)))
        lines += [f"### Repeat measurements: [`{rel}`]({rel}) ({res.get('date', '?')[:19]})",
                  "", f"`{res.get('command')}`" + (f" — {res['note']}" if res.get("note")
                                                     else ""), "",
                  "| point | this run | main table | this run, XLA | main table, XLA |",
                  "|---|---|---|---|---|"]
        for p in same:
            b = base[p["name"]]
            lines.append(f"| {p['name']} | {fmt_us(p['median_us'])} ({p.get('impl')}) | "
                         f"{fmt_us(b.get('median_us'))} ({b.get('impl')}) | "
                         f"{fmt_us(p.get('xla_us'))} | {fmt_us(b.get('xla_us'))} |")
        lines.append("")
    return lines


def breakdown_section(results: list[tuple[str, dict]], out_md: str) -> list[str]:
    """The newest full run's stage breakdown of the decode, verify and prefill steps."""
    runs = [r for r in results if (r[1].get("breakdown") or {}).get("runs")
            and not r[1].get("smoke")]
    if not runs:
        return []
    path, res = max(runs, key=lambda r: r[1].get("date", ""))
    rel = os.path.relpath(path, os.path.dirname(os.path.abspath(out_md)))
    bd = res["breakdown"]
    stages = ("project", "cache_writes", "pool_scores", "top_k", "expand", "attend",
              "output_projection")
    lines = ["### Where the step's time goes", "",
             f"From [`{rel}`]({rel}) ({res.get('date', '?')[:19]}, `{res.get('command')}`): "
             "each stage of `layer._append_rows` jitted alone at the step's shapes (decode "
             "`bN` and verify `bN-kK` at context "
             f"{(res.get('plan') or {}).get('ctx')}, rows padded to max_verify; `prefillS` "
             "from an empty context), median wall time; `sum` adds the stages; `step` is the "
             "whole jitted step (calls pipelined); `step, blocked` blocks after every call. "
             "`kernels` is the step's device kernel time from a profiler trace, `launches` its "
             "kernel count, `span` first kernel start to last kernel end (tracing adds gaps).",
             "",
             "| run | " + " | ".join(stages) + " | sum | step | step, blocked | kernels | "
             "launches | span |",
             "|---|" + "---|" * (len(stages) + 6)]
    for key, r in bd["runs"].items():
        if r.get("error"):
            lines.append(f"| {key} | error: `{r['error'].splitlines()[0][:100]}` |")
            continue
        cells = [fmt_us((r.get(s) or {}).get("median_us")) for s in stages]
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


def launch_section(results_dir: str, out_md: str) -> list[str]:
    """benchmarks/h200_launch.py runs (the batch-1 step: host dispatch against GPU time) that
    hold the trivial-program rows."""
    lines = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*launch*.json"))):
        with open(path) as f:
            res = json.load(f)
        rows = res.get("results") or []
        if not any(r.get("impl") == "trivial" for r in rows):
            continue
        rel = os.path.relpath(path, os.path.dirname(os.path.abspath(out_md)))
        lines += [f"### Host dispatch against GPU time at batch 1: [`{rel}`]({rel}) "
                  f"({res.get('date', '?')[:19]})", "", f"`{res.get('command')}`; each flag "
                  "set in a fresh process; `trivial` = a one-kernel program with the step's "
                  "argument buffers; `layers` > 1: that many layers in one program, figures "
                  "per layer.", "",
                  "| flag set | impl | TP | K | layers | step | kernels | idle | host dispatch |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r.get("error"):
                lines.append(f"| {r['variant']} | {r['impl']} | {r['tp']} | {r['k']} | | "
                             f"error: `{r['error'][:80]}` |")
                continue
            lines.append(f"| {r['variant']} | {r['impl']} | {r['tp']} | {r['k']} | "
                         f"{r.get('layers_in_program', 1)} | {fmt_us(r.get('step_us'))} | "
                         f"{fmt_us(r.get('kernel_us'))} | {fmt_us(r.get('idle_us'))} | "
                         f"{fmt_us(r.get('dispatch_us'))} |")
        lines.append("")
    return lines


def _met(p) -> str:
    return "yes" if p.get("met") else "**no**"


def points_table(res: dict) -> list[str]:
    lines = ["| point | impl | time | floor | time / floor | bound | target | met | XLA | "
             "vs XLA | HF | vs HF |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in res["points"]:
        name = p["name"]
        if name.startswith("memory"):
            lines.append(f"| {name} | - | {p.get('value_MiB', 0):.2f} MiB "
                         f"({p.get('value_bytes')} B) | - | - | - | {p['target']} | {_met(p)} | - "
                         f"| - | - | - |")
            continue
        roof = p.get("roofline") or {}
        extra = ""
        if "TFLOPs" in p:
            extra = f" ({p['TFLOPs']:.0f} TFLOP/s, {p.get('GBps', 0):.0f} GB/s)"
        if "ratio_vs_k1" in p and p.get("ratio_vs_k1") is not None:
            extra = f" ({p['ratio_vs_k1']:.2f}x the K=1 step)"
        lines.append(
            f"| {name} | {p.get('impl') or '-'} | {fmt_us(p.get('median_us'))}{extra} | "
            f"{fmt_us(p.get('floor_us'))} | {fmt_x(p.get('time_over_floor'))} | "
            f"{roof.get('bound', '-')} | {p['target']} | {_met(p)} | {fmt_us(p.get('xla_us'))} | "
            f"{fmt_x(p.get('ratio_vs_xla'))} | {fmt_us(p.get('hf_us'))} | "
            f"{fmt_x(p.get('ratio_vs_hf'), 4)} |")
    return lines


README_BEGIN = "<!-- bench table: generated by benchmarks/render.py -->"
README_END = "<!-- end of bench table -->"


def readme_table(path: str, res: dict) -> list[str]:
    """The main run's points, compact, for the README."""
    rel = os.path.relpath(path, ROOT)
    lines = [f"From [`{rel}`]({rel}) ({res.get('date', '?')[:16]} UTC, "
             f"{(res.get('machine') or {}).get('device', '?')}); details in BENCHMARKS.md.", "",
             "| point | time | floor | time / floor | met | vs XLA | vs HF |",
             "|---|---|---|---|---|---|---|"]
    for p in res["points"]:
        if p["name"].startswith("memory"):
            lines.append(f"| {p['name']} | {p.get('value_MiB', 0):.1f} MiB | - | - | "
                         f"{_met(p)} | - | - |")
            continue
        lines.append(f"| {p['name']} | {fmt_us(p.get('median_us'))} | "
                     f"{fmt_us(p.get('floor_us'))} | {fmt_x(p.get('time_over_floor'))} | "
                     f"{_met(p)} | {fmt_x(p.get('ratio_vs_xla'))} | "
                     f"{fmt_x(p.get('ratio_vs_hf'), 4)} |")
    return lines


def update_readme(readme: str, main) -> str:
    """Replace the README's block between the bench markers with the main run's table."""
    with open(readme) as f:
        text = f.read()
    if README_BEGIN not in text or README_END not in text:
        return f"{readme} has no bench table markers; not updated"
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    body = readme_table(*main) if main else ["No results yet."]
    with open(readme, "w") as f:
        f.write(head + README_BEGIN + "\n" + "\n".join(body) + "\n" + README_END + tail)
    return f"updated the table in {readme}"


def impl_table(res: dict) -> list[str]:
    impls = sorted({i for p in res["points"] for i in (p.get("impls") or {})})
    if not impls:
        return []
    head = "| point | " + " | ".join(f"{i} median (p10-p90)" for i in impls) + " |"
    lines = [head, "|---|" + "---|" * len(impls)]
    for p in res["points"]:
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


def public_api_table(res: dict) -> list[str]:
    """`dsa_jax.decode` (host checks, padding, the step) beside the jitted step it calls."""
    rows = []
    for p in res["points"]:
        for impl, t in (p.get("impls") or {}).items():
            pub = t.get("public_decode_us") if isinstance(t, dict) else None
            if isinstance(pub, dict) and pub.get("median_us") is not None:
                rows.append(f"| {p['name']} | {impl} | {fmt_us(t.get('median_us'))} | "
                            f"{fmt_us(pub['median_us'])} | "
                            f"{fmt_x(_safe_div(pub['median_us'], t.get('median_us')), 1)} |")
    if not rows:
        return []
    return ["### The public `dsa_jax.decode` call vs the jitted step", "",
            "Same state, same context; `decode` runs its host-side checks (a device -> host read "
            "of the lengths and block tables), pads the row to max_verify, calls the step and "
            "slices the outputs.", "",
            "| point | impl | jitted step | dsa_jax.decode | ratio |", "|---|---|---|---|---|",
            *rows, ""]


def _safe_div(a, b):
    return None if a is None or not b else a / b


def hf_table(res: dict) -> list[str]:
    hf = (res.get("baselines") or {}).get("hf") or {}
    if not hf.get("contexts"):
        why = hf.get("skipped") or (hf.get("error") or "").splitlines()[:1]
        return [f"Not measured: {why}"] if why else []
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
    sweep = lev.get("attend_split_sweep")
    if sweep:
        lines += ["### Split count of the gather-attend (pallas, R=1, H=64, W=2051, fp8)", "",
                  sweep.get("note", ""), "",
                  "| batch | splits | median | p10-p90 |", "|---|---|---|---|"]
        for r in sweep["results"].values():
            if r.get("median_us") is None:
                lines.append(f"| {r['B']} | {r['splits']} | error | "
                             f"`{(r.get('error') or '').splitlines()[0][:80]}` |")
            else:
                lines.append(f"| {r['B']} | {r['splits']} | {fmt_us(r['median_us'])} | "
                             f"{fmt_us(r.get('p10_us'))}-{fmt_us(r.get('p90_us'))} |")
        lines.append("")
    for key, title, base, other in (
            ("kv_b_absorbed_vs_runtime_measured", "Absorbed vs run-time kv_b (measured)",
             "runtime", "absorbed"),
            ("pool_keys_cached_vs_recomputed", "Pool keys cached vs recomputed (measured)",
             "cached", "recomputed"),
            ("fused_projections_vs_separate", "Fused input GEMMs vs separate (measured)",
             "fused", "separate"),
            ("donated_state_vs_copied", "State donated vs copied (measured)",
             "donated", "copied")):
        lines += _two_forms_table(lev.get(key) or {}, title, base, other)
    pad = lev.get("decode_rows_padded_to_max_verify")
    if pad:
        lines += ["### Decode rows padded to max_verify", "", pad.get("note", ""), "",
                  "| impl | max_verify=1 | padded step |", "|---|---|---|"]
        for impl, r in pad["results"].items():
            lines.append(f"| {impl} | {fmt_us(r.get('median_us'))} | "
                         f"{fmt_us(r.get('padded_step_us'))} |")
        lines.append("")
    return lines


def _two_forms_table(lever: dict, title: str, base: str, other: str) -> list[str]:
    """A measured lever with two forms: device kernel times, their ratio, wall times."""
    if not lever.get("results"):
        return []
    lines = [f"### {title}", "", lever.get("note", ""), "",
             f"| case | {base} kernels | {other} kernels | {other} / {base} (kernels) | "
             f"{base} wall | {other} wall |", "|---|---|---|---|---|---|"]
    for case, r in lever["results"].items():
        lines.append(f"| {case} | {fmt_us(r.get(f'{base}_kernel_us'))} | "
                     f"{fmt_us(r.get(f'{other}_kernel_us'))} | "
                     f"{fmt_x(r.get(f'{other}_over_{base}_kernel'))} | "
                     f"{fmt_us(r.get(f'{base}_us'))} | {fmt_us(r.get(f'{other}_us'))} |")
    return lines + [""]


def levers_from_newest(results: list[tuple[str, dict]], out_md: str) -> list[str]:
    """The levers of the newest full run that measured them (the main run may skip them)."""
    runs = [r for r in results if (r[1].get("levers") or {}).get(
        "kv_b_absorbed_vs_runtime") and not r[1].get("smoke")]
    if not runs:
        return []
    path, res = max(runs, key=lambda r: r[1].get("date", ""))
    rel = os.path.relpath(path, os.path.dirname(os.path.abspath(out_md)))
    return ["## Levers", "", f"From [`{rel}`]({rel}) ({res.get('date', '?')[:19]}).", ""] + \
        levers_section(res)


def plot_scaling(res: dict, png: str) -> bool:
    pts = [p for p in res["points"] if p.get("group") == "scaling"]
    if not pts:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts.sort(key=lambda p: p["ctx"])
    ctx = [p["ctx"] for p in pts]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    impls = sorted({i for p in pts for i in p.get("impls", {})})
    for impl, marker in zip(impls, "os^v", strict=False):
        ys = [(p["impls"].get(impl) or {}).get("median_us") for p in pts]
        xs = [c for c, y in zip(ctx, ys, strict=True) if y is not None]
        ys = [y for y in ys if y is not None]
        if ys:
            ax.plot(xs, ys, marker=marker, label=f"dsa_jax {impl}")
    floors = [p.get("floor_us") for p in pts]
    ax.plot(ctx, floors, "k--", label="roofline floor")
    hf = [(p["ctx"], p["hf_us"]) for p in pts if p.get("hf_us")]
    if hf:
        ax.plot([c for c, _ in hf], [u for _, u in hf], marker="x", color="tab:red",
                label="HF glm5_next (torch bf16)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ctx)
    ax.set_xticklabels([f"{c // 1024}K" if c >= 1024 else str(c) for c in ctx])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode step, 1 sequence (us)")
    dev = (res.get("machine") or {}).get("device", "?")
    top = pts[0].get("max_context")
    top_s = f"{top // 1024}K" if top and top >= 1024 else str(top)
    ax.set_title(f"DSA decode step, batch 1, vs context\n({dev}; one compiled step, "
                 f"max_context {top_s})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


def render(results_dir: str, out_md: str, png: str, readme: str | None = None) -> int:
    results = load(results_dir)
    main = pick_main(results)
    if readme:
        print(f"render: {update_readme(readme, main)}")
    lines = ["# Benchmarks", "",
             "Generated by `python benchmarks/render.py` from `benchmarks/results/*.json` "
             "(written by `dsa-jax bench` / `python -m dsa_jax.bench`). Do not edit by hand; "
             "the analysis comes from `benchmarks/notes.md`.", ""]
    if main is None:
        lines.append("No results yet.")
    else:
        path, res = main
        m = res.get("machine") or {}
        c = res.get("ceilings") or {}
        rel = os.path.relpath(path, os.path.dirname(os.path.abspath(out_md)))
        lines += [
            f"## {m.get('device', '?')} — {res.get('date', '?')[:19]} UTC", "",
            f"- result: [`{rel}`]({rel})",
            f"- command: `{res.get('command')}`",
            f"- jax {res.get('jax_version')} ({m.get('backend')}), jaxlib {m.get('jaxlib')}, "
            f"triton {m.get('triton', '-')}, torch {m.get('torch', '-')}, transformers "
            f"{m.get('transformers', '-')}, Python {m.get('python')}",
            f"- nvidia-smi: {m.get('nvidia_smi', '-')}",
            f"- measured ceilings (this run): copy **{c.get('copy_GBps', 0):.0f} GB/s** "
            f"(read + write), bf16 matmul **{c.get('matmul_bf16_TFLOPs', 0):.0f} TFLOP/s**",
            f"- floor: {res.get('floor_rule')}",
            f"- timing: {res.get('timing_method')}",
            f"- {res.get('tp_note')}",
            f"- run time {res.get('elapsed_s', 0):.0f} s", ""]
        n_met = sum(1 for p in res["points"] if p.get("met"))
        lines += [f"### Points ({n_met} of {len(res['points'])} met)", ""]
        lines += points_table(res) + [""]
        lines += ["### Both implementations of the layer step / kernels", ""]
        lines += impl_table(res) + [""]
        lines += public_api_table(res)
        lines += ["### Hugging Face glm5_next baseline (one decode step, batch 1)", ""]
        lines += hf_table(res) + [""]
        if plot_scaling(res, png):
            relp = os.path.relpath(png, os.path.dirname(os.path.abspath(out_md)))
            lines += ["### Scaling", "", f"![decode step vs context]({relp})", ""]
        lines += reruns_section(results, main, out_md)
        lines += breakdown_section(results, out_md)
        lines += launch_section(results_dir, out_md)
        lines += levers_from_newest(results, out_md)
        if res.get("skipped"):
            lines += ["### Skipped", ""] + [f"- {s['group']}: {s['reason']}"
                                            for s in res["skipped"]] + [""]
        errs = res.get("errors") or []
        if errs:
            lines += ["### Errors (whole groups)", ""] + [
                f"- {e.get('group')}: `{(e.get('error') or '').splitlines()[0][:200]}`"
                for e in errs] + [""]
    notes = os.path.join(ROOT, "benchmarks", "notes.md")
    if os.path.exists(notes):
        with open(notes) as f:
            lines += [f.read().rstrip(), ""]
    if results:
        lines += ["## All result files", ""]
        for path, res in results:
            rel = os.path.relpath(path, os.path.dirname(os.path.abspath(out_md)))
            lines.append(f"- [`{rel}`]({rel}): {(res.get('machine') or {}).get('device', '?')}, "
                         f"{res.get('date', '?')[:19]}, {len(res['points'])} points"
                         + (" (smoke)" if res.get("smoke") else ""))
        lines.append("")
    with open(out_md, "w") as f:
        f.write("\n".join(lines))
    print(f"render: wrote {out_md}" + (f" and {png}" if main and os.path.exists(png) else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"))
    ap.add_argument("--png", default=None, help="default: <results>/scaling.png")
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"),
                    help="README whose bench-table block is replaced ('' to leave it)")
    args = ap.parse_args(argv)
    png = args.png or os.path.join(args.results, "scaling.png")
    return render(args.results, args.out, png, args.readme or None)


if __name__ == "__main__":
    sys.exit(main())
