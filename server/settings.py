"""Server settings: one frozen record, read from ``HYBRID_JAX_*`` environment variables or built by the CLI."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

from hybrid_jax.compilation_cache import DEFAULT_EXECUTABLES_GIB

ENV_PREFIX = "HYBRID_JAX_"
API_KEY_VARIABLES = ("HYBRID_JAX_API_KEY", "VLLM_API_KEY")  # read in this order when no key is given
LOOPBACK_BINDS = ("127.0.0.1", "localhost")
LOOPBACK_HOSTS = ("localhost", "127.0.0.1")


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
    executable_cache_size: float = DEFAULT_EXECUTABLES_GIB  # GiB the serialized programs there may take (0: any)
    background_compile: bool = True  # ready once the largest buckets are built; the rest compile after
    enable_prefix_caching: bool = True  # reuse the KV pages and GDN state of cached prompt prefixes
    kv_offloading_size: float = 0.0  # GiB of host memory for blocks evicted from the prefix cache
    snapshot_stride: int = 4  # a GDN state snapshot every this many prompt blocks (and at a prompt's last ones)
    snapshot_share: float = 0.1  # share of the KV cache's device memory given to GDN state snapshots
    max_waiting: int = 4096
    api_key: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    request_read_timeout: float = 15.0  # seconds for a request's head and body to arrive, else 408
    allowed_hosts: tuple[str, ...] | None = None  # Host header values served (werkzeug patterns); None: any
    special_tokens_as_text: bool = True  # special-token text in chat messages is encoded as plain text
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    thinking_token_budget: int | None = None  # default of the request field (None: thinking is not bounded)
    exit_on_load_failure: bool = False  # the process exits when the model fails to load (the launcher sets it)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        """Settings from ``HYBRID_JAX_<FIELD>`` variables (upper case); unset ones keep their defaults."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {"api_key": resolve_api_key(None, environ)}
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


def resolve_api_key(given: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The key given, else the first API_KEY_VARIABLES one set; an empty key is refused, not taken as none."""
    environ = os.environ if environ is None else environ
    if given is None:
        given = next((environ[name] for name in API_KEY_VARIABLES if name in environ), None)
    if given is not None and not given.strip():
        raise ValueError("the API key is empty; leave it unset to serve without authentication")
    return given


def allowed_hosts_for(bind_host: str, given: list[str] | None) -> tuple[str, ...] | None:
    """The Host header values to serve: those given ('*': any), else loopback names on a loopback bind."""
    if given:
        return None if "*" in given else tuple(given)
    return LOOPBACK_HOSTS if bind_host in LOOPBACK_BINDS else None


def _parse(name: str, raw: str, kind: str) -> Any:
    try:
        if kind in ("int", "int | None"):
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "bool":
            if raw.lower() not in ("1", "true", "yes", "0", "false", "no"):
                raise ValueError("not a boolean (true/false)")
            return raw.lower() in ("1", "true", "yes")
        if kind.startswith("tuple[int"):
            return tuple(int(x) for x in raw.split(","))
        if kind.startswith("tuple[str"):
            return tuple(x.strip() for x in raw.split(",") if x.strip())
        if kind.startswith("dict"):
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
            return value
    except ValueError as e:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}: cannot parse {raw!r}: {e}") from e
    return raw
