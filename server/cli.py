"""The ``hybrid-jax`` command: ``serve`` (the OpenAI-compatible server), with `hybrid_jax.cli`'s ``generate``,
``score`` and ``export-tokenizer``. ``python3 -m server.cli serve ...`` runs it as the installed script does."""

from __future__ import annotations

import argparse
import json
import sys

from hybrid_jax import cli
from server.launcher import serve
from server.settings import Settings, allowed_hosts_for, resolve_api_key


def add_serve(commands: argparse._SubParsersAction) -> None:
    """Adds the ``serve`` subcommand."""
    serve_args = commands.add_parser("serve", help="run the OpenAI-compatible server (gunicorn, gthread worker)")
    cli.add_model_args(serve_args, max_batch=32, max_model_len=4096)
    serve_args.add_argument("--served-model-name", default=None, help="the model name clients must use")
    serve_args.add_argument("--host", default="127.0.0.1")
    serve_args.add_argument("--port", type=int, default=8000)
    serve_args.add_argument("--api-key", default=None,
                            help="require 'Authorization: Bearer KEY' on /v1 (default: $HYBRID_JAX_API_KEY, else "
                                 "$VLLM_API_KEY; none: no auth)")
    serve_args.add_argument("--max-waiting", type=int, default=4096, help="queued requests before 503")
    serve_args.add_argument("--threads", type=int, default=64, help="request threads of the one worker process")
    serve_args.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024, help="larger bodies get 413")
    serve_args.add_argument("--background-compile", action=argparse.BooleanOptionalAction, default=True,
                            help="report ready once the largest decode and prefill programs are built (loaded from "
                                 "the cache or compiled) and build the rest in the background (default on)")
    serve_args.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                            help="reuse the KV pages and GDN state of cached prompt prefixes (exact)")
    serve_args.add_argument("--kv-offloading-size", type=float, default=0.0,
                            help="GiB of host memory that blocks evicted from the prefix cache move to, and come "
                                 "back from on a hit (default 0: none)")
    serve_args.add_argument("--snapshot-stride", type=int, default=Settings.snapshot_stride,
                            help="prefix caching: a GDN state snapshot every this many 64-token blocks of a prompt, "
                                 "besides its last boundaries (1: a hit at any block; larger: fewer snapshots per "
                                 "prompt, coarser hits)")
    serve_args.add_argument("--snapshot-share", type=float, default=Settings.snapshot_share,
                            help="prefix caching: share of the KV cache's device memory given to GDN state "
                                 "snapshots (the rest holds KV pages); the start-up log reports both")
    serve_args.add_argument("--request-read-timeout", type=float, default=15.0,
                            help="seconds a request's head and body may take to arrive, else 408 (slow clients)")
    serve_args.add_argument("--allowed-hosts", nargs="+", default=None,
                            help="Host header values served, '.example.com' for subdomains, '*' for any (default: "
                                 "localhost and 127.0.0.1 on a loopback bind, else any)")
    serve_args.add_argument("--special-tokens-in-messages", choices=("text", "tokens"), default="text",
                            help="special-token text in chat messages: plain text (default) or control tokens (vLLM)")
    serve_args.add_argument("--default-chat-template-kwargs", type=json.loads, default={},
                            help="JSON object of chat template arguments, e.g. '{\"enable_thinking\": false}'")
    serve_args.add_argument("--thinking-token-budget", type=int, default=None,
                            help="the thinking_token_budget of requests that give none: a think block the prompt "
                                 "leaves open is closed with </think> after this many tokens (default: unbounded)")
    serve_args.set_defaults(run=_serve)


def _serve(args: argparse.Namespace) -> None:
    if not isinstance(args.default_chat_template_kwargs, dict):
        raise SystemExit("--default-chat-template-kwargs: must be a JSON object")
    if args.thinking_token_budget is not None and args.thinking_token_budget < 0:
        raise SystemExit("--thinking-token-budget: must be >= 0")
    if args.kv_offloading_size < 0:
        raise SystemExit("--kv-offloading-size: must be >= 0")
    if args.snapshot_stride < 1:
        raise SystemExit("--snapshot-stride: must be >= 1")
    if not 0 < args.snapshot_share < 1:
        raise SystemExit("--snapshot-share: must be between 0 and 1")
    try:
        api_key = resolve_api_key(args.api_key)
    except ValueError as e:
        raise SystemExit(f"hybrid-jax: {e}") from e
    settings = Settings(model_path=args.model_path, served_model_name=args.served_model_name, dtype=args.dtype,
                        max_batch=args.max_batch, max_model_len=args.max_model_len, prefill_chunk=args.prefill_chunk,
                        max_waiting=args.max_waiting, api_key=api_key, max_body_bytes=args.max_body_bytes,
                        tensor_parallel_size=args.tensor_parallel_size, decode_steps=args.decode_steps,
                        decode_sizes=tuple(args.decode_sizes) if args.decode_sizes else None,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        compilation_cache_dir=args.compilation_cache_dir or None,
                        executable_cache_size=args.executable_cache_size,
                        background_compile=args.background_compile,
                        enable_prefix_caching=args.enable_prefix_caching,
                        kv_offloading_size=args.kv_offloading_size, snapshot_stride=args.snapshot_stride,
                        snapshot_share=args.snapshot_share,
                        default_chat_template_kwargs=args.default_chat_template_kwargs,
                        thinking_token_budget=args.thinking_token_budget,
                        request_read_timeout=args.request_read_timeout,
                        allowed_hosts=allowed_hosts_for(args.host, args.allowed_hosts),
                        special_tokens_as_text=args.special_tokens_in_messages == "text")
    serve(settings, args.host, args.port, args.threads)


def main(argv: list[str] | None = None) -> None:
    """Runs ``serve``, ``generate``, ``score`` or ``export-tokenizer`` as ``argv`` (default: sys.argv's) says."""
    cli.main(argv, add_serve)


if __name__ == "__main__":
    main(sys.argv[1:])
