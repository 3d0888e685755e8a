"""The engine runs the model through its public forward: no module under hybrid_jax/engine reads a layer's
parameters or internals (the caches and layers own those)."""

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "hybrid_jax" / "engine"
# Attributes that only a layer, its cache or its projections may touch.
LAYER_INTERNALS = {"A_log", "dt_bias", "conv1d", "q_norm", "k_norm", "in_proj_qkv", "in_proj_z", "in_proj_a",
                   "in_proj_b", "q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "gate_proj", "up_proj",
                   "down_proj", "kernel", "weight", "self_attn", "linear_attn", "mlp", "layers"}


def test_engine_reads_no_layer_internals():
    found = [f"{path.name}:{node.lineno} .{node.attr}"
             for path in sorted(ENGINE.glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr in LAYER_INTERNALS]
    assert not found, "the engine reaches into the layers:\n" + "\n".join(found)
