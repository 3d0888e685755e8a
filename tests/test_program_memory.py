"""scripts/program_memory.py on the tiny preset: one program compiled over an abstract model, its memory
analysis as a JSON row; the snapshot pool is among what a prefill with prefix caching updates in place."""

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "program_memory.py"
spec = importlib.util.spec_from_file_location("program_memory", SCRIPT)
program_memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(program_memory)


def analysis(monkeypatch, capsys, *args: str) -> dict:
    monkeypatch.setattr(sys, "argv", ["program_memory.py", "--size", "tiny", *args])
    program_memory.main()
    return json.loads(capsys.readouterr().out.splitlines()[0])


def test_prefill_memory_with_and_without_the_snapshot_pool(monkeypatch, capsys):
    on = analysis(monkeypatch, capsys, "--prefill", "128")
    off = analysis(monkeypatch, capsys, "--prefill", "128", "--no-enable-prefix-caching")
    assert on["program"] == off["program"] == "prefill T=128 (greedy only: False)"
    assert on["temp"] > 0 and off["temp"] > 0
    assert on["alias"] > off["alias"] > 0  # the snapshot pool, written in place
    assert on["argument"] - off["argument"] == on["alias"] - off["alias"]
