"""Issue #13 finding 9: every bad `dsa-jax` input is one line on stderr naming the argument and
the reason, exit status 2, found before any work (nothing printed on stdout, nothing written)."""

import io
import json
import os
import re
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout

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


def make_files(root) -> str:
    """Inputs of every kind under `root`: configs good and bad, checkpoints, HF folders, a
    plain file."""
    root = str(root)
    tiny = json.load(open(TINY))
    _write(root, "broken.json", "{not json")
    _write(root, "tail.json", json.dumps({**tiny, "always_select_tail": "false"}))
    _write(root, "plain.txt", "not a folder")
    cfg = dsa_jax.DsaConfig.from_json(TINY)
    w = dsa_jax.init_random_weights(cfg, jax.random.key(0))
    ws = dsa_jax.init_random_weights(cfg, jax.random.key(1), has_indexer=False)
    checkpoint.save_weights(os.path.join(root, "good"), cfg, [w, ws])
    checkpoint.save_weights(os.path.join(root, "other"), cfg.replace(index_topk=32), [w, ws])
    checkpoint.save_weights(os.path.join(root, "onelayer"), cfg, [w])
    checkpoint.save_state(os.path.join(root, "state"), cfg, [dsa_jax.init_state(cfg, 1)])
    from safetensors.numpy import save_file

    os.makedirs(os.path.join(root, "hf"))
    _write(root, "hf/config.json", json.dumps(HF_FIELDS))
    tensors = dsa_jax.init_random_hf_tensors(ODD, jax.random.key(2))
    save_file({f"model.layers.0.self_attn.{k}": np.asarray(v) for k, v in tensors.items()},
              os.path.join(root, "hf", "model.safetensors"))
    os.makedirs(os.path.join(root, "badhf"))
    _write(root, "badhf/config.json", json.dumps({**HF_FIELDS, "rms_norm_eps": "1e-5"}))
    os.makedirs(os.path.join(root, "corrupthf"))
    _write(root, "corrupthf/config.json", json.dumps(HF_FIELDS))
    _write(root, "corrupthf/model.safetensors", "garbage, not a safetensors file")
    return root


def _write(root, name, text):
    with open(os.path.join(root, name), "w") as f:
        f.write(text)


RUN = ["--quiet", "--num-seqs", "1", "--prompt-len", "8", "--steps", "2"]
# (catalogue id, what is refused, arguments, regex of the one line); `{name}` is a file made
# by make_files, `{dst}` / `{out}` a fresh path of the test.
CLI_CASES = [
    ("cli.run.count", "--steps, --num-seqs, --prompt-len, --layers below 1",
     ["run", "--steps", "0"], r"--steps must be a positive integer, got 0"),
    ("cli.run.count-negative", "a negative count", ["run", "--steps", "-5"],
     r"--steps must be a positive integer, got -5"),
    ("cli.run.vocab", "--vocab below 2", ["run", "--vocab", "1"],
     r"--vocab must be an integer >= 2, got 1"),
    ("cli.run.nonnegative", "--speculate, --show, --seed below 0", ["run", "--seed", "-3"],
     r"--seed must be an integer >= 0, got -3"),
    ("cli.run.not-int", "a count that is not an integer", ["run", "--steps", "x"],
     r"argument --steps: invalid int value: 'x'"),
    ("cli.run.unknown-flag", "an argument the command does not know", ["run", "--nonsense"],
     r"unrecognized arguments: --nonsense"),
    ("cli.run.pallas-cpu", "--implementation pallas off a GPU",
     ["run", "--implementation", "pallas"], r"--implementation pallas: .*compiles the kernels "
                                            r"for a GPU"),
    ("cli.run.config-missing", "a --config that does not exist",
     ["run", "--config", "{missing.json}"], r"--config .*missing.json: no such file, and not "
                                            r"a shipped config"),
    ("cli.run.config-json", "a --config that is not JSON", ["run", "--config", "{broken.json}"],
     r"--config .*broken.json: not valid JSON"),
    ("cli.run.config-field", "a --config with a bad field", ["run", "--config", "{tail.json}"],
     r"--config .*tail.json: always_select_tail must be a bool"),
    ("cli.run.checkpoint-missing", "a --checkpoint that does not exist",
     ["run", "--checkpoint", "{missing}"], r"--checkpoint .*missing: no checkpoint there"),
    ("cli.run.checkpoint-config", "a --checkpoint saved with another config",
     ["run", "--checkpoint", "{other}"], r"--checkpoint .*other: the weights checkpoint was "
                                         r"saved with a different DsaConfig.*index_topk: "
                                         r"checkpoint 32"),
    ("cli.run.checkpoint-kind", "a --checkpoint of an engine state",
     ["run", "--checkpoint", "{state}"], r"--checkpoint .*state: this is a 'state' checkpoint, "
                                         r"not a 'weights' checkpoint"),
    ("cli.run.checkpoint-layers", "a --checkpoint whose layers differ from the model's",
     ["run", "--checkpoint", "{onelayer}"], r"--checkpoint .*onelayer: 1 layer\(s\) \(full\), "
                                            r"but the model has 2 \(full,shared\)"),
    ("cli.run.out-file", "an --out that cannot be a folder", ["run", "--out", "{plain.txt}"],
     r"--out .*plain.txt: cannot create the folder"),
    ("cli.run.out-under-file", "an --out under a file", ["run", "--out", "{plain.txt}/sub"],
     r"--out .*plain.txt/sub: cannot create the folder"),
    ("cli.run.too-long", "--prompt-len + --steps + --speculate past max_context",
     ["run", "--prompt-len", "600"], r"= 605 tokens exceeds max_context 512"),
    ("cli.run.speculate", "--speculate past max_verify - 1", ["run", "--speculate", "4"],
     r"--speculate 4: .*at most 3 drafts"),
    ("cli.convert.src", "a src that does not exist", ["convert", "{missing.json}", "{dst}"],
     r"src .*missing.json: no such file or folder"),
    ("cli.convert.hf-config-missing", "an --hf-config that does not exist",
     ["convert", "{hf}", "{dst}", "--hf-config", "{missing.json}"],
     r"--hf-config .*missing.json: cannot read the config"),
    ("cli.convert.hf-config-field", "an HF config with a bad field",
     ["convert", "{badhf}", "{dst}"], r"--hf-config .*badhf: rms_norm_eps must be a finite "
                                      r"real number"),
    ("cli.convert.layers", "--layers that are not comma-separated ids >= 0",
     ["convert", "{hf}", "{dst}", "--layers", "0,x"], r"--layers '0,x': 'x' is not a layer id"),
    ("cli.convert.layers-negative", "a negative layer id",
     ["convert", "{hf}", "{dst}", "--layers", "-1"], r"--layers '-1': '-1' is not a layer id"),
    ("cli.convert.serving", "--max-context, --block-size, --tp-degree the config refuses",
     ["convert", "{hf}", "{dst}", "--max-context", "0"],
     r"--max-context 0: max_context must be a positive integer, got 0"),
    ("cli.convert.serving-multiple", "--max-context not a multiple of --block-size",
     ["convert", "{hf}", "{dst}", "--block-size", "7"], r"max_context \(16384\) must be a "
                                                        r"multiple of block_size \(7\)"),
    ("cli.convert.tp-degree", "--tp-degree below 1",
     ["convert", "{hf}", "{dst}", "--tp-degree", "0"],
     r"--tp-degree 0: tp_degree must be a positive integer, got 0"),
    ("cli.convert.tp-rank", "--tp-rank outside [0, --tp-degree)",
     ["convert", "{hf}", "{dst}", "--tp-degree", "3", "--tp-rank", "3"],
     r"--tp-rank 3 is outside \[0, 3\) \(--tp-degree\)"),
    ("cli.convert.shard-corrupt", "an HF checkpoint whose safetensors file is corrupt",
     ["convert", "{corrupthf}", "{dst}"], r"corrupthf/model.safetensors: not a readable "
                                          r"safetensors file"),
    ("cli.convert.dst-exists", "an existing dst without --overwrite",
     ["convert", "{hf}", "{good}"], r"dst .*good already exists; pass --overwrite to replace "
                                    r"it"),
    ("cli.convert.dst-not-ours", "a dst that is not a dsa_jax checkpoint, with --overwrite",
     ["convert", "{hf}", "{plain.txt}", "--overwrite"], r"dst .*plain.txt exists and is not a "
                                                        r"dsa_jax checkpoint"),
    ("cli.convert.dst-under-file", "a dst whose folder cannot be created",
     ["convert", "{hf}", "{plain.txt}/sub"], r"dst .*plain.txt/sub: cannot create the folder"),
    ("cli.convert.layer-missing", "--layers the checkpoint does not have",
     ["convert", "{hf}", "{dst}", "--layers", "3"], r"layer\(s\) \[3\] not found"),
]
CLI_IDS = [case[0] for case in CLI_CASES]


def _fill(args, files, **named):
    """`{name}rest` -> the path of `name` under `files` (or `named[name]`) + rest."""
    out = []
    for a in args:
        if a.startswith("{"):
            name, rest = a[1:].split("}", 1)
            a = named.get(name, os.path.join(files, name)) + rest
        out.append(a)
    return out


def run_case(case, files: str, tmp: str) -> str:
    """Run one case in-process: exit status 2, one line on stderr that starts with the
    command, nothing on stdout (refused before any work), nothing written. Returns the line
    with the temporary folders shown as `<tmp>`."""
    _, _, args, message = case
    args = _fill(args, files, dst=os.path.join(tmp, "dst"))
    if args[0] == "run":
        args = [*args[:1], *RUN, *([] if "--out" in args else ["--out", os.path.join(
            tmp, "out")]), *args[1:]]
    elif not {"--max-context", "--block-size"} & set(args):
        args = [*args, "--max-context", "96", "--block-size", "8"]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(args)
    line = err.getvalue().strip()
    assert code == 2, (code, line)
    assert "\n" not in line and "Traceback" not in line, line
    assert line.startswith(f"dsa-jax {args[0]}: error: "), line
    assert out.getvalue() == "", out.getvalue()
    assert re.search(message, line), line
    assert not os.path.exists(os.path.join(tmp, "dst"))
    assert not os.path.exists(os.path.join(tmp, "out", "selection_map.png"))
    return " ".join(line.replace(files, "<tmp>").replace(tmp, "<tmp>").split())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory.mktemp("cli"))


@pytest.mark.parametrize("case", CLI_CASES, ids=CLI_IDS)
def test_command_refuses_in_one_line(files, tmp_path, case):
    from test_reliability_errors import doc_rows, same

    if case[0] == "cli.run.pallas-cpu" and jax.default_backend() == "gpu":
        pytest.skip("a GPU is here")
    line = run_case(case, files, str(tmp_path))
    doc_type, doc_line = doc_rows()[case[0]]
    assert doc_type == "exit 2" and same(doc_line, line), (doc_line, line)


def test_the_command_line_itself_exits_2_with_one_line(tmp_path):
    """As a user runs it: a real process, exit status 2, one line, no traceback."""
    for args in (["--steps", "0"], ["--config", str(tmp_path / "none.json")]):
        out = subprocess.run([sys.executable, "-m", "dsa_jax.cli", "run", *args], text=True,
                             capture_output=True, timeout=300)
        assert out.returncode == 2, out
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert out.stdout == ""
