import json

import jax
import numpy as np
import pytest

from hybrid_jax.config import PRESETS, ConfigError, Qwen35Config, preset
from hybrid_jax.weights import abstract_model

# Text parameters incl. embedding (and lm_head when untied), shared/reference/qwen35_spec.md section 7.
PARAMS = {"0.8b": 752_393_024, "2b": 1_881_825_088, "4b": 4_205_751_296, "9b": 8_953_803_264,
          "27b": 26_895_998_464}

FLAT = {"model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 24, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                                         "partial_rotary_factor": 0.25}}


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_preset_parameter_counts_match_the_released_sizes(name):
    model = abstract_model(preset(name), "bfloat16")
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model))
    assert count == PARAMS[name]


def test_released_layer_pattern():
    c = PRESETS["9b"]
    assert c.attention_layers == tuple(range(3, 32, 4))
    assert (c.conv_dim, c.linear_value_dim, c.rotary_dim) == (8192, 4096, 64)


def test_flat_and_nested_layouts_agree():
    nested = {"model_type": "qwen3_5", "tie_word_embeddings": True,
              "text_config": {**FLAT, "model_type": "qwen3_5_text", "tie_word_embeddings": False}}
    flat = Qwen35Config.from_hf_dict(FLAT)
    vlm = Qwen35Config.from_hf_dict(nested)
    assert vlm.tie_word_embeddings and not flat.tie_word_embeddings  # top level wins, as in HF
    assert vlm.replace(tie_word_embeddings=False) == flat
    assert flat.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert flat.linear_value_head_dim == 24 and flat.rope_theta == 1e7


def test_layer_types_and_interval_are_honoured():
    c = Qwen35Config.from_hf_dict({**FLAT, "num_hidden_layers": 6, "full_attention_interval": 2})
    assert c.attention_layers == (1, 3, 5)
    explicit = ["full_attention", "linear_attention", "linear_attention", "linear_attention"]
    assert Qwen35Config.from_hf_dict({**FLAT, "layer_types": explicit}).attention_layers == (0,)


def test_round_trip_through_hf_dict():
    c = Qwen35Config.from_hf_dict(FLAT)
    assert Qwen35Config.from_hf_dict(c.to_hf_dict()) == c


@pytest.mark.parametrize("change, key", [
    ({"model_type": "qwen3_next"}, "model_type"),
    ({"num_experts": 64}, "num_experts"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"num_key_value_heads": 3}, "num_attention_heads"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"hidden_size": None}, "hidden_size"),
])
def test_unsupported_configs_name_the_key(change, key, tmp_path):
    raw = {**FLAT, **change}
    if change.get("hidden_size", 0) is None:
        del raw["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=key) as err:
        Qwen35Config.from_pretrained(tmp_path)
    assert "config.json" in str(err.value)


def test_generation_config_sets_eos_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FLAT))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [248046, 248044]}))
    assert Qwen35Config.from_pretrained(tmp_path).eos_token_ids == (248046, 248044)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="preset"):
        preset("70b")
