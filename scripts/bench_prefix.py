"""Prefix caching against any OpenAI-compatible server (ours or vLLM); print a markdown table per scenario, write JSON.

    python scripts/bench_prefix.py --base-url http://127.0.0.1:8000 [--model NAME] \
        [--scenarios cold-warm repeat chat shared-system host] [--lengths 256 1024 ...] [--reset-prefix-cache] \
        [--out bench_prefix.json]

Scenarios (all streamed, greedy; TTFT is the time to the first chunk that carries output: text, reasoning, a
tool call or a finish reason; cached tokens are the server's ``usage.prompt_tokens_details.cached_tokens``,
null where it omits them, as vLLM does without ``--enable-prompt-tokens-details``):

- ``cold-warm``: per prefix length, a prompt of fresh random token ids (exact lengths; new ids per length and per
  run, so nothing is shared by accident) sent three times with max_tokens 1: cold, warm (the identical prompt)
  and the prefix plus 64 new random ids (a hit followed by new work). ``--reset-prefix-cache`` POSTs
  /reset_prefix_cache before each length (a 404, vLLM outside its dev mode, is ignored); ``--warmup`` first
  sends an unrelated prompt of the same shape, so that the cold figure holds no one-off start-up cost. A
  prompt's last token is always computed, and a hybrid model resumes only from a cached state snapshot, so
  the identical prompt can hit fewer tokens than the prefix + suffix one (ours: up to the last 64-token block
  boundary before the prompt's last token).
- ``repeat``: per prefix length, a prompt of fresh random ids sent once, then ``--repeats`` times again, one at a
  time (max_tokens 1): the warm TTFT's p50 and spread as the client sees it, against the server's own mean
  TTFT over the repeats (from arrival to the first token: the ``vllm:time_to_first_token_seconds`` histogram's
  sum and count on /metrics, null where the server has none). The difference is the request's way in and out:
  the client's and the server's JSON, HTTP, and the server's checks before arrival.
- ``chat``: a multi-turn conversation on /v1/chat/completions: a system prompt of random words, each turn a
  user message of random words and 128 tokens answered with ignore_eos; the answer's content joins the messages.
  ``--chat-think-s`` waits that long before each next turn (a person reading the answer). Per turn: TTFT,
  prompt and cached tokens; in all: the summed TTFT. ``--chat-ids`` holds the conversation as token ids on
  /v1/completions instead (random ids for the system prompt and user turns, each answer's own ids appended, read
  back with ``return_tokens_as_token_ids``): what a model whose answers re-tokenize to themselves sends, which
  random weights' answers do not. ``--chat-system-seen`` first sends, untimed, another conversation's first turn
  on the same system prompt (a deployment's system prompt is shared by its conversations), so turn 1 may hit it.
- ``shared-system``: requests that share a random 2048-id prefix, each with its own 128-id suffix, at fixed
  concurrency; one request primes the prefix before the timed ones. TTFT p50/p99, requests/s, output tokens/s,
  mean cached tokens and the requests that hit.
- ``host``: N distinct 16K-id prompts sent once each (max_tokens 1), so the first are evicted from device memory
  if it cannot hold all; then the last re-sent (a device hit, for reference) and the first few re-sent. A
  server with a host tier restores them from there; without one this measures recompute.
  ``--reset-prefix-cache`` and ``--warmup`` act before the fill too.

The script measures one server: compare caching on and off by running it against two servers (for ours,
``--enable-prefix-caching`` and ``--no-enable-prefix-caching``). Lengths are capped to fit ``--max-model-len``
(default: the ``max_model_len`` that /v1/models reports). Needs aiohttp (``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

SCENARIOS = ("cold-warm", "repeat", "chat", "shared-system", "host")
TTFT_METRIC = "vllm:time_to_first_token_seconds"
NEW_SUFFIX = 64  # new ids after a cached prefix (cold-warm's third request)
# Common English words, about one token each with their leading space, for the chat's text.
WORD_TEXT = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health person "
         "art war history party result change morning reason research girl guy moment air teacher force education "
         "small large good new first last long great little own other old big high different young important "
         "make know take see come think look want give use find tell ask work seem feel try leave call keep let "
         "begin show hear play run move live believe hold bring happen write provide sit stand lose pay meet")
WORDS = WORD_TEXT.split()


def chunk_output(chunk: dict) -> tuple[str, bool]:
    """(answer text, whether it carries output) of one streamed chunk of /v1/completions or /v1/chat/completions.
    Output is text, reasoning, a tool call or a finish reason; a role-only or usage-only chunk carries none."""
    choice = (chunk.get("choices") or [{}])[0]
    delta = choice.get("delta") or {}
    text = choice.get("text") or delta.get("content") or ""
    other = delta.get("reasoning") or delta.get("reasoning_content") or delta.get("tool_calls")
    return text, bool(text or other or choice.get("finish_reason"))


def chunk_token_ids(chunk: dict) -> list[int]:
    """The token ids a /v1/completions chunk's logprobs name as "token_id:N" (return_tokens_as_token_ids)."""
    tokens = ((chunk.get("choices") or [{}])[0].get("logprobs") or {}).get("tokens") or []
    return [int(t.split(":", 1)[1]) for t in tokens if t.startswith("token_id:")]


def usage_figures(usage: dict | None) -> dict:
    """prompt, completion and cached tokens of a usage object (None where the server gives none)."""
    usage = usage or {}
    return {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def fitted(lengths: list[int], max_model_len: int | None, extra: int) -> list[int]:
    """Prompt lengths capped so that each plus ``extra`` tokens fits ``max_model_len``; sorted, without repeats."""
    cap = max_model_len - extra if max_model_len else None
    return sorted({min(n, cap) if cap else n for n in lengths})


def ms(result: dict) -> float | None:
    return result["ttft"] * 1e3 if "ttft" in result else None


def histogram_totals(text: str, name: str) -> tuple[float, float] | None:
    """(sum, count) of the Prometheus histogram ``name`` in a /metrics page (summed over its label sets), or None
    when the page has none."""
    totals = {"_sum": 0.0, "_count": 0.0}
    found = False
    for line in text.splitlines():
        for suffix in totals:
            if line.startswith(name + suffix + "{") or line.startswith(name + suffix + " "):
                totals[suffix] += float(line.rsplit(" ", 1)[1])
                found = True
    return (totals["_sum"], totals["_count"]) if found else None


def markdown_table(rows: list[dict], cols: tuple[str, ...]) -> str:
    cell = lambda v: "null" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows])


def summarize_shared(results: list[dict], wall: float) -> dict:
    """TTFT p50/p99, throughput and cached tokens of the shared-system requests."""
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] * 1e3 for r in ok]
    cached = [r["cached_tokens"] for r in ok if r["cached_tokens"] is not None]
    pct = lambda q: float(np.percentile(ttft, q)) if ttft else None
    return {"requests": len(results), "errors": len(results) - len(ok), "ttft_p50_ms": pct(50),
            "ttft_p99_ms": pct(99), "req_s": len(ok) / wall,
            "output_tok_s": sum(r["completion_tokens"] or 0 for r in ok) / wall,
            "mean_cached_tokens": float(np.mean(cached)) if cached else None,
            "hits": sum(c > 0 for c in cached) if cached else None}


class Server:
    """Streaming requests to one OpenAI-compatible server."""

    def __init__(self, session, base_url: str, model: str | None = None):
        self.session, self.base_url, self.model = session, base_url.rstrip("/"), model

    async def models(self) -> list[dict]:
        async with self.session.get(self.base_url + "/v1/models") as resp:
            resp.raise_for_status()
            return (await resp.json())["data"]

    async def ttft_totals(self) -> tuple[float, float] | None:
        """The server's (sum s, count) of its TTFT histogram, or None where /metrics lacks one."""
        async with self.session.get(self.base_url + "/metrics") as resp:
            return histogram_totals(await resp.text(), TTFT_METRIC) if resp.status == 200 else None

    async def reset_prefix_cache(self) -> bool:
        """POST /reset_prefix_cache; False where the server has none (404)."""
        async with self.session.post(self.base_url + "/reset_prefix_cache") as resp:
            if resp.status == 404:
                return False
            resp.raise_for_status()
            return True

    async def stream(self, path: str, payload: dict) -> dict:
        """One streamed request: TTFT and latency (s), the answer's text, usage figures; or {"error": ...}."""
        payload = {"model": self.model, "temperature": 0, "stream": True,
                   "stream_options": {"include_usage": True}, **payload}
        start = time.perf_counter()
        first, usage, parts, ids = None, None, [], []
        async with self.session.post(self.base_url + path, json=payload) as resp:
            if resp.status != 200:
                return {"error": f"HTTP {resp.status}: {(await resp.text())[:200]}"}
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    return {"error": str(chunk["error"])[:200]}
                usage = chunk.get("usage") or usage
                text, output = chunk_output(chunk)
                if output and first is None:
                    first = time.perf_counter()
                parts.append(text)
                ids += chunk_token_ids(chunk)
        if first is None:
            return {"error": "no output"}
        return {"ttft": first - start, "latency": time.perf_counter() - start, "text": "".join(parts),
                "token_ids": ids, **usage_figures(usage)}

    async def complete(self, prompt: list[int], max_tokens: int, **extra) -> dict:
        return await self.stream("/v1/completions",
                                 {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra})

    async def chat(self, messages: list[dict], max_tokens: int, **extra) -> dict:
        return await self.stream("/v1/chat/completions",
                                 {"messages": messages, "max_tokens": max_tokens, "ignore_eos": True, **extra})


async def cold_warm(server: Server, args, rng) -> dict:
    ids = lambda n: rng.integers(0, args.vocab, n).tolist()
    rows = []
    for length in fitted(args.lengths, args.max_model_len, NEW_SUFFIX + 1):
        reset = await server.reset_prefix_cache() if args.reset_prefix_cache else None
        if args.warmup:
            await server.complete(ids(length + NEW_SUFFIX), 1)
        prefix = ids(length)
        cold = await server.complete(prefix, 1)
        warm = await server.complete(prefix, 1)
        suffix = await server.complete(prefix + ids(NEW_SUFFIX), 1)
        errors = [r["error"] for r in (cold, warm, suffix) if "error" in r]
        rows.append({"prefix_len": length, "cold_ttft_ms": ms(cold), "warm_ttft_ms": ms(warm),
                     "suffix_ttft_ms": ms(suffix), "cold_cached": cold.get("cached_tokens"),
                     "warm_cached": warm.get("cached_tokens"), "suffix_cached": suffix.get("cached_tokens"),
                     "speedup": ms(cold) / ms(warm) if not errors else None, "reset": reset,
                     "error": errors[0] if errors else None})
        print(json.dumps(rows[-1]), flush=True)
    return {"rows": rows, "note": f"cold / warm: the same prompt twice; suffix: the prefix + {NEW_SUFFIX} new ids; "
                                  "max_tokens 1"}


async def repeat(server: Server, args, rng) -> dict:
    rows = []
    for length in fitted(args.lengths, args.max_model_len, 1):
        prompt = rng.integers(0, args.vocab, length).tolist()
        first = await server.complete(prompt, 1)
        before = await server.ttft_totals()
        results = [await server.complete(prompt, 1) for _ in range(args.repeats)]
        after = await server.ttft_totals()
        ttft = [ms(r) for r in results if "ttft" in r]
        errors = [r["error"] for r in [first, *results] if "error" in r]
        counted = after[1] - before[1] if before and after else 0
        p50, low, high = (float(np.percentile(ttft, q)) for q in (50, 0, 100)) if ttft else (None,) * 3
        rows.append({"prefix_len": length, "cached": results[-1].get("cached_tokens"), "client_p50_ms": p50,
                     "client_min_ms": low, "client_max_ms": high,
                     "server_mean_ms": 1e3 * (after[0] - before[0]) / counted if counted else None,
                     "error": errors[0] if errors else None})
        print(json.dumps(rows[-1]), flush=True)
    return {"rows": rows, "note": f"each prompt sent once, then {args.repeats} times again (max_tokens 1); server: "
                                  f"its {TTFT_METRIC} over the repeats"}


async def chat(server: Server, args, rng) -> dict:
    words = lambda n: " ".join(rng.choice(WORDS, n)).capitalize() + "."
    ids = lambda n: rng.integers(0, args.vocab, n).tolist()
    extra = {"chat_template_kwargs": args.chat_template_kwargs} if args.chat_template_kwargs else {}
    messages = [{"role": "system", "content": words(args.chat_system_words)}]
    history = ids(args.chat_system_words)  # --chat-ids: the conversation's token ids
    if args.chat_system_seen:  # another conversation's first turn on the same system prompt, untimed
        if args.chat_ids:
            await server.complete(history + ids(args.chat_user_words), 1)
        else:
            await server.chat([*messages, {"role": "user", "content": words(args.chat_user_words)}], 1, **extra)
    rows = []
    for turn in range(1, args.chat_turns + 1):
        if turn > 1:
            await asyncio.sleep(args.chat_think_s)
        if args.chat_ids:
            history += ids(args.chat_user_words)
            result = await server.complete(history, args.chat_max_tokens, logprobs=0, return_tokens_as_token_ids=True)
            history += result.get("token_ids", [])
        else:
            messages.append({"role": "user", "content": words(args.chat_user_words)})
            result = await server.chat(messages, args.chat_max_tokens, **extra)
            messages.append({"role": "assistant", "content": result.get("text", "")})
        if "error" in result:
            rows.append({"turn": turn, "error": result["error"]})
            break
        rows.append({"turn": turn, "ttft_ms": ms(result), "prompt_tokens": result["prompt_tokens"],
                     "cached_tokens": result["cached_tokens"], "completion_tokens": result["completion_tokens"]})
        print(json.dumps(rows[-1]), flush=True)
    ok = [r for r in rows if "error" not in r]
    cached = [r["cached_tokens"] for r in ok if r["cached_tokens"] is not None]
    summary = {"turns": len(ok), "errors": len(rows) - len(ok), "ttft_sum_ms": sum(r["ttft_ms"] for r in ok),
               "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
               "cached_tokens": sum(cached) if cached else None}
    return {"rows": rows, "summary": summary}


async def shared_system(server: Server, args, rng) -> dict:
    ids = lambda n: rng.integers(0, args.vocab, n).tolist()
    prefix = ids(min(args.shared_len, args.max_model_len - args.shared_suffix - args.shared_max_tokens)
                 if args.max_model_len else args.shared_len)
    prime = await server.complete(prefix + ids(args.shared_suffix), 1)
    gate = asyncio.Semaphore(args.shared_concurrency)

    async def limited(prompt):
        async with gate:
            return await server.complete(prompt, args.shared_max_tokens)
    prompts = [prefix + ids(args.shared_suffix) for _ in range(args.shared_requests)]
    start = time.perf_counter()
    results = await asyncio.gather(*(limited(p) for p in prompts))
    summary = {"prefix_len": len(prefix), "suffix_len": args.shared_suffix, "concurrency": args.shared_concurrency,
               **summarize_shared(results, time.perf_counter() - start), "prime_error": prime.get("error")}
    print(json.dumps(summary), flush=True)
    return {"rows": [summary], "note": "one request primes the shared prefix before the timed requests"}


async def host(server: Server, args, rng) -> dict:
    length = fitted([args.host_len], args.max_model_len, 1)[0]
    prompts = [rng.integers(0, args.vocab, length).tolist() for _ in range(args.host_prefixes)]
    rows = []
    if args.reset_prefix_cache:
        await server.reset_prefix_cache()
    if args.warmup:
        await server.complete(rng.integers(0, args.vocab, length).tolist(), 1)

    async def send(phase: str, index: int):
        result = await server.complete(prompts[index], 1)
        rows.append({"phase": phase, "prefix": index, "prefix_len": length, "ttft_ms": ms(result),
                     "cached_tokens": result.get("cached_tokens"), "error": result.get("error")})
        print(json.dumps(rows[-1]), flush=True)
    for i in range(args.host_prefixes):
        await send("fill", i)
    await send("recent", args.host_prefixes - 1)
    for i in range(min(args.host_resend, args.host_prefixes - 1)):
        await send("resend", i)
    note = ("fill: each prompt once (cold); recent: the last one again (on device); resend: the first ones again. "
            "Without a host tier an evicted prefix is recomputed (TTFT near fill, no cached tokens); a resend near "
            "recent with cached tokens was still on device or came back from the host tier; if all prompts fit "
            "the device cache nothing was evicted.")
    return {"rows": rows, "note": note}


RUNS = {"cold-warm": (cold_warm, ("prefix_len", "cold_ttft_ms", "warm_ttft_ms", "suffix_ttft_ms", "cold_cached",
                                  "warm_cached", "suffix_cached", "speedup", "error")),
        "repeat": (repeat, ("prefix_len", "cached", "client_p50_ms", "client_min_ms", "client_max_ms",
                            "server_mean_ms", "error")),
        "chat": (chat, ("turn", "ttft_ms", "prompt_tokens", "cached_tokens", "completion_tokens", "error")),
        "shared-system": (shared_system, ("prefix_len", "suffix_len", "concurrency", "requests", "errors",
                                          "ttft_p50_ms", "ttft_p99_ms", "req_s", "output_tok_s",
                                          "mean_cached_tokens", "hits")),
        "host": (host, ("phase", "prefix", "prefix_len", "ttft_ms", "cached_tokens", "error"))}


async def run(args) -> None:
    import aiohttp  # the bench extra; the functions above serve the tests without it

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None)) as session:
        server = Server(session, args.base_url, args.model)
        if not args.model or not args.max_model_len:
            card = (await server.models())[0]
            server.model = args.model = args.model or card["id"]
            args.max_model_len = args.max_model_len or card.get("max_model_len")
        shown = {k: v for k, v in vars(args).items() if k != "api_key"}
        report = {"args": shown, "date": time.strftime("%Y-%m-%d"), "scenarios": {}}
        for name in args.scenarios:
            scenario, cols = RUNS[name]
            rng = np.random.default_rng([args.seed, SCENARIOS.index(name)])  # its own ids, whichever run first
            result = report["scenarios"][name] = await scenario(server, args, rng)
            print(f"\n### {name} ({args.model})\n\n{markdown_table(result['rows'], cols)}\n", flush=True)
            if "summary" in result:
                print(markdown_table([result["summary"]], tuple(result["summary"])) + "\n")
            if "note" in result:
                print(result["note"] + "\n", flush=True)
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--max-model-len", type=int, default=None, help="default: what /v1/models reports")
    parser.add_argument("--vocab", type=int, default=248_000, help="random ids are drawn below this")
    parser.add_argument("--seed", type=int, default=None, help="default: from the clock (fresh prompts per run)")
    parser.add_argument("--out", default="bench_prefix.json")
    group = parser.add_argument_group("cold-warm")
    group.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8192, 16384, 32768])
    group.add_argument("--reset-prefix-cache", action="store_true",
                       help="POST /reset_prefix_cache before each length (and before the host fill)")
    group.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                       help="an unrelated prompt of the same shape before each length and the host fill (default on)")
    group.add_argument("--repeats", type=int, default=10, help="repeat: sends of each prompt after the first")
    group = parser.add_argument_group("chat")
    group.add_argument("--chat-turns", type=int, default=10)
    group.add_argument("--chat-system-words", type=int, default=500)
    group.add_argument("--chat-user-words", type=int, default=100)
    group.add_argument("--chat-max-tokens", type=int, default=128)
    group.add_argument("--chat-think-s", type=float, default=0.0, help="seconds between an answer and the next turn")
    group.add_argument("--chat-ids", action="store_true", help="the conversation as token ids on /v1/completions")
    group.add_argument("--chat-system-seen", action="store_true",
                       help="another conversation's first turn on the same system prompt goes first, untimed")
    group.add_argument("--chat-template-kwargs", type=json.loads, default=None,
                       help='JSON sent as chat_template_kwargs, e.g. \'{"enable_thinking": false}\'')
    group = parser.add_argument_group("shared-system")
    group.add_argument("--shared-len", type=int, default=2048)
    group.add_argument("--shared-suffix", type=int, default=128)
    group.add_argument("--shared-concurrency", type=int, default=16)
    group.add_argument("--shared-requests", type=int, default=64)
    group.add_argument("--shared-max-tokens", type=int, default=64)
    group = parser.add_argument_group("host")
    group.add_argument("--host-prefixes", type=int, default=8)
    group.add_argument("--host-len", type=int, default=16384)
    group.add_argument("--host-resend", type=int, default=2, help="of the first prompts, re-sent after the fill")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = time.time_ns() % 2**32
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
