"""The `dsa-jax` command as a user runs it."""

import json
import os
import re
import subprocess
import sys

import pytest

from dsa_jax import cli
from dsa_jax.shapes import CONFIG_DIR


def test_every_subcommand_has_help(capsys):
    """The module's entry point in a process of its own, then each subcommand's help."""
    out = subprocess.run([sys.executable, "-m", "dsa_jax.cli", "run", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: dsa-jax" in out.stdout
    assert "sequences served together (default: 4)" in out.stdout  # defaults shown
    for sub in ("run", "convert", "parity", "bench"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([sub, "--help"])
        assert exit_.value.code == 0
        text = capsys.readouterr().out
        assert "usage: dsa-jax" in text
        if sub == "convert":
            assert "longest sequence served (default: 16384)" in text


def test_demo_help_shows_the_demos_options():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(["bash", os.path.join(root, "scripts", "demo.sh"), "--help"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "scripts/demo.sh [OPTIONS]" in out.stdout and "--prompt-len" in out.stdout


def test_run_default_job_prints_stats_and_writes_the_selection_map(tmp_path, capsys):
    code = cli.main(["--num-seqs", "2", "--prompt-len", "30", "--steps", "10", "--quiet",
                     "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "tok/s" in out and "drafts accepted" in out and "layers=2 (full,shared)" in out
    assert "weights of the 2 DSA layers: 1.4 MiB (float32; 0.7 MiB a layer)" in out
    assert re.search(r"20 tokens in [\d.]+ s: compiling [\d.]+ s, generating [\d.]+ s", out)
    png = tmp_path / "selection_map.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_run_refuses_bad_input(tmp_path, capsys):
    assert cli.main(["--prompt-len", "600", "--steps", "4", "--quiet"]) == 2
    assert "exceeds max_context 512" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    data = json.load(open(os.path.join(CONFIG_DIR, "tiny.json")))
    bad.write_text(json.dumps({**data, "index_topk_x": 4}))
    assert cli.main(["--config", str(bad), "--quiet"]) == 2
    assert "unknown config keys ['index_topk_x']" in capsys.readouterr().err
    assert cli.main(["--speculate", "4", "--quiet", "--steps", "3"]) == 2
    assert "at most 3 drafts" in capsys.readouterr().err


def test_convert_then_run_with_the_checkpoint(tmp_path, capsys):
    from dsa_jax import hf_oracle

    config = hf_oracle.make_config(hidden_size=64, num_heads=2, index_topk=16, index_kpool=4,
                                   indexer_types=("full", "shared"))
    src = hf_oracle.save_checkpoint(config, hf_oracle.make_attention_layers(config, 3),
                                    str(tmp_path / "hf"))
    dst = tmp_path / "folded"
    args = ["convert", src, str(dst), "--max-context", "128", "--block-size", "16",
            "--param-dtype", "float32"]
    assert cli.main(args) == 0
    assert "converted layers [0, 1]" in capsys.readouterr().out
    assert cli.main(args) == 2  # refuses to overwrite unless asked
    assert "overwrite" in capsys.readouterr().err
    assert cli.main([*args, "--layers", "4", "--overwrite"]) == 2
    assert "layer(s) [4] not found" in capsys.readouterr().err
    # The toy model around the converted layers, with a matching serving config.
    serving = tmp_path / "serving.json"
    hf = json.load(open(os.path.join(str(tmp_path / "hf"), "config.json")))
    serving.write_text(json.dumps({
        "hidden_size": 64, "num_heads": 2, "q_lora_rank": hf["q_lora_rank"],
        "kv_lora_rank": hf["kv_lora_rank"], "qk_nope_head_dim": hf["qk_nope_head_dim"],
        "v_head_dim": hf["v_head_dim"], "index_n_heads": hf["index_n_heads"],
        "index_head_dim": hf["index_head_dim"], "index_topk": 16, "index_kpool": 4,
        "indexer_types": ["full", "shared"], "max_context": 128, "block_size": 16,
        "param_dtype": "float32"}))
    code = cli.main(["--config", str(serving), "--checkpoint", str(dst), "--prompt-len", "20",
                     "--steps", "5", "--num-seqs", "2", "--quiet", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err


@pytest.mark.long
def test_parity_command_passes_without_hf(capsys):
    assert cli.main(["parity", "--no-hf"]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "FAIL" not in out and "compiling and running ..." in out


def test_parity_reports_each_group_as_it_starts_and_each_row_as_it_ends(monkeypatch):
    from dsa_jax import parity

    said = []
    row = parity.Check("layer", "a check", "xla", 1e-7, 1e-5)
    monkeypatch.setattr(parity, "kernel_implementations", lambda: [])
    monkeypatch.setattr(parity, "layer_checks", lambda impl: said.append("ran") or [row])
    checks = parity.run_checks(include_hf=False, report=said.append)
    assert checks == [row]
    assert said == ["[1/1] layer checks, xla: compiling and running ...", "ran",
                    parity.format_row(row)]
