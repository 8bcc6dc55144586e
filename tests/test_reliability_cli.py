"""Issue #13 finding 9: every bad `dsa-jax` input is one line on stderr naming the argument and
the reason, exit status 2, found before any work (nothing printed on stdout, nothing written)."""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import dsa_jax
from dsa_jax import checkpoint, cli
from dsa_jax.shapes import CONFIG_DIR, ODD

TINY = os.path.join(CONFIG_DIR, "tiny.json")
HF_FIELDS = {"hidden_size": 80, "num_attention_heads": 3, "q_lora_rank": 40, "kv_lora_rank": 24,
             "qk_nope_head_dim": 12, "v_head_dim": 20, "index_n_heads": 3,
             "index_head_dim": 12, "index_topk": 12, "index_kpool": 4}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Inputs of every kind: configs good and bad, checkpoints, an HF folder, a plain file."""
    root = tmp_path_factory.mktemp("cli")
    tiny = json.load(open(TINY))
    (root / "broken.json").write_text("{not json")
    (root / "tail.json").write_text(json.dumps({**tiny, "always_select_tail": "false"}))
    (root / "plain.txt").write_text("not a folder")
    cfg = dsa_jax.DsaConfig.from_json(TINY)
    w = dsa_jax.init_random_weights(cfg, jax.random.key(0))
    ws = dsa_jax.init_random_weights(cfg, jax.random.key(1), has_indexer=False)
    checkpoint.save_weights(root / "good", cfg, [w, ws])
    checkpoint.save_weights(root / "other", cfg.replace(index_topk=32), [w, ws])
    checkpoint.save_weights(root / "onelayer", cfg, [w])
    checkpoint.save_state(root / "state", cfg, [dsa_jax.init_state(cfg, 1)])
    from safetensors.numpy import save_file

    hf = root / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(HF_FIELDS))
    tensors = dsa_jax.init_random_hf_tensors(ODD, jax.random.key(2))
    save_file({f"model.layers.0.self_attn.{k}": np.asarray(v) for k, v in tensors.items()},
              str(hf / "model.safetensors"))
    bad_hf = root / "badhf"
    bad_hf.mkdir()
    (bad_hf / "config.json").write_text(json.dumps({**HF_FIELDS, "rms_norm_eps": "1e-5"}))
    return root


RUN = ["--quiet", "--num-seqs", "1", "--prompt-len", "8", "--steps", "2"]
RUN_CASES = [
    # (arguments after `run`, regex the one line must match)
    (["--steps", "0"], r"--steps must be a positive integer, got 0"),
    (["--steps", "-5"], r"--steps must be a positive integer, got -5"),
    (["--num-seqs", "0"], r"--num-seqs must be a positive integer, got 0"),
    (["--prompt-len", "-1"], r"--prompt-len must be a positive integer, got -1"),
    (["--vocab", "1"], r"--vocab must be an integer >= 2, got 1"),
    (["--layers", "0"], r"--layers must be a positive integer, got 0"),
    (["--speculate", "-1"], r"--speculate must be an integer >= 0, got -1"),
    (["--show", "-2"], r"--show must be an integer >= 0, got -2"),
    (["--seed", "-3"], r"--seed must be an integer >= 0, got -3"),
    (["--steps", "x"], r"argument --steps: invalid int value: 'x'"),
    (["--nonsense"], r"unrecognized arguments: --nonsense"),
    (["--implementation", "pallas"], r"--implementation pallas: .*compiles the kernels for a "
                                     r"GPU"),
    (["--config", "{missing.json}"], r"--config .*missing.json: cannot read the config \(No "
                                     r"such file"),
    (["--config", "{broken.json}"], r"--config .*broken.json: not valid JSON"),
    (["--config", "{tail.json}"], r"--config .*tail.json: always_select_tail must be a bool"),
    (["--checkpoint", "{missing}"], r"--checkpoint .*missing: no checkpoint there"),
    (["--checkpoint", "{other}"], r"--checkpoint .*other: the weights checkpoint was saved "
                                  r"with a different DsaConfig.*index_topk: checkpoint 32"),
    (["--checkpoint", "{state}"], r"--checkpoint .*state: this is a 'state' checkpoint, not a "
                                  r"'weights' checkpoint"),
    (["--checkpoint", "{onelayer}"], r"--checkpoint .*onelayer: 1 layer\(s\) \(full\), but the "
                                     r"model has 2 \(full,shared\)"),
    (["--out", "{plain.txt}/sub"], r"--out .*plain.txt/sub: cannot create the folder"),
    (["--out", "{plain.txt}"], r"--out .*plain.txt: cannot create the folder"),
    (["--prompt-len", "600"], r"exceeds max_context 512"),
    (["--speculate", "4"], r"at most 3 drafts"),
]


def _fill(args, files, **named):
    """`{name}rest` -> the path of `name` under `files` (or `named[name]`) + rest."""
    out = []
    for a in args:
        if a.startswith("{"):
            name, rest = a[1:].split("}", 1)
            a = named.get(name, str(files / name)) + rest
        out.append(a)
    return out


def _one_line_error(code, captured, prog):
    err = captured.err.strip()
    assert code == 2, (code, captured)
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(f"{prog}: error: "), err
    assert captured.out == "", captured.out  # refused before any work
    return err


@pytest.mark.parametrize("args, message", RUN_CASES, ids=[" ".join(a) for a, _ in RUN_CASES])
def test_run_refuses_each_bad_argument_in_one_line(files, tmp_path, capsys, args, message):
    args = _fill(args, files)
    out = [] if "--out" in args else ["--out", str(tmp_path / "out")]
    code = cli.main(["run", *RUN, *out, *args])
    err = _one_line_error(code, capsys.readouterr(), "dsa-jax run")
    assert re.search(message, err), err
    assert not os.path.exists(tmp_path / "out" / "selection_map.png")


CONVERT_CASES = [
    (["{missing.json}", "{dst}"], r"src .*missing.json: no such file or folder"),
    (["{hf}", "{dst}", "--hf-config", "{missing.json}"], r"--hf-config .*missing.json: cannot "
                                                          r"read the config"),
    (["{badhf}", "{dst}"], r"--hf-config .*badhf: rms_norm_eps must be a finite real number"),
    (["{hf}", "{dst}", "--layers", "0,x"], r"--layers '0,x': 'x' is not a layer id"),
    (["{hf}", "{dst}", "--layers", "-1"], r"--layers '-1': '-1' is not a layer id"),
    (["{hf}", "{dst}", "--max-context", "0"], r"max_context must be a positive integer, got 0"),
    (["{hf}", "{dst}", "--block-size", "7"], r"max_context \(16384\) must be a multiple of "
                                            r"block_size \(7\)"),
    (["{hf}", "{dst}", "--tp-degree", "0"], r"tp_degree must be a positive integer, got 0"),
    (["{hf}", "{dst}", "--tp-degree", "3", "--tp-rank", "3"],
     r"--tp-rank 3 is outside \[0, 3\) \(--tp-degree\)"),
    (["{hf}", "{good}"], r"dst .*good already exists; pass --overwrite to replace it"),
    (["{hf}", "{plain.txt}", "--overwrite"], r"dst .*plain.txt exists and is not a dsa_jax "
                                             r"checkpoint"),
    (["{hf}", "{plain.txt}/sub"], r"dst .*plain.txt/sub: cannot create the folder"),
    (["{hf}", "{dst}", "--layers", "3"], r"layer\(s\) \[3\] not found"),
]


@pytest.mark.parametrize("args, message", CONVERT_CASES,
                         ids=[" ".join(a) for a, _ in CONVERT_CASES])
def test_convert_refuses_each_bad_argument_in_one_line(files, tmp_path, capsys, args, message):
    filled = _fill(args, files, dst=str(tmp_path / "dst"))
    code = cli.main(["convert", *filled, "--max-context", "96", "--block-size", "8"]
                    if not any(a in args for a in ("--max-context", "--block-size"))
                    else ["convert", *filled])
    err = _one_line_error(code, capsys.readouterr(), "dsa-jax convert")
    assert re.search(message, err), err
    assert not os.path.exists(tmp_path / "dst")


def test_the_command_line_itself_exits_2_with_one_line(tmp_path):
    """As a user runs it: a real process, exit status 2, one line, no traceback."""
    for args in (["--steps", "0"], ["--config", str(tmp_path / "none.json")]):
        out = subprocess.run([sys.executable, "-m", "dsa_jax.cli", "run", *args], text=True,
                             capture_output=True, timeout=300)
        assert out.returncode == 2, out
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert out.stdout == ""
