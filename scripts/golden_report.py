"""Print our logits' agreement with the HF transformers fixtures (tests/fixtures/golden), per case and prompt.

    python scripts/golden_report.py

fp32 weights: max |error| relative to the logits' max magnitude; bf16 weights: mean and p99 of |dlogit|
against the fp32 oracle (the bounds the tests assert: 1e-4; 0.06 and 0.2).
"""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

import hybrid_jax

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "golden"


def main() -> None:
    forward = nnx.jit(lambda m, x: m(x))
    print(f"{'case':16} {'prompt':>10} {'fp32 max err/max':>17} {'bf16 mean':>10} {'bf16 p99':>9}")
    for case in sorted(p.name for p in GOLDEN.iterdir()):
        data = np.load(GOLDEN / case / "golden.npz")
        models = {dtype: hybrid_jax.load_pretrained(GOLDEN / case, dtype) for dtype in ("float32", "bfloat16")}
        for k in range(int(data["num_prompts"])):
            ids, pos, want = data[f"input_ids_{k}"], data[f"positions_{k}"], data[f"logits_{k}"]
            got = {d: np.asarray(forward(m, jnp.asarray(ids)))[:, pos] for d, m in models.items()}
            rel = np.abs(got["float32"] - want).max() / np.abs(want).max()
            d = np.abs(got["bfloat16"] - want)
            print(f"{case:16} {f'{ids.shape[0]}x{ids.shape[1]}':>10} {rel:17.2e} {d.mean():10.4f} "
                  f"{np.percentile(d, 99):9.4f}")


if __name__ == "__main__":
    main()
