"""TPOT under a JSON schema vs unconstrained, against any OpenAI-compatible server; print a table, write JSON.

    python scripts/bench_structured.py --base-url http://127.0.0.1:8000 --model NAME \
        [--concurrency 1 16 64] [--prompt-len 256] [--output-len 128] [--num-prompts N] [--tokenizer DIR]

Each point runs the same random-token prompts twice, streamed with greedy sampling and ignore_eos: once plain,
once with ``structured_outputs.json`` set to a schema whose document cannot close within ``--output-len``
tokens (an array of at least 512 small objects), so both runs produce the same number of tokens. Requests,
TTFT, TPOT and ITL are measured as in scripts/bench_serving.py. Then, on this machine, the host's cost per step
of the grammar: llguidance's mask computation (`grammar.fill_masks`, one row) and the token's consumption,
timed over a document of the schema tokenized with ``--tokenizer`` (default: the bundled Qwen3.5 vocabulary).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
import numpy as np
from bench_serving import one_request, summarize

SCHEMA = {"type": "array", "minItems": 512, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0},
                   "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["red", "green", "blue"]}}}}}


async def run(args, prompts: list[list[int]], concurrency: int, constrained: bool) -> dict:
    url = args.base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    extra = {"structured_outputs": {"json": SCHEMA}} if constrained else {}
    payloads = [{"model": args.model, "prompt": p, "max_tokens": args.output_len, "temperature": 0,
                 "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra}
                for p in prompts]
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None)) as client:
        gate = asyncio.Semaphore(concurrency)

        async def limited(p):
            async with gate:
                return await one_request(client, url, p)
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in payloads))
        wall = time.perf_counter() - start
    row = summarize(results, wall, f"c={concurrency}")
    row["constrained"] = constrained
    return row


def mask_cost(tokenizer_dir: str | None, vocab: int, steps: int) -> dict:
    """Host microseconds per step of one grammar row: computing its mask, and consuming the sampled token."""
    from hybrid_jax.engine.grammar import GrammarCompiler, GrammarState, fill_masks, mask_words
    from hybrid_jax.engine.sampling_params import StructuredOutputsParams
    from hybrid_jax.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else load_tokenizer()
    compiler = GrammarCompiler(tokenizer, vocab, tokenizer.eos_token_ids)
    start = time.perf_counter()
    state = GrammarState(compiler.compile(StructuredOutputsParams(json=SCHEMA)))
    compile_ms = (time.perf_counter() - start) * 1e3  # includes llguidance's tokenizer (once per server)
    item = {"name": "Ada Lovelace", "age": 36, "tags": ["red", "blue"]}
    tokens = tokenizer.encode(json.dumps([item] * 600, separators=(",", ":")))[:steps]
    masks = np.zeros((1, mask_words(vocab)), np.int32)
    fill, consume = [], []
    for token in tokens:
        t0 = time.perf_counter()
        fill_masks([state], masks)
        t1 = time.perf_counter()
        assert state.accept(token), state.error
        fill.append(t1 - t0)
        consume.append(time.perf_counter() - t1)
    pct = lambda xs, q: float(np.percentile(xs, q) * 1e6)
    return {"steps": len(tokens), "first_compile_ms": compile_ms, "mask_p50_us": pct(fill, 50),
            "mask_p99_us": pct(fill, 99), "mask_mean_us": float(np.mean(fill) * 1e6),
            "consume_p50_us": pct(consume, 50), "consume_p99_us": pct(consume, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=None, help="per point (default: 2 x concurrency, >= 8)")
    parser.add_argument("--vocab", type=int, default=248_000, help="random prompt ids are drawn below this")
    parser.add_argument("--tokenizer", default=None, help="checkpoint directory for the mask-cost figure")
    parser.add_argument("--model-vocab", type=int, default=248_320, help="the model's (padded) vocabulary")
    parser.add_argument("--mask-steps", type=int, default=2000)
    parser.add_argument("--out", default="bench_structured.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for concurrency in args.concurrency:
        n = args.num_prompts or max(8, 2 * concurrency)
        prompts = [rng.integers(0, args.vocab, args.prompt_len).tolist() for _ in range(n)]
        for constrained in (False, True):
            rows.append(asyncio.run(run(args, prompts, concurrency, constrained)))
            print(json.dumps(rows[-1]), flush=True)
    cost = mask_cost(args.tokenizer, args.model_vocab, args.mask_steps)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "schema": SCHEMA, "rows": rows, "host_mask_cost": cost,
                   "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    cols = ("point", "constrained", "requests", "errors", "ttft_p50_ms", "tpot_p50_ms", "tpot_p99_ms",
            "itl_p99_ms", "output_tok_s")
    print(" ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>12.2f}" if isinstance(r[c], float) else f"{r[c]!s:>12}" for c in cols))
    print("host cost per grammar row and step:", json.dumps(cost))


if __name__ == "__main__":
    main()
