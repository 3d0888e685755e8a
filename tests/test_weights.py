"""Checkpoint loading: layouts, sharding, skipped tensors, and errors that name the tensor and the file."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import hybrid_jax
from hybrid_jax import weights
from hybrid_jax.weights import CheckpointError, mapped_tensors, match_name

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


def test_mapped_tensors_equal_safetensors_own_reading(tmp_path):
    import ml_dtypes

    rng = np.random.default_rng(0)
    tensors = {"a": rng.normal(size=(3, 5)).astype(np.float32), "b": rng.normal(size=7).astype(ml_dtypes.bfloat16),
               "c": rng.normal(size=(2, 1, 4)).astype(np.float16), "d": np.zeros((0, 3), np.float64),
               "e": np.full((), 2.5, np.float32)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    mapped = mapped_tensors(tmp_path / "x.safetensors")
    expected = load_file(str(tmp_path / "x.safetensors"))
    assert sorted(mapped) == sorted(expected)
    for name, array in expected.items():
        assert mapped[name].dtype == array.dtype and mapped[name].shape == array.shape
        np.testing.assert_array_equal(mapped[name], array)
        assert not mapped[name].flags.writeable  # a view of the read-only mapping, not a copy


def _header_file(path: Path, header, data: bytes = b"") -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


@pytest.mark.parametrize(("header", "data", "message"), [
    (None, b"", "header length exceeds the file"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, r"'w'.*data_offsets \[0, 8\]"),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, r"'w'.*shape \[3\] of F32"),
    ({"w": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, r"'w'.*dtype 'I32'"),
    ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, r"'w'.*malformed header entry"),
    ([1, 2], b"", "not a JSON object"),
])
def test_malformed_safetensors_names_file_and_tensor(tmp_path, header, data, message):
    file = tmp_path / "model.safetensors"
    if header is None:
        file.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    else:
        _header_file(file, header, data)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*" + message):
        mapped_tensors(file)


def test_truncated_checkpoint_is_an_error_naming_the_file(single_file):
    _, path = single_file
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*data_offsets"):
        hybrid_jax.load_pretrained(path, "float32")


@pytest.mark.parametrize("device_transform_bytes", [weights.DEVICE_TRANSFORM_BYTES, 0])
def test_loaded_weights_do_not_alias_the_checkpoint_file(single_file, monkeypatch, device_transform_bytes):
    _, path = single_file
    monkeypatch.setattr(weights, "DEVICE_TRANSFORM_BYTES", device_transform_bytes)
    loaded = hybrid_jax.load_pretrained(path, "float32")
    values = [np.array(leaf) for leaf in jax.tree.leaves(nnx.state(loaded))]
    file = path / "model.safetensors"
    header_length = int.from_bytes(file.read_bytes()[:8], "little")
    with open(file, "r+b") as f:  # the checkpoint overwritten in place while its model is in use
        f.seek(8 + header_length)
        f.write(b"\x7f" * (file.stat().st_size - 8 - header_length))
    for before, after in zip(values, jax.tree.leaves(nnx.state(loaded)), strict=True):
        np.testing.assert_array_equal(after, before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reshaping_on_the_device_equals_the_host(single_file, monkeypatch, dtype):
    _, path = single_file  # a float32 checkpoint: the bfloat16 load also casts
    on_host = hybrid_jax.load_pretrained(path, dtype)
    monkeypatch.setattr(weights, "DEVICE_TRANSFORM_BYTES", 0)  # every transposed tensor goes through the device
    calls, program = [], weights._on_device
    monkeypatch.setattr(weights, "_on_device", lambda *key: calls.append(key) or program(*key))
    on_device = hybrid_jax.load_pretrained(path, dtype)
    assert {transform for transform, _ in calls} == {weights.LINEAR, weights.CONV}
    for a, b in zip(jax.tree.leaves(nnx.state(on_host)), jax.tree.leaves(nnx.state(on_device)), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
