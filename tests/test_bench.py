"""The benchmark suite (`benchmarks/`, outside the installed package), on the CPU: the smoke
plan of the whole suite (serving loop included), the JSON schema (also of every committed
result), the cost functions against the committed H200 run's roofline, the targets' `met`
rules, render from one run, and that the suite uses only dsa_jax's public modules and names."""

import ast
import fcntl
import glob
import json
import os
import subprocess
import sys

import pytest

from benchmarks import points, render, roofline, schema
from benchmarks.__main__ import main as bench_main
from dsa_jax import cli
from dsa_jax.shapes import ODD, glm53_flash, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
MAIN_RUN = os.path.join(RESULTS, "h200-bench-20261204-s22-call2.json")


def run_bench(out, name: str, *args: str) -> dict:
    """`python -m benchmarks --smoke ...` in a subprocess (its own XLA flags: the smoke
    compiles at optimization level 0); the run's JSON."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, "-m", "benchmarks", "--smoke", "--no-progress",
                        "--out", str(out), "--name", name, *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert [os.path.basename(f) for f in glob.glob(os.path.join(out, "*.json"))] == [name]
    with open(os.path.join(out, name)) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def smoke_result(tmp_path_factory, pytestconfig):
    """One smoke run per test session, shared by the pytest-xdist workers (the first to come
    runs it, under a lock, in the session's shared temp folder)."""
    # tp8 runs the same code as tp1 with another config, and the HF baseline needs torch:
    # both are left out here to keep the test short (tests/test_bench_hf.py runs the HF one);
    # the stage breakdown and the fp8 group run with --long.
    skip = "tp8" if pytestconfig.getoption("--long") else "tp8,breakdown,fp8"
    args = ("smoke.json", "--no-hf", "--no-levers", "--skip", skip)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return run_bench(tmp_path_factory.mktemp("bench"), *args)
    shared = tmp_path_factory.getbasetemp().parent  # this session's, common to its workers
    with open(shared / "bench-smoke.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = shared / "bench-smoke" / "smoke.json"
        if path.exists():
            return json.loads(path.read_text())
        return run_bench(path.parent, *args)


def _by_name(result):
    return {p["name"]: p for p in result["points"]}


def test_smoke_run_has_the_schema(smoke_result):
    assert schema.result_problems(smoke_result) == []
    assert smoke_result["command"].startswith("python -m benchmarks --smoke")
    assert smoke_result["ceilings"]["copy_GBps"] > 0
    assert smoke_result["ceilings"]["matmul_bf16_TFLOPs"] > 0
    floor = smoke_result["ceilings"]["detail"]["jax_call_floor"]
    assert smoke_result["ceilings"]["call_floor_us"] == floor["median_us"] > 0
    assert smoke_result["plan"]["big_batch"] == 2 and smoke_result["smoke"] is True
    assert "commit" in smoke_result  # git's short hash here, else the --note


@pytest.mark.parametrize("head,dirty,note,want", [
    ("abc1234", "", "tree def5678", "abc1234"),
    ("abc1234", " M dsa_jax/x.py", "tree def5678", "abc1234+changes (tree def5678)"),
    ("abc1234", " M dsa_jax/x.py", "", "abc1234+changes"),
    (None, "", "tree def5678", "tree def5678")])
def test_a_run_names_its_commit_and_the_note_where_the_tree_differs(monkeypatch, head, dirty,
                                                                    note, want):
    """A device's copy of the tree may carry an older .git: where the tree differs from its
    HEAD the --note (the tree's commit) is recorded beside it; without git, the note."""
    import benchmarks.__main__ as bm

    def fake_run(cmd, **_):
        out = (head or "") if "rev-parse" in cmd else dirty
        return subprocess.CompletedProcess(cmd, 0 if head else 128, stdout=out, stderr="")

    monkeypatch.setattr(bm.subprocess, "run", fake_run)
    assert bm.git_commit(note) == want


def test_every_committed_result_keeps_the_schema():
    """benchmarks/results/ holds one bench run per card kind and at most one `--only peers`
    and one `--only fp8` run per card kind (no points of their own), each with the bench
    schema."""
    runs = schema.load_runs(RESULTS)
    assert len(runs) == len(glob.glob(os.path.join(RESULTS, "*.json"))) >= 1

    def kind(res):
        if res["points"]:
            return "bench"
        if (res.get("peers") or {}).get("points"):
            return "peers"
        assert (res.get("fp8_weights") or {}).get("points"), res.get("command")
        return "fp8"

    for want in ("bench", "peers", "fp8"):
        cards = [render.card_of(res) for _, res in runs if kind(res) == want]
        assert sorted(cards) == sorted(set(cards)), (want, cards)
        assert want != "bench" or "h200" in cards, cards
    for path, res in runs:
        assert schema.result_problems(res) == [], path
        assert not res.get("smoke"), path


def test_json_round_trip_keeps_every_field(smoke_result, tmp_path):
    path = str(tmp_path / "r.json")
    schema.write_json(path, smoke_result)
    (loaded,) = [res for _, res in schema.load_runs(str(tmp_path))]
    assert loaded == smoke_result and not os.path.exists(path + ".tmp")
    broken = json.loads(json.dumps(smoke_result))
    del broken["points"][0]["floor_us"]
    broken["points"][1]["met"] = "yes"
    problems = schema.result_problems(broken)
    assert len(problems) == 2 and "floor_us" in problems[0] and "met" in problems[1]


def test_the_smoke_plan_runs_every_point(smoke_result):
    cfg = tiny(implementation="xla")
    want = [p.name for p in points.plan_points(cfg, points.smoke_plan(cfg))
            if p.group != "tp8"]
    assert [p["name"] for p in smoke_result["points"]] == want
    names = set(want)
    for name in ("decode-b1-k1-tp1", "verify-b1-k3-tp1", "decode-b2-k1-tp1", "public-decode-b1",
                 "selection-b2", "selection-b2-r4", "compile-b1-k1", "loop-b1-l2",
                 "loop-b2-l2", "spec-b1-l2-k3", "engine-b2-l2"):
        assert name in names, name
    assert sum(n.startswith("attend-kernel-") for n in names) == 2
    assert sum(n.startswith("scaling-") for n in names) == 3
    assert smoke_result["errors"] == [] and smoke_result["skipped"] == []


def test_timed_points_have_xla_times_and_a_floor(smoke_result):
    for p in smoke_result["points"]:
        if p["group"] in ("memory", "loop") or p["name"].startswith(("compile", "public")):
            continue
        assert p["xla_us"] is not None and p["xla_us"] > 0, p["name"]
        assert p["floor_us"] is not None and p["floor_us"] > 0, p["name"]
        assert p["roofline"]["bound"] in ("bytes", "flops")
        assert p["median_us"] is not None and p["time_over_floor"] > 0


def test_met_in_the_json_is_the_points_rule(smoke_result):
    """Each recorded verdict is its point's pure rule applied to the recorded point."""
    cfg = tiny(implementation="xla")
    plan = {p.name: p for p in points.plan_points(cfg, points.smoke_plan(cfg))}
    verdicts = set()
    for p in smoke_result["points"]:
        point = plan[p["name"]]
        assert p["target"] == point.target
        # A timed point whose every implementation failed is not met, whatever its rule.
        assert p["met"] == (False if p["impls"] and p["median_us"] is None else point.met(p))
        verdicts.add(p["met"])
    assert verdicts == {True, False}


def test_lone_call_points_record_their_call_floor(smoke_result):
    """The attend and selection points (lone calls) carry the floor of their call on the host
    that ran them, and the table shows it beside the kernels."""
    from benchmarks.render_tables import time_cell

    pts = _by_name(smoke_result)
    lone = [n for n in pts if n.startswith(("attend-kernel-", "selection-"))]
    assert len(lone) == 4, lone
    for name in lone:
        p = pts[name]
        assert p["call_floor_us"] > 0 and p["impls"]["xla"]["call_floor_us"] > 0, name
        p = {**p, "kernel_us": 1.0}  # a CPU trace has no kernels; the cell's form
        assert time_cell(p).endswith(f"call floor {schema.fmt_us(p['call_floor_us'])})"), \
            time_cell(p)
    assert "call_floor_us" not in pts["decode-b1-k1-tp1"]


def test_the_serving_loop_points_are_measured(smoke_result):
    """The loop group: the device loop at 1 and big_batch sequences, speculation with the
    scripted drafter (its tokens those of plain decoding) and the engine's step, each timed
    per token (or step) per layer; no kernel time on a CPU; the pallas attempt recorded."""
    from benchmarks.render_tables import time_cell

    pts = _by_name(smoke_result)
    for name in ("loop-b1-l2", "loop-b2-l2"):
        p = pts[name]
        assert p["impl"] == "xla" and p["median_us"] == p["us_per_token_per_layer"] > 0
        assert p["dispatch_us"] == pytest.approx(p["median_us"] * 4 * 2)  # 4 tokens, 2 layers
        assert p["kernel_us_per_token_per_layer"] is None and p["met"] is False
        assert "ImplementationError" in p["impls"]["pallas"]["error"]
        assert time_cell(p).endswith("per token per layer"), time_cell(p)
    spec = pts["spec-b1-l2-k3"]
    assert spec["tokens_equal_plain"] is True and spec["tokens_per_s"] > 0 and spec["met"]
    assert 0 < spec["measured_acceptance"] <= 1 and spec["stated_acceptance"] == 0.7
    assert "tok/s" in time_cell(spec)
    eng = pts["engine-b2-l2"]
    assert eng["median_us"] == eng["per_step_per_layer_us"] > 0 and eng["tokens_per_s"] > 0
    assert time_cell(eng).endswith("per step per layer")


def test_pallas_off_gpu_is_recorded_and_one_compile_serves_every_context(smoke_result):
    p = _by_name(smoke_result)["decode-b1-k1-tp1"]
    assert p["impl"] == "xla"  # the pallas step cannot run on a CPU: recorded, run goes on
    assert p["impls"]["pallas"]["median_us"] is None
    assert "ImplementationError" in p["impls"]["pallas"]["error"]
    p = _by_name(smoke_result)["compile-b1-k1"]
    assert p["impls"]["xla"]["compiles"] == 1 and p["compiles"] == 1 and p["met"]
    # Every first call of the config (smoke: the decode points share it) at every context.
    assert {c["ctx"] for c in p["impls"]["xla"]["calls"]} == set(p["contexts"])


def test_public_decode_is_timed_beside_the_step(smoke_result):
    pts = _by_name(smoke_result)
    p = pts["public-decode-b1"]
    t = p["impls"]["xla"]
    assert p["median_us"] == t["median_us"] > 0 and t["inner"] == 1  # synced every call
    assert t["step_us"] > 0 and p["device_step_us"] is None  # no kernel trace on a CPU
    assert p["met"] is False
    assert pts["decode-b1-k1-tp1"]["kernel_us"] is None


@pytest.mark.long
def test_breakdown_covers_decode_verify_prefill_and_tp8(smoke_result):
    """The stage breakdown runs the decode (1 and big_batch sequences), the K=3 verify, a
    prompt, and the batch-1 decode at TP 8 (one rank), each with every stage and the step."""
    runs = smoke_result["breakdown"]["runs"]
    for key in ("xla-b1", "xla-b2", "xla-b1-k3", "xla-prefill4", "xla-b1-tp8"):
        res = runs[key]
        assert "error" not in res, (key, res.get("error"))
        for stage in ("project", "cache_writes", "pool_scores", "top_k", "expand", "attend",
                      "output_projection"):
            assert res[stage]["median_us"] > 0, (key, stage)
        assert res["step_us"] > 0
    pub = runs["xla-b1"]["public_decode"]
    assert pub["decode_us"] > 0 and pub["decode_unchecked_us"] > 0 and pub["host_checks_us"] > 0
    assert "public_decode" not in runs["xla-b1-tp8"]


@pytest.mark.long
def test_the_fp8_group_runs_both_weights_on_the_same_checkpoint(smoke_result):
    """Every point of the fp8 group on fp8 and on bf16 weights, their outputs `==`, the fp8
    weights' bytes about half."""
    r = smoke_result["fp8_weights"]
    assert r["same_outputs"] == {"equal": True}
    assert 0.45 < r["weight_bytes_fp8_over_bf16"] < 0.52
    assert set(r["points"]) == {"decode-b1-k1-tp1", "decode-b2-k1-tp1", "verify-b1-k3-tp1",
                                "prefill-4", "loop-b1-l2"}
    for name, res in r["points"].items():
        for side in ("bf16", "fp8"):
            assert res[side]["median_us"] > 0, (name, side, res[side])
        assert res["fp8_over_bf16_median_us"] > 0
    for key in ("decode-b1", "decode-b2", "prefill-4"):  # a CPU trace records no kernels
        assert set(r[f"{key}-kernels"]) == {"bf16", "fp8"}, key


def test_python_m_benchmarks_and_dsa_jax_bench(monkeypatch, capsys):
    assert bench_main(["--only", "nonsense"]) == 2
    assert "unknown group(s) ['nonsense']" in capsys.readouterr().err
    p = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "usage: python -m benchmarks" in p.stdout
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0 and "usage: dsa-jax bench" in capsys.readouterr().out
    # An installed package without the checkout's benchmarks/ says what to run instead.
    monkeypatch.setattr(cli.os.path, "isfile", lambda path: False)
    assert cli.main(["bench", "--smoke"]) == 2
    assert "run `python -m benchmarks`" in capsys.readouterr().err




def test_prefill_cost_is_the_sum_of_its_rows():
    for s in (1, 5, 37):
        _, flops = roofline.prefill_cost(ODD, 0, s)
        assert flops == sum(sum(roofline.row_flops(ODD, t + 1).values()) for t in range(s))
    _, f1 = roofline.step_cost(ODD, 0, 3, 2, 50)
    assert f1 == 3 * 2 * sum(roofline.row_flops(ODD, 50).values())


def test_cost_functions_reproduce_the_committed_roofline():
    """The costs as the committed H200 run computed them (GLM-5.3-Flash, fp8 cache): the
    weights' bytes are inferred from one decode point, every other point must then match."""
    cfg = glm53_flash()
    with open(MAIN_RUN) as f:
        pts = _by_name(json.load(f))
    ctx = cfg.max_context
    roof = pts["decode-b1-k1-tp1"]["roofline"]
    pb = roof["bytes"] - roofline.step_cost(cfg, 0, 1, 1, ctx)[0]
    assert 0 < pb < 2 ** 30
    cases = {"decode-b1-k1-tp1": roofline.step_cost(cfg, pb, 1, 1, ctx),
             "verify-b1-k3-tp1": roofline.step_cost(cfg, pb, 1, 3, ctx),
             "decode-b64-k1-tp1": roofline.step_cost(cfg, pb, 64, 1, ctx),
             "scaling-b1-k1-ctx65536": roofline.step_cost(cfg, pb, 1, 1, 65536),
             "prefill-9000": roofline.prefill_cost(cfg, pb, 9000),
             "selection-b64": roofline.selection_cost(cfg, 64, 1, ctx),
             "selection-b64-r4": roofline.selection_cost(cfg, 64, 4, ctx),
             "attend-kernel-64x1-h64-w2051": roofline.attend_cost(64, 1, 64, 2051, 512),
             "attend-kernel-128x2-h128-w2048": roofline.attend_cost(128, 2, 128, 2048, 512)}
    missing = [name for name in cases if name not in pts]
    # that run measured the decode, kernel and selection groups (prefill ran out of budget)
    assert missing == ["scaling-b1-k1-ctx65536", "prefill-9000"], missing
    for name, (nbytes, flops) in cases.items():
        if name in missing:
            continue
        assert (pts[name]["roofline"]["bytes"], pts[name]["roofline"]["flops"]) == (
            nbytes, flops), name


def test_rules_judge_at_and_past_the_bound():
    rule = points.time_at_most(55.0)
    assert rule.words == "<= 55 us" and rule.needs == ("median_us",)
    assert rule({"median_us": 55.0}) and not rule({"median_us": 55.01})
    assert not rule({"median_us": None}) and not rule({})
    assert points.time_at_most(10_000.0, " per layer").words == "<= 10 ms per layer"
    rel = points.times("floor_us", 1.35, "floor")
    assert rel({"median_us": 135.0, "floor_us": 100.0})
    assert not rel({"median_us": 136.0, "floor_us": 100.0})
    assert not rel({"median_us": 1.0, "floor_us": None}) and rel.needs == ("median_us",
                                                                           "floor_us")
    mem = points.bytes_at_most(10 * points.MiB)
    assert mem.words == "<= 10 MiB" and mem({"value_bytes": 10 * 2 ** 20})
    assert not mem({"value_bytes": 18_875_400})
    one = points.Equals("compiles", 1, "exactly one compile")
    assert one({"compiles": 1}) and not one({"compiles": 2}) and not one({})
    seen = points.Reported("tokens_per_s")
    assert seen({"tokens_per_s": 3.0}) and not seen({"tokens_per_s": None})


def test_full_plan_targets_state_their_numbers():
    cfg = glm53_flash()
    pts = {p.name: p for p in points.plan_points(cfg, points.full_plan(cfg))}
    expect = {"attend-kernel-64x1-h64-w2051": ("<= 55 us", {"median_us": 55.0}),
              "attend-kernel-128x2-h128-w2048": ("<= 450 us", {"median_us": 450.0}),
              "selection-b64": ("<= 40 us", {"median_us": 40.0}),
              "selection-b64-r4": ("<= 60 us", {"median_us": 60.0}),
              "decode-b64-k1-tp1": ("<= 250 us", {"median_us": 250.0}),
              "decode-b1-k1-tp1": ("device kernel time <= 100 us", {"kernel_us": 100.0}),
              "prefill-9000": ("<= 10 ms per layer", {"median_us": 10_000.0}),
              "memory-state-bytes-per-seq-ctx16384": ("<= 10 MiB",
                                                      {"value_bytes": 10 * 2 ** 20}),
              "public-decode-b1": ("<= 2 x the device step",
                                   {"median_us": 200.0, "device_step_us": 100.0}),
              "loop-b1-l8": ("<= 1.1 x the layers' kernel time",
                             {"us_per_token_per_layer": 11.0,
                              "kernel_us_per_token_per_layer": 10.0}),
              "loop-b64-l8": ("<= 1.2 x the layers' kernel time",
                              {"us_per_token_per_layer": 12.0,
                               "kernel_us_per_token_per_layer": 10.0})}
    for name, (words, at_bound) in expect.items():
        p = pts[name]
        assert words in p.target, (name, p.target)
        assert p.met(at_bound), name
        over = {k: v * 1.01 if k in p.rule.needs[:1] else v for k, v in at_bound.items()}
        assert not p.met(over), name
    kinds = {"loop-b1-l8": "loop", "loop-b64-l8": "loop", "spec-b1-l8-k3": "spec",
             "engine-b64-l8": "engine"}
    for name, kind in kinds.items():
        assert pts[name].kind == kind and pts[name].group == "loop"
        assert pts[name].params["layers"] == 8 and pts[name].params["tokens_per_dispatch"] == 32
    assert pts["loop-b1-l8"].params["ctx"] == pts["spec-b1-l8-k3"].params["ctx"] == 16384
    assert pts["spec-b1-l8-k3"].params["drafts"] == 3
    assert pts["engine-b64-l8"].params["prompt"] == 2048
    assert pts["engine-b64-l8"].met({"per_step_per_layer_us": 15.0,
                                     "kernel_per_step_per_layer_us": 10.0})
    assert {p.group for p in pts.values()} <= set(points.GROUPS)
    from benchmarks.suite import MEASURES
    assert {p.kind for p in pts.values()} <= set(MEASURES)




def _render(tmp_path, *args, readme=""):
    md, png = tmp_path / "BENCHMARKS.md", tmp_path / "scaling.png"
    assert render.main([*args, "--out", str(md), "--png", str(png), "--readme", str(readme)]) == 0
    return md.read_text(), png


def test_render_shows_one_run(tmp_path):
    """BENCHMARKS.md comes from one run: by default the newest complete run of the H200 (here
    none is complete: the newest, said so), named with its card, jax version and commit;
    today's targets applied to its points; the plan's points it lacks listed."""
    text, png = _render(tmp_path, "--results", RESULTS)
    assert "h200-bench-20261204-s22-call2.json" in text and "h100-bench" not in text
    assert "**NVIDIA H200**, jax **0.11.2**, commit **not recorded" in text
    table = text.split("### Points of today's plan this run did not measure")[0]
    row = next(r for r in table.splitlines() if r.startswith("| decode-b64-k1-tp1 |"))
    assert "| 233.0 us (kernels 188.1 us) |" in row and "context 16384: <= 250 us | yes |" in row
    row = next(r for r in table.splitlines() if r.startswith("| attend-kernel-64x1-"))
    assert "| 126.4 us (kernels 57.3 us) |" in row and "<= 55 us | **no** |" in row
    assert "## The run's points (4 of 8 met)" in text
    absent = text.split("### Points of today's plan this run did not measure")[1]
    for name in ("prefill-9000", "loop-b1-l8", "spec-b1-l8-k3", "engine-b64-l8",
                 "memory-state-bytes-per-seq-ctx16384"):
        assert f"| {name} |" in absent, name
    assert not png.exists()  # the run has no scaling points
    (h100_run,) = [f for f in os.listdir(RESULTS) if f.startswith("h100-bench")]  # one a card
    h100, _ = _render(tmp_path, "--results", RESULTS, "--card", "h100")
    assert h100_run in h100 and "NVIDIA H100" in h100
    # A file on the command line, whatever the card.
    again, _ = _render(tmp_path, os.path.join(RESULTS, h100_run))
    assert again == h100


def test_render_picks_the_newest_complete_run(tmp_path):
    current = render.current_points()
    full = {"machine": {"device": "NVIDIA H200"}, "date": "2026-12-01", "smoke": False,
            "points": [{"name": n, "median_us": 1.0} for n in current]}
    newer = {**full, "date": "2026-12-02", "points": full["points"][:3]}
    h100 = {**full, "date": "2026-12-03", "machine": {"device": "NVIDIA H100 80GB HBM3"}}
    for name, res in (("a", full), ("b", newer), ("c", h100)):
        (tmp_path / f"{name}.json").write_text(json.dumps(res))
    assert render.pick_run(str(tmp_path), "h200", current)[0].endswith("a.json")
    assert render.pick_run(str(tmp_path), "h100", current)[0].endswith("c.json")
    (tmp_path / "a.json").unlink()  # no complete H200 run: the newest
    assert render.pick_run(str(tmp_path), "h200", current)[0].endswith("b.json")
    assert render.pick_run(str(tmp_path), "a100", current) is None


def test_render_writes_the_readme_block_from_the_run(smoke_result, tmp_path):
    full = json.loads(json.dumps(smoke_result))
    full["smoke"] = False
    full["commit"] = "abc1234"
    run = tmp_path / "run.json"
    run.write_text(json.dumps(full))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{render.README_BEGIN}\nold\n{render.README_END}\nrest\n")
    text, png = _render(tmp_path, str(run), readme=readme)
    assert "| decode-b1-k1-tp1 |" in text and png.exists()
    assert "commit **abc1234**" in text and "jax **" in text
    row = next(r for r in text.splitlines() if r.startswith("| loop-b1-l2 |"))
    assert "per token per layer" in row
    new = readme.read_text()
    assert new.startswith("intro\n") and new.endswith(f"{render.README_END}\nrest\n")
    assert "old" not in new and "| decode-b1-k1-tp1 |" in new and "commit abc1234" in new
    row = next(r for r in new.splitlines() if r.startswith("| spec-b1-l2-k3 |"))
    assert "tok/s" in row


def test_render_adds_the_peers_run_of_the_same_card(tmp_path):
    """A `--only peers` run (no points of its own) is never the rendered run; the newest one
    of the run's card adds its table to BENCHMARKS.md and one line to the README block."""
    current = render.current_points()
    (h100_run,) = [f for f in os.listdir(RESULTS) if f.startswith("h100-bench")]
    with open(os.path.join(RESULTS, h100_run)) as f:
        run = json.load(f)
    point = {"peer": "flash_mla_with_kvcache, V32", "ours_us": 5.0, "peer_us": 4.0,
             "ratio": 1.25, "ours_wall_us": 9.0, "peer_wall_us": 8.0, "rel_diff": 0.004}
    peers = {"machine": run["machine"], "date": "2099-12-02", "points": [],
             "peers": {"card": "H100", "points": {"attend-decode-1x1-h64": point,
                                                  "selection-64x16K": {**point, "ratio": 0.5,
                                                                       "overlap": 0.97}},
                       "skipped": {}}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    (tmp_path / "peers.json").write_text(json.dumps(peers))
    assert render.pick_run(str(tmp_path), "h100", current)[0].endswith("run.json")
    assert render.pick_group(str(tmp_path), "h100", "peers")[0].endswith("peers.json")
    assert render.pick_group(str(tmp_path), "h200", "peers") is None
    readme = tmp_path / "README.md"
    readme.write_text(f"{render.README_BEGIN}\n{render.README_END}\n")
    text, _ = _render(tmp_path, "--results", str(tmp_path), "--card", "h100", readme=readme)
    rows = text.split("## Against the peers, on the same card")[1].splitlines()
    row = next(r for r in rows if r.startswith("| attend-decode-1x1-h64 |"))
    assert "| 5.0 us | 4.0 us | **1.25x** |" in row and "rel. diff 4.0e-03" in row
    row = next(r for r in rows if r.startswith("| selection-64x16K |"))
    assert "| 0.50x |" in row and "overlap 0.970" in row
    assert "attend-decode 1.25x, selection 0.50x" in readme.read_text()


def test_render_adds_the_fp8_run_of_the_same_card(tmp_path):
    """A `--only fp8` run adds its table: per point both sides' kernels and wall and their
    ratio, and the weight GEMMs against their fp8 floor."""
    (h100_run,) = [f for f in os.listdir(RESULTS) if f.startswith("h100-bench")]
    with open(os.path.join(RESULTS, h100_run)) as f:
        run = json.load(f)
    point = {"bf16": {"median_us": 200.0, "kernel_us": 120.0},
             "fp8": {"median_us": 150.0, "kernel_us": 90.0},
             "fp8_over_bf16_median_us": 0.75, "fp8_over_bf16_kernel_us": 0.75}
    gemm = {"bf16_kernel_us": 47.0, "fp8_kernel_us": 35.0, "fp8_over_bf16_kernel": 0.745,
            "fp8_bytes_floor_us": 24.0, "fp8_over_floor_kernel": 1.458, "same_bits": True}
    fp8 = {"machine": run["machine"], "date": "2099-12-02", "points": [],
           "fp8_weights": {"points": {"decode-b1-k1-tp1": point},
                           "weight_bytes_per_layer": {"bf16": 2.5e8, "fp8": 1.25e8},
                           "gemms": {"results": {"o_proj-m1": gemm}}}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    (tmp_path / "fp8.json").write_text(json.dumps(fp8))
    assert render.pick_group(str(tmp_path), "h100", "fp8_weights")[0].endswith("fp8.json")
    assert render.pick_group(str(tmp_path), "h100", "peers") is None
    text, _ = _render(tmp_path, "--results", str(tmp_path), "--card", "h100")
    rows = text.split("## FP8 weights beside bf16, on the same card")[1].splitlines()
    assert "| decode-b1-k1-tp1 | 120.0 us | 90.0 us | 0.75x | 200.0 us | 150.0 us |" in rows
    assert "| o_proj-m1 | 47.0 us | 35.0 us | 0.74x | - | - | 24.0 us | 1.46x | True |" in rows
    assert "bf16 250.0 MB, fp8 125.0 MB" in text


@pytest.mark.long
def test_measured_levers(tmp_path):
    """The levers group (xla only on a CPU): the absorbed kv_b form and the separate input GEMMs
    compute the same function as the step's forms (tiny config: fp32 weights, so only fp32
    rounding apart)."""
    lev = run_bench(tmp_path, "levers.json", "--only", "levers", "--impls", "xla")["levers"]
    kv_b = lev["kv_b_absorbed_vs_runtime_measured"]["results"]
    assert set(kv_b) == {"tp1-b1", "tp1-b2", "tp8-b1", "tp8-b2"}
    for res in kv_b.values():
        assert res["q_rel_diff"] < 1e-5 and res["o_rel_diff"] < 1e-5, res
        assert res["runtime_us"] > 0 and res["absorbed_us"] > 0
    fused = lev["fused_projections_vs_separate"]["results"]
    assert set(fused) == {"tp1-b1", "tp1-b2", "tp8-b1", "tp8-b2"}
    for res in fused.values():  # the same projections (fp32 weights: rounding apart)
        assert res["max_rel_diff"] < 1e-5 and res["fused_us"] > 0 and res["separate_us"] > 0


NAMEDTUPLE_API = ("_replace", "_fields", "_asdict")  # public despite the underscore


def private_dsa_jax_names(source: str) -> list[str]:
    """Underscore names of dsa_jax that `source` imports or reads off a dsa_jax module."""
    tree = ast.parse(source)
    modules, bad = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dsa_jax":
            bad += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            if any(p.startswith("_") for p in node.module.split(".")):
                bad.append(node.module)
            modules |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "dsa_jax":
                    bad += [a.name for p in a.name.split(".") if p.startswith("_")]
                    modules.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and node.attr not in NAMEDTUPLE_API):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                bad.append(f"{ast.unparse(node)}")
    return bad


def test_benchmarks_use_only_public_dsa_jax_names():
    assert private_dsa_jax_names("from dsa_jax import layer\nlayer._step_jit(1)\n") == [
        "layer._step_jit"]
    assert private_dsa_jax_names("from dsa_jax.projection import _matmul\n") == [
        "dsa_jax.projection._matmul"]
    assert private_dsa_jax_names("import dsa_jax.layer as L\nL.step(1)\n") == []
    files = glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
    assert len(files) >= 10
    for path in files:
        with open(path) as f:
            assert private_dsa_jax_names(f.read()) == [], path


def test_benchmarks_import_no_kernel_module():
    """The suite reaches the kernels through the package's public modules only (dsa_jax,
    layer, attend, indexer, select, serve, engine, model, ...), never `dsa_jax.pallas`."""
    for path in glob.glob(os.path.join(ROOT, "benchmarks", "**", "*.py"), recursive=True):
        with open(path) as f:
            tree = ast.parse(f.read())
        mods = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in mods if m.startswith("dsa_jax.pallas")], path
        froms = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                 and n.module == "dsa_jax" for a in n.names]
        assert "pallas" not in froms, path
