"""benchmarks/h200_loop.py runs through on the CPU at tiny shapes (--smoke): every check true,
every point and the compile figures written."""

import json

from benchmarks import h200_loop


def test_h200_loop_smoke_runs_every_section(tmp_path, capsys):
    out = tmp_path / "h200-loop.json"
    code = h200_loop.main(["--smoke", "--loop-variants", "default", "dsfusion", "--out",
                           str(out)])
    res = json.loads(out.read_text())
    assert not res["errors"], res["errors"]
    assert code == 0
    assert len(res["checks"]) >= 4 and all(v is True for v in res["checks"].values())
    names = {p["name"] for p in res["points"]}
    assert names == {"loop-b1-l2", "loop-b3-l2", "spec-b1-l2-k3", "public-decode-b1",
                     "scan-vs-unrolled-b1-l2", "engine-b3-l2"}
    assert {p["name"] for p in res["variants"]} == {"loop-b1-l2[dsfusion]",
                                                    "loop-b3-l2[dsfusion]"}
    for p in res["points"] + res["variants"]:
        assert "error" not in p, p
        if p["name"].startswith("loop"):
            assert p["us_per_token_per_layer"] > 0
            # The GPU compiler options change nothing on the CPU: the same tokens.
            assert p.get("tokens_equal_default", True) is True
    assert res["compile"]["run_compiles_across_two_contexts"] == 1
    assert "public-decode-b1" in capsys.readouterr().out  # the table, printed last
