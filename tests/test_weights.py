"""Checkpoint loading: layouts, sharding, skipped tensors, and errors that name the tensor and the file."""

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hybrid_jax
from hybrid_jax.weights import CheckpointError, match_name

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
IDS = jnp.asarray([[5, 17, 300, 2, 9, 44, 101]], jnp.int32)


def small_config(**kw):
    return hybrid_jax.preset("tiny").replace(vocab_size=128, **kw)


@pytest.fixture
def single_file(tmp_path):
    model = hybrid_jax.random_model(small_config(tie_word_embeddings=False), "float32", seed=3)
    hybrid_jax.save_pretrained(model, tmp_path)
    return model, tmp_path


def test_name_table_covers_both_layouts():
    assert match_name("model.language_model.layers.3.self_attn.q_proj.weight")[0] == \
        "layers.3.self_attn.q_proj.kernel"
    assert match_name("model.layers.12.linear_attn.A_log")[0] == "layers.12.linear_attn.A_log"
    assert match_name("lm_head.weight")[0] == "lm_head.kernel"
    assert match_name("model.layers.0.linear_attn.mystery") is None


def test_save_and_load_round_trip_sharded(tmp_path):
    model = hybrid_jax.random_model(small_config(), "float32", seed=4)
    hybrid_jax.save_pretrained(model, tmp_path, max_shard_bytes=100_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    loaded = hybrid_jax.load_pretrained(tmp_path, dtype="float32")
    np.testing.assert_array_equal(model(IDS), loaded(IDS))


def test_saved_layout_is_hf(single_file):
    _, path = single_file
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["model.layers.0.linear_attn.conv1d.weight"].shape == (2 * 32 + 64, 1, 4)
    assert tensors["model.layers.3.self_attn.q_proj.weight"].shape == (2 * 4 * 32, 64)
    assert "lm_head.weight" in tensors


def test_visual_and_mtp_tensors_are_skipped(single_file):
    model, path = single_file
    tensors = load_file(str(path / "model.safetensors"))
    tensors["mtp.fc.weight"] = np.ones((4, 4), np.float32)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = np.ones((4, 4), np.float32)
    save_file(tensors, str(path / "model.safetensors"))
    np.testing.assert_array_equal(model(IDS), hybrid_jax.load_pretrained(path, "float32")(IDS))


def _rewrite(path: Path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_tensor_is_named(single_file):
    _, path = single_file
    _rewrite(path, lambda t: t.pop("model.layers.1.linear_attn.dt_bias"))
    with pytest.raises(CheckpointError, match=r"layers\.1\.linear_attn\.dt_bias"):
        hybrid_jax.load_pretrained(path, "float32")


def test_unexpected_tensor_names_tensor_and_file(single_file):
    _, path = single_file
    _rewrite(path, lambda t: t.update({"model.layers.0.linear_attn.extra_bias": np.ones(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*extra_bias"):
        hybrid_jax.load_pretrained(path, "float32")


def test_misshaped_tensor_names_tensor_file_and_shapes(single_file):
    _, path = single_file
    _rewrite(path, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.ones((64, 64), np.float32)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*up_proj.*\[64, 64\].*\[128, 64\]"):
        hybrid_jax.load_pretrained(path, "float32")


def test_untied_checkpoint_without_lm_head_fails(single_file):
    _, path = single_file
    _rewrite(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="lm_head"):
        hybrid_jax.load_pretrained(path, "float32")


def test_index_naming_a_missing_shard(tmp_path):
    shutil.copytree(GOLDEN / "causal_grouped", tmp_path / "ck")
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "model-09999-of-09999.safetensors"
    (tmp_path / "ck" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-09999-of-09999"):
        hybrid_jax.load_pretrained(tmp_path / "ck", "float32")


def test_config_mismatch_shows_in_shapes(tmp_path):
    shutil.copytree(GOLDEN / "vlm_tied", tmp_path / "ck")
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 100
    (tmp_path / "ck" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="mlp"):
        hybrid_jax.load_pretrained(tmp_path / "ck", "float32")
