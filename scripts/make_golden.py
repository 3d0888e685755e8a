"""Write tiny random Qwen3.5 checkpoints plus HF reference logits ("golden" fixtures) for the JAX tests.

Run with the torch/transformers oracle venv (not the project venv):

    /tmp/oracle/bin/python scripts/make_golden.py [--out tests/fixtures/golden]

HF transformers (``Qwen3_5ForCausalLM`` / ``Qwen3_5ForConditionalGeneration``, eager attention, float32, torch
fallback kernels for the Gated DeltaNet) is the numerical oracle. Every parameter is set to random values of a
sensible scale (HF's own init leaves RMSNorm offsets at 0, the gated norm at 1 and dt_bias at 1, which would
hide bugs). One subdirectory per case, each as ``save_pretrained`` writes it, plus ``golden.npz`` and
``golden.json``:

* ``causal_grouped/``: Qwen3_5ForCausalLM, flat Qwen3_5TextConfig, 8 layers (attention at 3 and 7),
  grouped GDN heads (Hv = 2 * Hk), dk != dv, untied lm_head, float32, saved sharded (index json + shards).
  ``golden.npz`` also holds the greedy-decode oracle ``greedy_prompt`` [1, 20], ``greedy_tokens`` [1, 16] and
  ``greedy_logits`` [1, 16, V] (the last-position logits that produced each greedy token).
* ``vlm_tied/``: Qwen3_5ForConditionalGeneration, nested text_config (4 layers), tied embeddings, a minimal
  vision tower so that ``model.visual.*`` tensors exist in the file, single float32 model.safetensors.
* ``bf16_mixed/``: Qwen3_5ForCausalLM, 4 layers, untied, stored in bfloat16 except ``linear_attn.A_log`` and
  ``linear_attn.norm.weight`` (float32, as in the published Qwen3.5 checkpoints). The oracle loads that very
  file into a float32 HF model (upcast).

``golden.npz`` holds, for each prompt k: ``input_ids_k`` int32 [B, T], ``positions_k`` int32 [P] (the
positions whose logits are stored) and ``logits_k`` float32 [B, P, V]; ``num_prompts`` gives K. Logits are
computed on the full, unpadded sequences with no attention mask, from the model re-loaded from the written
files. The script is deterministic (fixed torch and numpy seeds).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import safetensors
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    GenerationConfig,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)

VOCAB = 512
LONG_T = 4097
MAX_FULL_T = 130  # store every position up to this length
GREEDY_PROMPT_LEN = 20
GREEDY_STEPS = 16
GREEDY_MIN_MARGIN = 0.05  # top1 - top2 logit gap required at every greedy step
FP32_IN_BF16_FILE = ("linear_attn.A_log", "linear_attn.norm.weight")
SIZE_BUDGET_BYTES = 6 * 1024 * 1024

# rotary dim = head_dim * 0.25 = 8 -> 4 frequency slots; mrope_section must sum to 4 (it is a no-op for text).
ROPE = {
    "rope_type": "default",
    "rope_theta": 1.0e7,
    "partial_rotary_factor": 0.25,
    "mrope_section": [2, 1, 1],
    "mrope_interleaved": True,
}

CAUSAL_GROUPED_TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 24,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": ROPE,
    "eos_token_id": 500,
}

VLM_TIED_TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_parameters": ROPE,
    "eos_token_id": 500,
}

VLM_TIED_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 16,
}

# Mirrors the published Qwen3.5 generation_config.json layout (bos = pad = eos[1], eos is a list).
VLM_TIED_GENERATION = {"bos_token_id": 500, "eos_token_id": [502, 500], "pad_token_id": 500}

BF16_MIXED_TEXT = {**CAUSAL_GROUPED_TEXT, "num_hidden_layers": 4, "eos_token_id": None}

STANDARD_PROMPTS = ((1, 1), (1, 63), (1, 64), (1, 65), (2, 65), (1, LONG_T))  # (batch, length)
BF16_PROMPTS = ((1, 1), (1, 65), (2, 130))


@dataclass(frozen=True)
class Case:
    name: str
    seed: int
    build: Callable[[], torch.nn.Module]
    prompts: tuple[tuple[int, int], ...]
    storage: str  # "sharded_fp32" | "single_fp32" | "bf16_mixed"
    greedy: bool = False
    notes: dict = field(default_factory=dict)


def build_causal_grouped() -> torch.nn.Module:
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**CAUSAL_GROUPED_TEXT))


def build_vlm_tied() -> torch.nn.Module:
    config = Qwen3_5Config(text_config=VLM_TIED_TEXT, vision_config=VLM_TIED_VISION, tie_word_embeddings=True)
    model = Qwen3_5ForConditionalGeneration(config)
    model.generation_config = GenerationConfig(**VLM_TIED_GENERATION)
    return model


def build_bf16_mixed() -> torch.nn.Module:
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**BF16_MIXED_TEXT))


CASES = (
    Case("causal_grouped", 1001, build_causal_grouped, STANDARD_PROMPTS, "sharded_fp32", greedy=True),
    Case("vlm_tied", 1002, build_vlm_tied, STANDARD_PROMPTS, "single_fp32"),
    Case("bf16_mixed", 1003, build_bf16_mixed, BF16_PROMPTS, "bf16_mixed"),
)


# ----------------------------------------------------------------------------------------------------
# Parameter perturbation


def _normal(shape: torch.Size, std: float, gen: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean


def _uniform(shape: torch.Size, low: float, high: float, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(shape, generator=gen, dtype=torch.float32) * (high - low) + low


def random_value(name: str, shape: torch.Size, gen: torch.Generator, tied: bool) -> torch.Tensor:
    """A random value of sensible scale for the parameter called `name`."""
    if name.startswith("model.visual."):
        return _normal(shape, 0.05, gen)  # never used for text; only needs to exist
    if name.endswith("embed_tokens.weight"):  # smaller when it doubles as the lm_head (logit std ~3)
        return _normal(shape, 0.35 if tied else 1.0, gen)
    if name.endswith("lm_head.weight"):
        return _normal(shape, 2.0 / math.sqrt(shape[1]), gen)
    if name.endswith("linear_attn.A_log"):
        return _uniform(shape, math.log(0.1), math.log(4.0), gen)
    if name.endswith("linear_attn.dt_bias"):
        return _normal(shape, 0.5, gen, mean=-1.0)
    if name.endswith("linear_attn.norm.weight"):  # plain multiplicative gated-norm weight
        return _normal(shape, 0.1, gen, mean=1.0)
    if name.endswith("conv1d.weight"):
        return _normal(shape, 0.3, gen)
    if name.endswith("norm.weight"):  # zero-centred (1 + w) RMSNorm offsets
        return _uniform(shape, -0.3, 0.3, gen)
    if name.endswith(".weight") and len(shape) == 2:  # nn.Linear [out, in]
        scale = float(_uniform(torch.Size([]), 0.5, 1.0, gen))
        return _normal(shape, scale / math.sqrt(shape[1]), gen)
    raise ValueError(f"no perturbation rule for parameter {name} {tuple(shape)}")


@torch.no_grad()
def perturb_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tied = bool(model.config.get_text_config().tie_word_embeddings)
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        param.copy_(random_value(name, param.shape, gen, tied))


# ----------------------------------------------------------------------------------------------------
# Saving and loading


def read_safetensors(case_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(case_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[key] = f.get_tensor(key)
    return tensors


def save_case(case: Case, model: torch.nn.Module, case_dir: Path) -> None:
    if case.storage == "sharded_fp32":
        model.save_pretrained(case_dir, max_shard_size="500KB")
        index = json.loads((case_dir / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) >= 2, shards
    elif case.storage == "single_fp32":
        model.save_pretrained(case_dir)
        assert not (case_dir / "model.safetensors.index.json").exists()
    elif case.storage == "bf16_mixed":
        fp32_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(case_dir)
        path = case_dir / "model.safetensors"
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata()
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
        n_fp32 = 0
        for key in tensors:
            if key.endswith(FP32_IN_BF16_FILE):
                tensors[key] = fp32_state[key].float().contiguous()  # the unrounded fp32 values
                n_fp32 += 1
        assert n_fp32 > 0
        save_file(tensors, str(path), metadata=metadata)
    else:
        raise ValueError(case.storage)


def check_file(case: Case, model: torch.nn.Module, case_dir: Path) -> dict:
    """Check tensor names and dtypes in the written files; return a summary for golden.json."""
    tensors = read_safetensors(case_dir)
    names = sorted(tensors)
    dtypes: dict[str, list[str]] = {}
    for key in names:
        dtypes.setdefault(str(tensors[key].dtype).removeprefix("torch."), []).append(key)
    tied = bool(model.config.get_text_config().tie_word_embeddings)
    assert ("lm_head.weight" in tensors) != tied, "lm_head.weight must be stored iff untied"
    if isinstance(model, Qwen3_5ForConditionalGeneration):
        assert all(k.startswith(("model.language_model.", "model.visual.", "lm_head.")) for k in names)
        assert any(k.startswith("model.visual.") for k in names)
    else:
        assert all(
            k.startswith(("model.embed_tokens.", "model.layers.", "model.norm.", "lm_head.")) for k in names
        )
    if case.storage == "bf16_mixed":
        for key, value in tensors.items():
            want = torch.float32 if key.endswith(FP32_IN_BF16_FILE) else torch.bfloat16
            assert value.dtype == want, (key, value.dtype)
    else:
        assert all(v.dtype == torch.float32 for v in tensors.values())
        state = model.state_dict()
        for key, value in tensors.items():
            assert torch.equal(state[key], value), key
    prefixes = sorted(
        {".".join(k.split(".")[:2]) if k.startswith("model.") else k.split(".")[0] for k in names}
    )
    return {
        "num_tensors": len(names),
        "num_params": int(sum(t.numel() for t in tensors.values())),
        "name_prefixes": prefixes,
        "dtypes": {dt: len(keys) for dt, keys in dtypes.items()},
        "float32_tensors": dtypes.get("float32", []) if case.storage == "bf16_mixed" else "all",
    }


def load_oracle(model_cls: type, case_dir: Path, file_tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Load the written checkpoint into a float32, eager-attention HF model and check the upcast is exact."""
    model = model_cls.from_pretrained(case_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    state = model.state_dict()
    for key, value in file_tensors.items():
        assert state[key].dtype == torch.float32, key
        assert torch.equal(state[key], value.float()), key
    if model.config.get_text_config().tie_word_embeddings:
        embed = model.get_input_embeddings().weight
        assert model.lm_head.weight.data_ptr() == embed.data_ptr()
    return model


# ----------------------------------------------------------------------------------------------------
# Oracle computations


def stored_positions(length: int) -> np.ndarray:
    if length <= MAX_FULL_T:
        return np.arange(length, dtype=np.int32)
    keep = set(range(8)) | set(range(60, 71)) | set(range(4030, 4041))
    keep |= set(range(length - 16, length)) | set(range(0, length, 97))
    return np.array(sorted(p for p in keep if 0 <= p < length), dtype=np.int32)


@torch.no_grad()
def full_logits(model: torch.nn.Module, input_ids: np.ndarray) -> np.ndarray:
    out = model(input_ids=torch.from_numpy(input_ids.astype(np.int64)), use_cache=False)
    return out.logits.float().numpy()


@torch.no_grad()
def gdn_gate_stats(model: torch.nn.Module, input_ids: np.ndarray) -> dict:
    """Quantiles of the per-token GDN decay exp(g) and of beta over all linear-attention layers."""
    decays, betas, handles = [], [], []

    def hook(module, args, kwargs):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        g = -module.A_log.float().exp() * F.softplus(module.in_proj_a(x).float() + module.dt_bias)
        decays.append(g.exp().flatten())
        betas.append(module.in_proj_b(x).sigmoid().float().flatten())

    for module in model.modules():
        if type(module).__name__ == "Qwen3_5GatedDeltaNet":
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        full_logits(model, input_ids)
    finally:
        for handle in handles:
            handle.remove()
    quantiles = [0.0, 0.1, 0.5, 0.9, 1.0]
    qs = torch.tensor(quantiles)
    return {
        "quantiles": quantiles,
        "decay_exp_g": [round(v, 4) for v in torch.quantile(torch.cat(decays), qs).tolist()],
        "beta": [round(v, 4) for v in torch.quantile(torch.cat(betas), qs).tolist()],
    }


@torch.no_grad()
def greedy_oracle(model: torch.nn.Module, rng: np.random.Generator, eos_ids: set[int]) -> dict:
    """Pick a prompt whose 16-step greedy continuation has clear argmax margins and no eos, and record it."""
    for attempt in range(50):
        prompt = rng.integers(0, VOCAB, size=(1, GREEDY_PROMPT_LEN), dtype=np.int64).astype(np.int32)
        seq = prompt.copy()
        step_logits, margins = [], []
        for _ in range(GREEDY_STEPS):
            last = full_logits(model, seq)[:, -1, :]  # [1, V]
            top2 = np.sort(last[0])[-2:]
            margins.append(float(top2[1] - top2[0]))
            step_logits.append(last)
            seq = np.concatenate([seq, last.argmax(-1).astype(np.int32)[:, None]], axis=1)
        tokens = seq[:, GREEDY_PROMPT_LEN:]
        if min(margins) >= GREEDY_MIN_MARGIN and not eos_ids.intersection(tokens[0].tolist()):
            return {
                "greedy_prompt": prompt,
                "greedy_tokens": tokens,
                "greedy_logits": np.stack(step_logits, axis=1).astype(np.float32),  # [1, 16, V]
                "attempt": attempt,
                "min_margin": min(margins),
            }
    raise RuntimeError("no greedy prompt with clear margins found")


def eos_set(model: torch.nn.Module) -> set[int]:
    ids: set[int] = set()
    for value in (model.config.get_text_config().eos_token_id, model.generation_config.eos_token_id):
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return ids


def run_case(case: Case, out_dir: Path) -> dict:
    case_dir = out_dir / case.name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)

    torch.manual_seed(case.seed)
    model = case.build()
    perturb_(model, case.seed)
    model.eval()
    save_case(case, model, case_dir)
    file_summary = check_file(case, model, case_dir)
    oracle = load_oracle(type(model), case_dir, read_safetensors(case_dir))
    del model

    rng = np.random.default_rng(case.seed)
    arrays: dict[str, np.ndarray] = {"num_prompts": np.array(len(case.prompts), dtype=np.int32)}
    prompt_rows = []
    for k, (batch, length) in enumerate(case.prompts):
        input_ids = rng.integers(0, VOCAB, size=(batch, length), dtype=np.int64).astype(np.int32)
        positions = stored_positions(length)
        logits = full_logits(oracle, input_ids)[:, positions, :].astype(np.float32)
        assert np.isfinite(logits).all()
        arrays[f"input_ids_{k}"] = input_ids
        arrays[f"positions_{k}"] = positions
        arrays[f"logits_{k}"] = logits
        prompt_rows.append(
            {
                "index": k,
                "input_ids_shape": [batch, length],
                "num_positions": int(positions.size),
                "logits_shape": list(logits.shape),
                "max_abs_logit": round(float(np.abs(logits).max()), 4),
                "logit_std": round(float(logits.std()), 4),
            }
        )

    summary = {
        "case": case.name,
        "model_class": type(oracle).__name__,
        "storage": case.storage,
        "seed": case.seed,
        "oracle": "HF transformers, float32, attn_implementation='eager', eval, no_grad, use_cache=False, "
        "no attention mask, torch fallback GDN kernels; model re-loaded from the files in this directory",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "safetensors": safetensors.__version__,
            "numpy": np.__version__,
        },
        "text_config": {
            key: value
            for key, value in oracle.config.get_text_config().to_diff_dict().items()
            if key not in ("_name_or_path", "id2label", "label2id", "transformers_version")
        },
        "files": file_summary,
        "eos_token_ids": sorted(eos_set(oracle)),
        "gdn_gate_stats_prompt_k": len(case.prompts) - 2,
        "gdn_gate_stats": gdn_gate_stats(oracle, arrays[f"input_ids_{len(case.prompts) - 2}"]),
        "prompts": prompt_rows,
        "npz_keys": "input_ids_k int32 [B,T], positions_k int32 [P], logits_k float32 [B,P,V] "
        "for k < num_prompts",
    }
    if case.greedy:
        greedy = greedy_oracle(oracle, rng, eos_set(oracle))
        for key in ("greedy_prompt", "greedy_tokens", "greedy_logits"):
            arrays[key] = greedy[key]
        summary["greedy"] = {
            "prompt_shape": list(greedy["greedy_prompt"].shape),
            "tokens": greedy["greedy_tokens"][0].tolist(),
            "min_top1_top2_margin": round(greedy["min_margin"], 4),
            "candidate_prompt_attempt": greedy["attempt"],
            "method": "repeated full forward passes, argmax of the last position's logits",
        }

    np.savez_compressed(case_dir / "golden.npz", **arrays)
    (case_dir / "golden.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/golden"), help="output directory")
    args = parser.parse_args()

    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)

    summaries = [run_case(case, args.out) for case in CASES]

    print(f"\n{'case':<16}{'k':>3}  {'input_ids':<12}{'P':>6}  {'max|logit|':>11}{'std':>8}")
    for summary in summaries:
        for row in summary["prompts"]:
            shape = "x".join(map(str, row["input_ids_shape"]))
            print(
                f"{summary['case']:<16}{row['index']:>3}  {shape:<12}{row['num_positions']:>6}  "
                f"{row['max_abs_logit']:>11.3f}{row['logit_std']:>8.3f}"
            )
    for summary in summaries:
        stats = summary["gdn_gate_stats"]
        files = summary["files"]
        print(f"{summary['case']}: file dtypes {files['dtypes']}, prefixes {files['name_prefixes']}")
        print(f"  GDN decay exp(g) q{stats['quantiles']}: {stats['decay_exp_g']}; beta: {stats['beta']}")
        if "greedy" in summary:
            greedy = summary["greedy"]
            print(f"  greedy tokens {greedy['tokens']} (min margin {greedy['min_top1_top2_margin']})")
    for summary in summaries:
        print(f"{summary['case']}: {dir_size(args.out / summary['case']) / 1024:.1f} KiB")
    total = dir_size(args.out)
    print(f"total {args.out}: {total / 1024:.1f} KiB")
    if total > SIZE_BUDGET_BYTES:
        print(f"WARNING: fixtures exceed the {SIZE_BUDGET_BYTES // 1024} KiB budget")


if __name__ == "__main__":
    main()
