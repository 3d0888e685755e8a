"""Qwen3.5 layers: one file per layer type."""
