"""Load-test any OpenAI-compatible server in the manner of ``vllm bench serve``; print a table, write JSON.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model NAME \
        [--concurrency 1 4 8 16 32 64] [--qps 2 8] [--prompt-len 1024] [--output-len 128] [--num-prompts 64]

Random dataset: prompts of ``--prompt-len`` random token ids (sent as token ids, so the length is exact),
``--output-len`` tokens each with ignore_eos and greedy sampling, streamed. Per request: TTFT (time to
the first streamed token), ITL (gaps between streamed tokens), TPOT ((latency - TTFT) / (tokens - 1)).
Per sweep point: p50/p99 of each, requests/s and output tokens/s over the wall time of the point.
Fixed concurrency keeps N requests in flight; ``--qps`` sends Poisson arrivals at that rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import aiohttp
import numpy as np


async def one_request(client, url: str, payload: dict) -> dict:
    start = time.perf_counter()
    stamps: list[float] = []
    completion_tokens = None
    async with client.post(url, json=payload) as resp:
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
            choice = (chunk.get("choices") or [{}])[0]
            # A streamed token, or a final chunk that carries the only token (text held back until the end).
            if choice.get("text") or (choice.get("finish_reason") and not stamps):
                stamps.append(time.perf_counter())
    if not stamps:
        return {"error": "no tokens"}
    latency = stamps[-1] - start
    ttft = stamps[0] - start
    n = completion_tokens or len(stamps)  # chunks can hold back text (UTF-8); usage counts tokens
    return {"ttft": ttft, "latency": latency, "itl": list(np.diff(stamps)), "tokens": n,
            "tpot": (latency - ttft) / (n - 1) if n > 1 else None}


def summarize(results: list[dict], wall: float, label: str) -> dict:
    ok = [r for r in results if "error" not in r]
    pct = lambda xs, q: float(np.percentile(xs, q) * 1e3) if xs else None
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    return {"point": label, "requests": len(results), "errors": len(results) - len(ok),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "tpot_p50_ms": pct(tpot, 50),
            "tpot_p99_ms": pct(tpot, 99), "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
            "req_s": len(ok) / wall, "output_tok_s": sum(r["tokens"] for r in ok) / wall}


async def sweep_point(args, prompts, concurrency: int | None, qps: float | None) -> dict:
    url = args.base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    payloads = [{"model": args.model, "prompt": p, "max_tokens": args.output_len, "temperature": 0,
                 "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}} for p in prompts]
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as client:
        start = time.perf_counter()
        if concurrency:
            gate = asyncio.Semaphore(concurrency)

            async def limited(p):
                async with gate:
                    return await one_request(client, url, p)
            results = await asyncio.gather(*(limited(p) for p in payloads))
        else:
            rng = random.Random(0)
            tasks = []
            for p in payloads:
                tasks.append(asyncio.create_task(one_request(client, url, p)))
                await asyncio.sleep(rng.expovariate(qps))
            results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return summarize(results, wall, f"c={concurrency}" if concurrency else f"qps={qps}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--qps", type=float, nargs="*", default=[])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=None, help="per point (default: 4 x concurrency, >= 8)")
    parser.add_argument("--vocab", type=int, default=248_000, help="random ids are drawn below this")
    parser.add_argument("--out", default="bench_serving.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    points = [(c, None) for c in args.concurrency] + [(None, q) for q in args.qps]
    rows = []
    for concurrency, qps in points:
        n = args.num_prompts or max(8, 4 * (concurrency or 8))
        prompts = [rng.integers(0, args.vocab, args.prompt_len).tolist() for _ in range(n)]
        rows.append(asyncio.run(sweep_point(args, prompts, concurrency, qps)))
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows, "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    cols = ("point", "requests", "errors", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
            "itl_p50_ms", "itl_p99_ms", "req_s", "output_tok_s")
    print(" ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>12.2f}" if isinstance(r[c], float) else f"{r[c]!s:>12}" for c in cols))


if __name__ == "__main__":
    main()
