"""Logits of one random-weight model at tp=1 and at tp=N on the same machine; print the difference.

    python3 scripts/gpu/tp_logits.py --size 9b --tp 2 [--tokens 256]

Both runs build the model from the same seed (identical bf16 weights, random at real shapes), so the
logits differ only by the order of the sharded reductions.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np
from flax import nnx

import hybrid_jax
from hybrid_jax.sharding import make_mesh, shard_model


def logits(size: str, tp: int, ids) -> np.ndarray:
    model = hybrid_jax.random_model(size, "bfloat16", seed=0)
    if tp > 1:
        shard_model(model, make_mesh(tp))
    return np.asarray(nnx.jit(lambda m, x: m(x))(model, ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="9b")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    ids = jax.random.randint(jax.random.PRNGKey(1), (1, args.tokens), 0, 248_000)
    base = logits(args.size, 1, ids)
    split = logits(args.size, args.tp, ids)
    diff = np.abs(base - split)
    same_top = float(np.mean(base.argmax(-1) == split.argmax(-1)))
    print(json.dumps({"size": args.size, "tp": args.tp, "max_abs_logit": float(np.abs(base).max()),
                      "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
                      "argmax_agreement": same_top}))


if __name__ == "__main__":
    main()
