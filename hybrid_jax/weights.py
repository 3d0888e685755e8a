"""Hugging Face safetensors <-> model parameters, through one declarative name table.

Checkpoint names (text part) are matched after dropping the layout prefix (``model.language_model.`` for
Qwen3_5ForConditionalGeneration, ``model.`` for Qwen3_5ForCausalLM). ``model.visual.*`` and ``mtp.*``
are skipped. Each file is mapped into memory, not read: a tensor's bytes are read by its transfer to the device
(several transfers at once), so the host never holds a copy of the weights.
"""

from __future__ import annotations

import functools
import json
import math
import mmap
import os
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file
from tqdm import tqdm

from hybrid_jax.config import Qwen35Config
from hybrid_jax.model import Qwen35ForCausalLM

SKIPPED = re.compile(r"^(model\.visual\.|mtp\.|model\.mtp\.)")
PREFIXES = ("model.language_model.", "model.")
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"F64": jnp.float64, "F32": jnp.float32, "F16": jnp.float16, "BF16": jnp.bfloat16}
# Tensors placed at once while a checkpoint loads (BENCHMARKS, "Checkpoint loading").
LOAD_THREADS = 8
# Tensors of at least this many bytes are transposed by the device after their transfer, faster than the host's
# strided copy; smaller ones by the host, where that costs less than a device program for their shape
# (BENCHMARKS, "Checkpoint loading").
DEVICE_TRANSFORM_BYTES = 32 << 20


class CheckpointError(ValueError):
    """A checkpoint that does not fit the config; the message names the tensor and its file."""


@dataclass(frozen=True)
class Transform:
    """How a checkpoint tensor maps onto a parameter, and back."""

    to_param: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    keep_fp32: bool = False


SAME = Transform(lambda x: x, lambda x: x)
FP32 = Transform(lambda x: x, lambda x: x, keep_fp32=True)
LINEAR = Transform(lambda w: w.T, lambda k: k.T)  # [out, in] <-> [in, out]
CONV = Transform(lambda w: w[:, 0, :].T, lambda k: k.T[:, None, :])  # [C, 1, K] <-> [K, C]

# (checkpoint name without prefix, parameter path, transform); "{i}" is the layer index.
NAME_TABLE: tuple[tuple[str, str, Transform], ...] = (
    ("embed_tokens.weight", "embed_tokens.weight", SAME),
    ("norm.weight", "norm.weight", SAME),
    ("lm_head.weight", "lm_head.kernel", LINEAR),
    ("layers.{i}.input_layernorm.weight", "layers.{i}.input_layernorm.weight", SAME),
    ("layers.{i}.post_attention_layernorm.weight", "layers.{i}.post_attention_layernorm.weight", SAME),
    ("layers.{i}.mlp.gate_proj.weight", "layers.{i}.mlp.gate_proj.kernel", LINEAR),
    ("layers.{i}.mlp.up_proj.weight", "layers.{i}.mlp.up_proj.kernel", LINEAR),
    ("layers.{i}.mlp.down_proj.weight", "layers.{i}.mlp.down_proj.kernel", LINEAR),
    ("layers.{i}.self_attn.q_proj.weight", "layers.{i}.self_attn.q_proj.kernel", LINEAR),
    ("layers.{i}.self_attn.k_proj.weight", "layers.{i}.self_attn.k_proj.kernel", LINEAR),
    ("layers.{i}.self_attn.v_proj.weight", "layers.{i}.self_attn.v_proj.kernel", LINEAR),
    ("layers.{i}.self_attn.o_proj.weight", "layers.{i}.self_attn.o_proj.kernel", LINEAR),
    ("layers.{i}.self_attn.q_norm.weight", "layers.{i}.self_attn.q_norm.weight", SAME),
    ("layers.{i}.self_attn.k_norm.weight", "layers.{i}.self_attn.k_norm.weight", SAME),
    ("layers.{i}.linear_attn.in_proj_qkv.weight", "layers.{i}.linear_attn.in_proj_qkv.kernel", LINEAR),
    ("layers.{i}.linear_attn.in_proj_z.weight", "layers.{i}.linear_attn.in_proj_z.kernel", LINEAR),
    ("layers.{i}.linear_attn.in_proj_b.weight", "layers.{i}.linear_attn.in_proj_b.kernel", LINEAR),
    ("layers.{i}.linear_attn.in_proj_a.weight", "layers.{i}.linear_attn.in_proj_a.kernel", LINEAR),
    ("layers.{i}.linear_attn.conv1d.weight", "layers.{i}.linear_attn.conv1d.weight", CONV),
    ("layers.{i}.linear_attn.A_log", "layers.{i}.linear_attn.A_log", FP32),
    ("layers.{i}.linear_attn.dt_bias", "layers.{i}.linear_attn.dt_bias", SAME),
    ("layers.{i}.linear_attn.norm.weight", "layers.{i}.linear_attn.norm.weight", FP32),
    ("layers.{i}.linear_attn.out_proj.weight", "layers.{i}.linear_attn.out_proj.kernel", LINEAR),
)


def _compile_table():
    rules = []
    for hf, param, transform in NAME_TABLE:
        pattern = re.compile("^" + re.escape(hf).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")
        rules.append((pattern, param, transform))
    return rules


_RULES = _compile_table()


def match_name(hf_name: str) -> tuple[str, Transform] | None:
    """Checkpoint tensor name -> (parameter path "a.b.0.c", transform), or None if it is not a text tensor."""
    for prefix in PREFIXES:
        if hf_name.startswith(prefix):
            hf_name = hf_name[len(prefix):]
            break
    for pattern, param, transform in _RULES:
        m = pattern.match(hf_name)
        if m:
            return param.replace("{i}", m.group("i")) if "i" in m.groupdict() else param, transform
    return None


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (sharded through the index, or single)."""
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: weight_map: unreadable index ({e})") from None
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index}: names shard {f.name}, which does not exist")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_FILE}")
    return files


def abstract_model(config: Qwen35Config, dtype) -> Qwen35ForCausalLM:
    """The model with shape-only parameters (nothing allocated)."""
    return nnx.eval_shape(lambda: Qwen35ForCausalLM(config, dtype, rngs=nnx.Rngs(0)))


def _flat_params(model: nnx.Module) -> dict[str, nnx.Variable]:
    return {".".join(str(p) for p in path): var
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def load_weights(model: Qwen35ForCausalLM, path: str | Path) -> None:
    """Fill an (abstract or real) model's parameters from the checkpoint in ``path``, in place."""
    path = Path(path)
    params = _flat_params(model)
    seen: dict[str, str] = {}
    tied = model.config.tie_word_embeddings
    placements: list[tuple[nnx.Variable, np.ndarray, Transform]] = []
    for file in checkpoint_files(path):
        for name, tensor in mapped_tensors(file).items():
            if SKIPPED.match(name):
                continue
            matched = match_name(name)
            if matched is None:
                raise CheckpointError(f"{file}: unexpected tensor {name!r}")
            param_path, transform = matched
            if param_path.startswith("lm_head.") and tied:
                continue  # tied checkpoints may still carry lm_head; HF ties it to the embedding
            var = params.get(param_path)
            if var is None:
                raise CheckpointError(f"{file}: tensor {name!r} has no place in this config "
                                      f"(no parameter {param_path})")
            if param_path in seen:
                raise CheckpointError(f"{file}: tensor {name!r} also appears in {seen[param_path]}")
            expected = _hf_shape(transform, var.shape)
            if tensor.shape != expected:
                raise CheckpointError(f"{file}: tensor {name!r} has shape {list(tensor.shape)}, "
                                      f"expected {list(expected)} for this config")
            placements.append((var, tensor, transform))
            seen[param_path] = str(file)
    missing = sorted(set(params) - set(seen))
    if missing:
        raise CheckpointError(f"{path}: missing tensors for parameters {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    total = sum(tensor.nbytes for _, tensor, _ in placements)
    with (ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="hybrid-jax-checkpoint") as pool,
          tqdm(total=total, desc="weights", unit="B", unit_scale=True, disable=None,
               leave=False) as bar):
        values = pool.map(_to_device, placements)
        for (var, tensor, _), value in zip(placements, values, strict=True):
            var.set_value(value)
            bar.update(tensor.nbytes)


def _to_device(placement: tuple[nnx.Variable, np.ndarray, Transform]) -> jax.Array:
    """One checkpoint tensor (a view of its mapped file) as its parameter, on the device."""
    var, tensor, transform = placement
    target = jnp.float32 if transform.keep_fp32 else var.dtype
    if transform in (LINEAR, CONV) and tensor.nbytes >= DEVICE_TRANSFORM_BYTES:
        return _on_device(transform, jnp.dtype(target))(jax.device_put(tensor))
    host = np.asarray(transform.to_param(tensor)).astype(target, copy=False)
    if jax.default_backend() == "cpu" and not host.flags.writeable:
        host = host.copy(order="K")  # the CPU backend would alias the file's mapping instead of copying it
    return jax.device_put(host)


@functools.cache
def _on_device(transform: Transform, target: jnp.dtype) -> Callable[[jax.Array], jax.Array]:
    """``transform.to_param`` and the cast to ``target``, as one device program (compiled once per shape)."""
    return jax.jit(lambda x: transform.to_param(x).astype(target))


def mapped_tensors(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, as a read-only view of the file mapped into memory: its bytes are read
    when the view is (safetensors' ``get_tensor`` copies each tensor first; BENCHMARKS, "Checkpoint loading"). The
    format, from safetensors' specification: a little-endian u64 N, an N-byte JSON header
    ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` (and an optional ``__metadata__``), then the
    data, which the offsets index."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little") if size >= 8 else size
        if n > size - 8:
            raise CheckpointError(f"{file}: not a safetensors file (its header length exceeds the file)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{file}: unreadable safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{file}: the safetensors header is not a JSON object")
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            count = math.prod(shape)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor {name!r}: malformed header entry {entry!r}") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r}: dtype {dtype!r} is not one of "
                                  f"{sorted(SAFETENSORS_DTYPES)}")
        itemsize = np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize
        if not (all(isinstance(d, int) and d >= 0 for d in shape) and isinstance(begin, int) and isinstance(end, int)
                and begin >= 0 and end - begin == count * itemsize and 8 + n + end <= size):
            raise CheckpointError(f"{file}: tensor {name!r}: data_offsets {[begin, end]} do not hold shape "
                                  f"{list(shape)} of {dtype} inside the file")
        tensors[name] = np.frombuffer(data, SAFETENSORS_DTYPES[dtype], count, 8 + n + begin).reshape(shape)
    return tensors


def _hf_shape(transform: Transform, param_shape: tuple[int, ...]) -> tuple[int, ...]:
    return transform.to_hf(np.empty(param_shape, dtype=np.bool_)).shape


def hf_tensors(model: Qwen35ForCausalLM) -> Iterator[tuple[str, np.ndarray]]:
    """(HF CausalLM name, array) for every parameter, in the checkpoint layout."""
    for param_path, var in _flat_params(model).items():
        matched = _param_to_hf(param_path)
        if matched is None:
            raise CheckpointError(f"parameter {param_path} has no checkpoint name")
        name, transform = matched
        yield name, np.ascontiguousarray(transform.to_hf(np.asarray(var[...])))


def _param_to_hf(param_path: str) -> tuple[str, Transform] | None:
    m = re.match(r"^layers\.(\d+)\.", param_path)
    for hf, param, transform in NAME_TABLE:
        candidate = param.replace("{i}", m.group(1)) if m else param
        if candidate == param_path:
            name = hf.replace("{i}", m.group(1)) if m else hf
            return (name if name.startswith("lm_head") else "model." + name), transform
    return None


def save_pretrained(model: Qwen35ForCausalLM, path: str | Path, max_shard_bytes: int = 5 << 30) -> None:
    """Write ``config.json`` and safetensors (sharded with an index above ``max_shard_bytes``), HF layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in hf_tensors(model):
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(a.nbytes for s in shards for a in s.values())
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                              indent=2))
