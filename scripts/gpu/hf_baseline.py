"""HF transformers baseline at a Qwen3.5 size's real shapes (random bf16 weights): TTFT and TPOT at c=1.

    python3 scripts/gpu/hf_baseline.py --size 9b [--prompt-len 1024] [--output-len 128] [--out hf_9b.json]

Runs Qwen3_5ForCausalLM from transformers (with fla's kernels when installed) on the same random-prompt
shape as scripts/bench_serving.py: TTFT = one forward over the prompt; TPOT = (time of generate with
``output_len`` new tokens - TTFT) / (output_len - 1), greedy, eos ignored. Sizes come from
hybrid_jax.config.PRESETS so both engines use identical shapes.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from hybrid_jax.config import preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0.8b")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ours = preset(args.size).to_hf_dict()
    ours.pop("architectures")
    config = Qwen3_5TextConfig(**{k: v for k, v in ours.items() if k != "model_type"})
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 248_000, (1, args.prompt_len), device=device)

    def timed(fn, reps=3):
        fn()
        times = []
        for _ in range(reps):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    with torch.no_grad():
        ttft = timed(lambda: model(ids))
        total = timed(lambda: model.generate(ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                                             do_sample=False), reps=1)
    row = {"engine": "hf-transformers", "size": args.size, "ttft_ms": ttft * 1e3,
           "tpot_ms": (total - ttft) / (args.output_len - 1) * 1e3, "device": device,
           "weights": "random at real shapes, bf16", "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
