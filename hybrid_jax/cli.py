"""The ``hybrid-jax`` command's batch jobs: ``generate`` and ``score`` over JSONL files, and ``export-tokenizer``;
`server.cli` adds ``serve``.

``python3 -m hybrid_jax.cli`` runs these three; ``python3 -m server.cli`` (the ``hybrid-jax`` script) all four.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hybrid_jax.compilation_cache import DEFAULT_DIR as DEFAULT_CACHE_DIR
from hybrid_jax.compilation_cache import DEFAULT_EXECUTABLES_GIB, size_limit
from hybrid_jax.engine.sampling_params import SamplingParams

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
AddCommand = Callable[[argparse._SubParsersAction], None]  # adds one subcommand, its ``run`` set as a default


def add_model_args(parser: argparse.ArgumentParser, max_batch: int, max_model_len: int) -> None:
    """The flags of every command that builds the model; ``max_batch`` and ``max_model_len``: the command's defaults."""
    parser.add_argument("--model-path", default=None,
                        help="checkpoint directory or size preset (random weights); default: the embedded tiny model")
    parser.add_argument("--dtype", default="bfloat16", help="weight dtype for checkpoints (default bfloat16)")
    parser.add_argument("--max-batch", type=int, default=max_batch, help="concurrent requests (state slots)")
    parser.add_argument("--max-model-len", type=int, default=max_model_len, help="prompt + output tokens")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="shard the model over this many devices")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of free device memory for state slots + KV pages (after the weights)")
    parser.add_argument("--prefill-chunk", type=int, default=256, help="token budget of one prefill step")
    parser.add_argument("--decode-steps", type=int, default=4,
                        help="greedy decode steps per device call when no prompt waits (amortises the per-call host "
                             "cost; 1: every token its own call)")
    parser.add_argument("--decode-sizes", type=int, nargs="+", default=None,
                        help="batch sizes to compile decode programs for, --max-batch always among them (default: "
                             "powers of two up to --max-batch; fewer sizes: a faster start, more padding)")
    parser.add_argument("--compilation-cache-dir", default=DEFAULT_CACHE_DIR,
                        help=f"keep compiled programs here across runs (default {DEFAULT_CACHE_DIR}; '' disables)")
    parser.add_argument("--executable-cache-size", type=executable_cache_size, default=DEFAULT_EXECUTABLES_GIB,
                        help="GiB of disk the serialized programs under --compilation-cache-dir may take, the least "
                             f"recently used removed first (default {DEFAULT_EXECUTABLES_GIB:g}; 0: no limit)")


def executable_cache_size(text: str) -> float:
    """The argparse type of --executable-cache-size: GiB, as `size_limit` takes them."""
    try:
        value = float(text)
        size_limit(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a size in GiB >= 0, got {text!r}") from None
    return value


def parser(*more: AddCommand) -> argparse.ArgumentParser:
    """The command line: the subcommands ``more`` adds, then ``generate``, ``score`` and ``export-tokenizer``."""
    top = argparse.ArgumentParser(prog="hybrid-jax", description="Qwen3.5 hybrid models on JAX and Pallas.")
    commands = top.add_subparsers(dest="command", required=True)
    for add in more:
        add(commands)

    generate = commands.add_parser("generate", help="complete every prompt of a JSONL file")
    add_model_args(generate, max_batch=64, max_model_len=4096)
    generate.add_argument("--input", required=True, help='JSONL: {"prompt": str} or {"prompt_token_ids": [...]}, '
                                                         "optionally with sampling fields")
    generate.add_argument("--output", required=True, help='JSONL: {"prompt", "text", "token_ids", "finish_reason"}')
    generate.add_argument("--max-tokens", type=int)
    for flag in ("temperature", "top-p", "min-p", "presence-penalty", "frequency-penalty", "repetition-penalty"):
        generate.add_argument(f"--{flag}", type=float)
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", help="stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true", default=None)
    generate.set_defaults(run=_generate)

    score = commands.add_parser("score", help="per-token log-probabilities of every text of a JSONL file")
    add_model_args(score, max_batch=1, max_model_len=4096)
    score.add_argument("--input", required=True, help='JSONL: {"text": str} or {"prompt_token_ids": [...]}')
    score.add_argument("--output", required=True, help='JSONL: {"token_ids", "logprobs", "total_logprob"}')
    score.add_argument("--batch-size", type=int, default=8)
    score.set_defaults(run=_score)

    export = commands.add_parser("export-tokenizer", help="write the tokenizer as tokenizer.json + "
                                 "tokenizer_config.json (with the chat template) for HF AutoTokenizer, e.g. "
                                 "lm-eval's local-completions")
    export.add_argument("directory", help="where to write the two files (created if missing)")
    export.add_argument("--model-path", default=None,
                        help="checkpoint directory whose tokenizer and chat template to write (default: the bundled "
                             "Qwen3.5 tokenizer and the built-in template)")
    export.set_defaults(run=_export_tokenizer)
    return top


def _read_jsonl(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{number}: not JSON: {e}") from e
            if not isinstance(row, dict):
                raise SystemExit(f"{path}:{number}: each line must be a JSON object")
            yield number, row


def _token_ids(row: dict[str, Any], text_key: str, tokenizer, where: str) -> tuple[str | None, list[int]]:
    if isinstance(row.get(text_key), str):
        return row[text_key], tokenizer.encode(row[text_key])
    ids = row.get("prompt_token_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return None, ids
    raise SystemExit(f"{where}: needs {text_key!r} (a string) or 'prompt_token_ids' (a non-empty list of ints)")


def _write_jsonl(path: str, rows: Iterator[dict[str, Any]]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _llm(args: argparse.Namespace, warmup: bool):
    from hybrid_jax.engine.llm import LLM

    try:
        return LLM(args.model_path, args.dtype, max_batch=args.max_batch, max_model_len=args.max_model_len,
                   prefill_chunk=args.prefill_chunk, warmup=warmup, tensor_parallel_size=args.tensor_parallel_size,
                   decode_steps=args.decode_steps,
                   decode_sizes=tuple(args.decode_sizes) if args.decode_sizes else None,
                   memory_utilization=args.gpu_memory_utilization,
                   compilation_cache_dir=args.compilation_cache_dir or None,
                   executable_cache_size=args.executable_cache_size)
    except ValueError as e:  # bad flags or a malformed checkpoint: the message names the field or file
        raise SystemExit(f"hybrid-jax: {e}") from e


def _generate(args: argparse.Namespace) -> None:
    flags = {name: getattr(args, name) for name in SAMPLING_FIELDS if getattr(args, name, None) is not None}
    llm = _llm(args, warmup=True)
    try:
        texts, ids, params = [], [], []
        for number, row in _read_jsonl(args.input):
            where = f"{args.input}:{number}"
            text, token_ids = _token_ids(row, "prompt", llm.tokenizer, where)
            try:
                params.append(SamplingParams(**{**flags, **{k: v for k, v in row.items() if k in SAMPLING_FIELDS}}))
            except (TypeError, ValueError) as e:
                raise SystemExit(f"{where}: {e}") from e
            texts.append(text)
            ids.append(token_ids)
        try:
            results = llm.generate(prompt_token_ids=ids, sampling_params=params) if ids else []
        except ValueError as e:
            raise SystemExit(f"{args.input}: {e}") from e
        _write_jsonl(args.output, ({"prompt": text, "text": r.outputs[0].text, "token_ids": r.outputs[0].token_ids,
                                    "finish_reason": r.outputs[0].finish_reason}
                                   for text, r in zip(texts, results, strict=True)))
    finally:
        llm.close()


def _score(args: argparse.Namespace) -> None:
    llm = _llm(args, warmup=False)
    try:
        ids = [_token_ids(row, "text", llm.tokenizer, f"{args.input}:{n}")[1] for n, row in _read_jsonl(args.input)]
        try:
            results = llm.score(prompt_token_ids=ids, batch_size=args.batch_size) if ids else []
        except ValueError as e:
            raise SystemExit(f"{args.input}: {e}") from e
        _write_jsonl(args.output, ({"token_ids": r.token_ids, "logprobs": r.logprobs, "total_logprob": r.total}
                                   for r in results))
    finally:
        llm.close()


def _export_tokenizer(args: argparse.Namespace) -> None:
    from hybrid_jax.chat import ChatTemplate
    from hybrid_jax.tokenizer import load_tokenizer

    checkpoint = args.model_path if args.model_path and Path(args.model_path).is_dir() else None
    if args.model_path and checkpoint is None:
        raise SystemExit(f"hybrid-jax: --model-path: {args.model_path} is not a checkpoint directory")
    try:
        tokenizer = load_tokenizer(checkpoint)
        template = ChatTemplate.from_checkpoint(checkpoint) if checkpoint else ChatTemplate.builtin()
    except ValueError as e:  # a malformed tokenizer or template: the message names the file
        raise SystemExit(f"hybrid-jax: {e}") from e
    for path in tokenizer.save_pretrained(args.directory, template.source):
        print(path)


def main(argv: list[str] | None = None, *more: AddCommand) -> None:
    """Runs the command ``argv`` names (default: sys.argv's): ``generate``, ``score``, ``export-tokenizer`` or one
    that ``more`` adds."""
    args = parser(*more).parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
