"""DsaConfig validation, HF config reading, and the shipped configs."""

import json
import os

import jax
import pytest

from dsa_jax import ConfigError, DsaConfig
from dsa_jax.shapes import CONFIG_DIR, ODD, glm53_flash, tiny

HF_TEXT = {
    "model_type": "glm5_next_text", "hidden_size": 4096, "num_attention_heads": 64,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 256, "qk_rope_head_dim": 0,
    "v_head_dim": 256, "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
    "index_kpool": 4, "index_kpool_always_select_tail": True, "rms_norm_eps": 1e-5,
    "vocab_size": 154880, "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "indexed_attention", "linear_attention",
                    "indexed_attention"],
    "indexer_types": ["full", "full", "shared", "shared"],
}


@pytest.mark.parametrize("change, words", [
    ({"qk_rope_head_dim": 64}, ["qk_rope_head_dim", "must be 0", "64"]),
    ({"index_topk": 2050}, ["index_topk (2050)", "index_kpool (4)"]),
    ({"tp_degree": 3}, ["num_heads (64)", "tp_degree (3)"]),
    ({"max_context": 16032}, ["max_context (16032)", "block_size (64)"]),
    ({"max_context": 16384 + 2, "block_size": 2}, ["max_context (16386)", "index_kpool (4)"]),
    ({"cache_dtype": "int8"}, ["cache_dtype", "'int8'", "float8_e4m3fn"]),
    ({"implementation": "cuda"}, ["implementation", "'cuda'"]),
    ({"gemm": "cublas"}, ["gemm must be one of", "'cublas'"]),
    ({"gemm": "pallas", "param_dtype": "float32"}, ["gemm='pallas'", "'float32'"]),
    ({"num_heads": 0}, ["num_heads", "positive"]),
    ({"indexer_types": ("shared", "full")}, ["indexer_types[0]"]),
])
def test_validation_names_field_and_limit(change, words):
    with pytest.raises(ConfigError) as err:
        glm53_flash(**change)
    for word in words:
        assert word in str(err.value)


def test_from_hf_config_text_and_multimodal(tmp_path):
    cfg = DsaConfig.from_hf_config(HF_TEXT, max_context=8192, block_size=64)
    assert cfg == glm53_flash(max_context=8192, indexer_types=("full", "shared"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "glm5_next", "text_config": HF_TEXT}))
    assert DsaConfig.from_hf_config(path, max_context=8192) == cfg
    assert DsaConfig.from_hf_config(tmp_path, max_context=8192) == cfg


def test_from_hf_config_rejects_rope_and_names_missing_fields():
    with pytest.raises(ConfigError, match="qk_rope_head_dim"):
        DsaConfig.from_hf_config({**HF_TEXT, "qk_rope_head_dim": 64}, max_context=4096)
    broken = {k: v for k, v in HF_TEXT.items() if k != "kv_lora_rank"}
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        DsaConfig.from_hf_config(broken, max_context=4096)


def test_config_is_hashable_and_static_under_jit():
    cfg = tiny()
    assert hash(cfg) == hash(tiny())

    @jax.jit
    def f(x):
        return x * cfg.select_k

    assert int(f(2)) == 2 * cfg.select_k


def test_shipped_configs_and_derived_sizes(tmp_path):
    cfg = glm53_flash()
    assert (cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == \
        (4096, 64, 1536, 512)
    assert (cfg.index_topk, cfg.index_kpool, cfg.select_k, cfg.sel_width) == (2048, 4, 512, 2051)
    assert glm53_flash(tp_degree=8).local_heads == 8
    assert ODD.sel_width == ODD.index_topk + ODD.index_kpool - 1
    assert ODD.replace(always_select_tail=False).sel_width == ODD.index_topk
    bad = tmp_path / "bad.json"
    shipped = json.load(open(os.path.join(CONFIG_DIR, "tiny.json")))
    bad.write_text(json.dumps({**shipped, "hiden_size": 3}))
    with pytest.raises(ConfigError, match="unknown config keys.*hiden_size"):
        DsaConfig.from_json(bad)
