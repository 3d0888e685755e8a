"""Server settings: one frozen record, read from ``HYBRID_JAX_*`` environment variables or built by the CLI."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

ENV_PREFIX = "HYBRID_JAX_"
BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


@dataclass(frozen=True)
class Settings:
    model_path: str | None = None  # checkpoint dir or size preset; None: the embedded tiny random model
    served_model_name: str | None = None  # None: model_path as given (as vLLM), or the tiny model's name
    dtype: str = "bfloat16"
    max_batch: int = 32
    max_model_len: int = 4096
    prefill_chunk: int = 256
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    decode_steps: int = 4  # greedy decode steps per device call when no prompt waits
    decode_sizes: tuple[int, ...] | None = None  # decode batch buckets (env: "1,8,32"); None: powers of two
    compilation_cache_dir: str | None = None  # keep compiled programs here across restarts
    background_compile: bool = True  # ready once the largest buckets are built; the rest compile after
    max_waiting: int = 4096
    api_key: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        """Settings from ``HYBRID_JAX_<FIELD>`` variables (upper case); unset ones keep their defaults."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is None or raw == "":
                continue
            values[f.name] = _parse(f.name, raw, f.type)
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The environment variables that ``from_env`` reads back into these settings."""
        env = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                if isinstance(value, dict):
                    value = json.dumps(value)
                elif isinstance(value, tuple):
                    value = ",".join(map(str, value))
                env[ENV_PREFIX + f.name.upper()] = str(value)
        return env


def _parse(name: str, raw: str, kind: str) -> Any:
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            if raw.lower() not in BOOLEANS:
                raise ValueError(f"expected one of {sorted(BOOLEANS)}")
            return BOOLEANS[raw.lower()]
        if kind.startswith("tuple[int"):
            return tuple(int(x) for x in raw.split(","))
        if kind.startswith("dict"):
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
            return value
    except ValueError as e:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}: cannot parse {raw!r}: {e}") from e
    return raw
