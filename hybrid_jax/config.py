"""Qwen3.5 dense text-model configuration, read from a Hugging Face ``config.json``.

Both published layouts are accepted: ``Qwen3_5ForConditionalGeneration`` (the text model under
``text_config``) and ``Qwen3_5ForCausalLM`` (flat). Presets give the five released sizes (figures from
the released config.json files, see shared reference ``qwen35_configs.json``) and a tiny test size.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
# Keys that signal a mixture-of-experts variant (Qwen3.5-35B-A3B and larger), which this engine does not run.
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


class ConfigError(ValueError):
    """A config.json this engine cannot run; the message names the file and the key."""


@dataclass(frozen=True)
class Qwen35Config:
    """Hyper-parameters of the Qwen3.5 dense hybrid text model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    head_dim: int = 256
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    layer_types: tuple[str, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262_144
    eos_token_ids: tuple[int, ...] = (248046, 248044)
    initializer_range: float = 0.02  # std of the random init of linear, conv and embedding weights (as HF's)

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(self.num_hidden_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.validate()

    # -- derived sizes ------------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:  # Kd = Hk * dk
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:  # Vd = Hv * dv
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:  # C = 2 Kd + Vd: channels of the causal conv (q | k | v)
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    def replace(self, **changes: Any) -> Qwen35Config:
        """A copy with ``changes``; a new layer count without new layer_types gets the default pattern."""
        if "num_hidden_layers" in changes and "layer_types" not in changes:
            changes["layer_types"] = ()
        return dataclasses.replace(self, **changes)

    def validate(self, source: str = "config") -> None:
        def fail(key: str, why: str):
            raise ConfigError(f"{source}: {key}: {why}")

        if len(self.layer_types) != self.num_hidden_layers:
            fail("layer_types", f"has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        for t in self.layer_types:
            if t not in (FULL_ATTENTION, LINEAR_ATTENTION):
                fail("layer_types", f"unknown layer type {t!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_attention_heads", f"{self.num_attention_heads} is not a multiple of "
                 f"num_key_value_heads={self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            fail("linear_num_value_heads", f"{self.linear_num_value_heads} is not a multiple of "
                 f"linear_num_key_heads={self.linear_num_key_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            fail("partial_rotary_factor", f"gives rotary dim {self.rotary_dim} for head_dim {self.head_dim}")

    # -- HF config.json -----------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> Qwen35Config:
        """Build from the dict of a HF config.json (nested ``text_config`` or flat)."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{source}: model_type: {model_type!r} is not a Qwen3.5 dense model "
                              f"(expected one of {SUPPORTED_MODEL_TYPES})")
        text = raw.get("text_config", raw) if model_type == "qwen3_5" else raw
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: text_config: expected an object")
        for key in MOE_KEYS:
            if text.get(key):
                raise ConfigError(f"{source}: {key}: mixture-of-experts configs are not supported")
        if text.get("attn_output_gate", True) is not True:
            raise ConfigError(f"{source}: attn_output_gate: only the gated attention of Qwen3.5 is supported")
        if text.get("attention_bias"):
            raise ConfigError(f"{source}: attention_bias: attention biases are not supported")

        def get(key: str, default: Any = dataclasses.MISSING) -> Any:
            if key in text:
                return text[key]
            if default is dataclasses.MISSING:
                raise ConfigError(f"{source}: {key}: missing")
            return default

        rope = text.get("rope_parameters") or {}
        if "rope_scaling" in text and text["rope_scaling"] and not rope:
            rope = text["rope_scaling"]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{source}: rope_parameters.rope_type: {rope_type!r} is not supported")
        layer_types = text.get("layer_types")
        if layer_types is None:
            layer_types = default_layer_types(get("num_hidden_layers"), text.get("full_attention_interval", 4))
        # The VLM layout keeps tie_word_embeddings at the top level (HF reads it there).
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        try:
            config = cls(
                vocab_size=int(get("vocab_size")),
                hidden_size=int(get("hidden_size")),
                intermediate_size=int(get("intermediate_size")),
                num_hidden_layers=int(get("num_hidden_layers")),
                num_attention_heads=int(get("num_attention_heads")),
                num_key_value_heads=int(get("num_key_value_heads")),
                linear_num_key_heads=int(get("linear_num_key_heads")),
                linear_num_value_heads=int(get("linear_num_value_heads")),
                head_dim=int(get("head_dim", 256)),
                linear_key_head_dim=int(get("linear_key_head_dim", 128)),
                linear_value_head_dim=int(get("linear_value_head_dim", 128)),
                linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
                layer_types=tuple(layer_types),
                rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))),
                partial_rotary_factor=float(
                    rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
                tie_word_embeddings=bool(tie),
                max_position_embeddings=int(get("max_position_embeddings", 262_144)),
                eos_token_ids=_eos_tuple(eos),
                initializer_range=float(get("initializer_range", 0.02)),
            )
        except ConfigError as e:
            raise ConfigError(str(e).replace("config:", f"{source}:", 1)) from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{source}: {e}") from None
        return config

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Qwen35Config:
        """Read ``path/config.json`` (or ``path`` itself when it is a file)."""
        file = Path(path)
        if file.is_dir():
            file = file / "config.json"
        try:
            raw = json.loads(file.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{file}: not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: invalid JSON: {e}") from None
        config = cls.from_hf_dict(raw, source=str(file))
        gen = file.parent / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if eos is not None:
                config = config.replace(eos_token_ids=_eos_tuple(eos))
        return config

    def to_hf_dict(self) -> dict[str, Any]:
        """The flat ``Qwen3_5ForCausalLM`` config.json for this config."""
        return {
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "layer_types": list(self.layer_types),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "partial_rotary_factor": self.partial_rotary_factor,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "eos_token_id": list(self.eos_token_ids),
            "initializer_range": self.initializer_range,
        }


def default_layer_types(num_layers: int, interval: int = 4) -> tuple[str, ...]:
    """Every ``interval``-th layer (1-based) is full attention, the rest Gated DeltaNet."""
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))


def _eos_tuple(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return (248046, 248044)
    return tuple(int(e) for e in (eos if isinstance(eos, list | tuple) else [eos]))


_COMMON = dict(vocab_size=248_320, head_dim=256, linear_num_key_heads=16)
PRESETS: dict[str, Qwen35Config] = {
    "0.8b": Qwen35Config(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                         num_key_value_heads=2, linear_num_value_heads=16, tie_word_embeddings=True, **_COMMON),
    "2b": Qwen35Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
                       num_key_value_heads=2, linear_num_value_heads=16, tie_word_embeddings=True, **_COMMON),
    "4b": Qwen35Config(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
                       num_key_value_heads=4, linear_num_value_heads=32, tie_word_embeddings=True, **_COMMON),
    "9b": Qwen35Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
                       num_key_value_heads=4, linear_num_value_heads=32, tie_word_embeddings=False, **_COMMON),
    "27b": Qwen35Config(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                        num_key_value_heads=4, linear_num_value_heads=48, tie_word_embeddings=False, **_COMMON),
    # The embedded default: real vocabulary (so the real tokenizer works), tiny everything else. A wider init
    # than HF's 0.02: at 64 wide with tied embeddings, the layers would barely move the residual stream off
    # the token's own embedding, and greedy decoding would repeat the last token.
    "tiny": Qwen35Config(vocab_size=248_320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         tie_word_embeddings=True, initializer_range=0.1),
}


def preset(name: str) -> Qwen35Config:
    """A config by size name: ``0.8b``, ``2b``, ``4b``, ``9b``, ``27b`` or ``tiny``."""
    key = name.lower().removeprefix("qwen/").removeprefix("qwen3.5-")
    if key not in PRESETS:
        raise ConfigError(f"preset: {name!r} is not one of {sorted(PRESETS)}")
    return PRESETS[key]
