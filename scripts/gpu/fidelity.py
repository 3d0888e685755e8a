"""Fidelity at a Qwen3.5 size: the engine's greedy tokens and log-probabilities against HF transformers in fp32.

    python3 scripts/gpu/fidelity.py --size 9b [--initializer-range 0.05] [--prompt-lens 4097 300]
        [--max-tokens 48] [--top-logprobs 5] [--out fidelity_9b.json]

1. HF transformers builds ``Qwen3_5ForCausalLM`` at the size's shapes with its own init (``initializer_range``)
   and writes it to a temporary directory as the released checkpoints are stored: bf16, with
   ``linear_attn.A_log`` and ``linear_attn.norm.weight`` in fp32.
2. The engine (a child process, so that JAX's memory is gone before torch needs it) loads that checkpoint in
   bf16 and decodes each prompt (random token ids) greedily for ``--max-tokens`` tokens, eos ignored, with the
   chosen token's log-probability and its top ``--top-logprobs`` alternatives.
3. HF loads the same file in fp32 (the reference) and in bf16, each run teacher-forced on prompt + the engine's
   tokens; log-probabilities are log_softmax over the whole vocabulary at each generated position.

Figures over all generated positions (and per prompt), for the engine and for HF bf16, each against HF fp32:

* ``token``: |logprob - fp32 logprob| of the engine's chosen token (mean, p99);
* ``top_k``: the same for each of the system's own top-k tokens at each position (mean, p99);
* ``greedy_agreement``: the share of positions where the system's top token is fp32's top token.

The fp32 reference runs HF's torch path for the Gated DeltaNet (fp32 arithmetic inside; fla's Triton kernels,
whose dots may round to TF32, are hidden unless ``--hf-fast-gdn``), with TF32 off. On a CPU a small run works
too: ``--size tiny --vocab-size 512 --prompt-lens 40 20 --max-tokens 16``. The checkpoint takes the size's bf16
weights on disk (~54 GB at 27B): ``--workdir`` puts it where there is room.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from hybrid_jax.config import Qwen35Config, preset

FP32_IN_CHECKPOINT = ("linear_attn.A_log", "linear_attn.norm.weight")  # as the released checkpoints store them
SYSTEMS = ("engine", "hf_bf16")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="9b", help="a preset of hybrid_jax.config (0.8b, 2b, 4b, 9b, 27b, tiny)")
    parser.add_argument("--vocab-size", type=int, default=None, help="override the preset's vocabulary")
    parser.add_argument("--initializer-range", type=float, default=0.05, help="std of HF's normal init")
    parser.add_argument("--seed", type=int, default=0, help="torch init and prompt seed")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[4097, 300])
    parser.add_argument("--max-tokens", type=int, default=48, help="greedy tokens generated per prompt")
    parser.add_argument("--top-logprobs", type=int, default=5, help="k of the top-k comparison (at most 20)")
    parser.add_argument("--hf-fast-gdn", action="store_true",
                        help="let HF use fla / causal-conv1d kernels where installed (default: its torch path)")
    parser.add_argument("--workdir", default=None, help="where the checkpoint goes (default: a temp dir, removed)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    return parser.parse_args(argv)


def hf_config(config: Qwen35Config):
    """Our config as HF's ``Qwen3_5TextConfig``."""
    from transformers import Qwen3_5TextConfig

    fields = config.to_hf_dict()
    for key in ("architectures", "model_type"):
        fields.pop(key)
    return Qwen3_5TextConfig(**fields)


def write_checkpoint(config: Qwen35Config, seed: int, directory: Path, device: str) -> None:
    """HF's own init of ``Qwen3_5ForCausalLM`` saved in bf16, the `FP32_IN_CHECKPOINT` tensors in fp32."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(hf_config(config))
    kept = {name: p.detach().clone() for name, p in model.named_parameters() if name.endswith(FP32_IN_CHECKPOINT)}
    model.to(torch.bfloat16)
    for name, p in model.named_parameters():
        if name in kept:
            p.data = kept[name]
    model.save_pretrained(directory)
    del model, kept
    free_torch_memory()


def free_torch_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_generate(checkpoint: str, prompts: list[list[int]], max_tokens: int, top_logprobs: int) -> dict:
    """Greedy decode of every prompt by the engine over the bf16 checkpoint: ``runs``, per prompt the tokens
    [N], their logprobs [N] and the top alternatives [N, k] (ids, logprobs); ``jax`` and ``device``. Runs in a
    child process."""
    import jax

    from hybrid_jax.engine.cache import pages_for
    from hybrid_jax.engine.engine import Engine, EngineConfig
    from hybrid_jax.engine.sampling_params import SamplingParams
    from hybrid_jax.loader import load_pretrained

    model = load_pretrained(checkpoint, "bfloat16")
    max_model_len = max(len(p) for p in prompts) + max_tokens
    page_size = EngineConfig.page_size
    config = EngineConfig(max_batch=len(prompts), max_model_len=max_model_len,
                          num_pages=len(prompts) * pages_for(max_model_len, page_size) + 1)
    engine = Engine(model, config).start(warmup=False)  # no eos: every request runs max_tokens
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=top_logprobs)
    try:
        handles = [engine.submit(p, params) for p in prompts]
        results = []
        for handle in handles:
            events = [e for e in handle if e.token_id is not None]
            results.append({"tokens": [e.token_id for e in events], "logprobs": [e.logprob for e in events],
                            "top_ids": [[i for i, _ in e.top_logprobs] for e in events],
                            "top_logprobs": [[lp for _, lp in e.top_logprobs] for e in events]})
        return {"runs": results, "jax": jax.__version__, "device": jax.devices()[0].device_kind}
    finally:
        engine.shutdown()


def load_hf(checkpoint: Path, config: Qwen35Config, dtype: str, device: str):
    """``Qwen3_5ForCausalLM`` in ``dtype`` on ``device`` with the checkpoint's tensors, copied in one at a time
    (each cast to ``dtype``: fp32 holds the file's values exactly)."""
    import torch
    from safetensors import safe_open
    from transformers import Qwen3_5ForCausalLM

    with torch.device(device):
        model = Qwen3_5ForCausalLM(hf_config(config)).to(getattr(torch, dtype)).eval()
    params = dict(model.named_parameters())  # a tied lm_head is the embedding's entry
    loaded = set()
    with torch.no_grad():
        for file in sorted(checkpoint.glob("*.safetensors")):
            with safe_open(str(file), "pt", device=device) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    params[name].copy_(f.get_tensor(name))
                    loaded.add(name)
    if loaded != set(params):
        raise RuntimeError(f"{checkpoint}: tensors missing from the files: {sorted(set(params) - loaded)}")
    return model


def hf_logprobs(checkpoint: Path, config: Qwen35Config, dtype: str, sequences: list[tuple[list[int], list[int]]],
                device: str) -> list[np.ndarray]:
    """HF teacher-forced on each (prompt, generated): log_softmax at the generated positions, [N, V] fp32 each."""
    import torch

    model = load_hf(checkpoint, config, dtype, device)
    out = []
    with torch.no_grad():
        for prompt, generated in sequences:
            ids = torch.tensor([prompt + generated[:-1]], device=device)  # position P-1+i predicts generated[i]
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=len(generated)).logits[0]  # [N, V]
            out.append(torch.log_softmax(logits.float(), dim=-1).cpu().numpy())
    del model
    free_torch_memory()
    return out


def summary(token: np.ndarray, top_k: np.ndarray, agree: np.ndarray) -> dict:
    """|dlogprob| of the chosen tokens [N] and of the top-k tokens [N, k]; agree [N] bool."""
    return {"positions": int(token.size),
            "token_mean": float(token.mean()), "token_p99": float(np.percentile(token, 99)),
            "top_k_mean": float(top_k.mean()), "top_k_p99": float(np.percentile(top_k, 99)),
            "greedy_agreement": float(agree.mean())}


def compare(engine: list[dict], fp32: list[np.ndarray], bf16: list[np.ndarray], k: int) -> dict:
    """The figures of the module docstring for each system, per prompt and over all positions."""
    parts = {name: [] for name in SYSTEMS}  # per prompt: (token [N], top_k [N, k], agree [N])
    for run, ref, low in zip(engine, fp32, bf16, strict=True):
        rows = np.arange(len(run["tokens"]))
        tokens = np.asarray(run["tokens"])  # [N]
        ref_top = ref.argmax(-1)  # [N]
        top_ids = np.asarray(run["top_ids"])[:, :k]  # [N, k]
        parts["engine"].append((np.abs(np.asarray(run["logprobs"]) - ref[rows, tokens]),
                                np.abs(np.asarray(run["top_logprobs"])[:, :k] - np.take_along_axis(ref, top_ids, 1)),
                                tokens == ref_top))
        low_top = np.argsort(-low, axis=-1)[:, :k]  # [N, k]
        parts["hf_bf16"].append((np.abs(low[rows, tokens] - ref[rows, tokens]),
                                 np.abs(np.take_along_axis(low, low_top, 1) - np.take_along_axis(ref, low_top, 1)),
                                 low_top[:, 0] == ref_top))
    return {name: {"all": summary(*(np.concatenate([p[j] for p in per]) for j in range(3))),
                   "per_prompt": [summary(*p) for p in per]}
            for name, per in parts.items()}


def print_table(report: dict) -> None:
    k = report["top_logprobs"]
    print(f"\nfidelity at {report['size']} (initializer_range {report['initializer_range']}, seed {report['seed']}): "
          f"|dlogprob| against HF fp32 teacher-forced on the engine's greedy tokens")
    print(f"{'system':<10}{'prompt':>8}{'positions':>11}{'token mean':>12}{'token p99':>11}"
          f"{f'top-{k} mean':>12}{f'top-{k} p99':>11}{'greedy agree':>14}")
    for name in SYSTEMS:
        rows = [(str(n), s) for n, s in zip(report["prompt_lens"], report["results"][name]["per_prompt"], strict=True)]
        for prompt, s in [*rows, ("all", report["results"][name]["all"])]:
            print(f"{name:<10}{prompt:>8}{s['positions']:>11}{s['token_mean']:>12.4f}{s['token_p99']:>11.4f}"
                  f"{s['top_k_mean']:>12.4f}{s['top_k_p99']:>11.4f}{s['greedy_agreement']:>14.3f}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not args.hf_fast_gdn:
        for package in ("fla", "causal_conv1d"):  # HF falls back to its torch path when these do not import
            sys.modules.setdefault(package, None)
    import torch
    import transformers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = preset(args.size).replace(initializer_range=args.initializer_range)
    if args.vocab_size:
        config = config.replace(vocab_size=args.vocab_size)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in args.prompt_lens]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fidelity-"))
    checkpoint = workdir / f"random-{args.size}"
    started = time.perf_counter()
    try:
        write_checkpoint(config, args.seed, checkpoint, device)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            engine = pool.submit(engine_generate, str(checkpoint), prompts, args.max_tokens,
                                 args.top_logprobs).result()
        sequences = [(p, run["tokens"]) for p, run in zip(prompts, engine["runs"], strict=True)]
        fp32 = hf_logprobs(checkpoint, config, "float32", sequences, device)
        bf16 = hf_logprobs(checkpoint, config, "bfloat16", sequences, device)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    report = {"size": args.size, "initializer_range": args.initializer_range, "seed": args.seed,
              "vocab_size": config.vocab_size, "prompt_lens": args.prompt_lens, "max_tokens": args.max_tokens,
              "top_logprobs": args.top_logprobs, "hf_fast_gdn": args.hf_fast_gdn, "device": engine["device"],
              "versions": {"jax": engine["jax"], "torch": torch.__version__, "transformers": transformers.__version__},
              "date": time.strftime("%Y-%m-%d"), "seconds": round(time.perf_counter() - started, 1),
              "results": compare(engine["runs"], fp32, bf16, args.top_logprobs),
              "engine_tokens": [run["tokens"] for run in engine["runs"]]}
    print_table(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
