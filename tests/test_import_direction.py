"""Imports run one way: ``server`` -> ``hybrid_jax`` -> ``pallas_kernels``. Every import of every module (function
bodies included) is read from its source; one that reaches a package above its own fails, named by file and line."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("pallas_kernels", "hybrid_jax", "server")  # each may import those before it, never those after


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of each import in the file, relative imports resolved against its package."""
    package = path.relative_to(root).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            found.append((node.lineno, ".".join((*base, *([node.module] if node.module else [])))))
    return found


def wrong_way_imports(layer: str, root: Path = ROOT) -> list[str]:
    """'file:line imports module' for each import in ``layer`` of a package after it in LAYERS."""
    above = LAYERS[LAYERS.index(layer) + 1:]
    return [f"{path.relative_to(root)}:{line} imports {module}"
            for path in sorted((root / layer).rglob("*.py"))
            for line, module in imported_modules(path, root)
            if module.split(".")[0] in above]


def test_imports_run_one_way():
    wrong = [entry for layer in LAYERS for entry in wrong_way_imports(layer)]
    assert not wrong, "imports against server -> hybrid_jax -> pallas_kernels:\n" + "\n".join(wrong)


def test_a_wrong_way_import_is_named(tmp_path):
    """The walk finds an upward import inside a function, resolves relative ones, and names the file and line."""
    (tmp_path / "pallas_kernels" / "op").mkdir(parents=True)
    (tmp_path / "pallas_kernels" / "op" / "kernel.py").write_text(
        "import jax\n\n\ndef f():\n    from hybrid_jax.layers import gdn\n    return gdn\n")
    (tmp_path / "pallas_kernels" / "op" / "reference.py").write_text("from ..op import kernel\nfrom . import kernel\n")
    (tmp_path / "hybrid_jax").mkdir()
    (tmp_path / "hybrid_jax" / "cli.py").write_text("import server.launcher, pallas_kernels\n")
    assert wrong_way_imports("pallas_kernels", tmp_path) == ["pallas_kernels/op/kernel.py:5 imports hybrid_jax.layers"]
    assert wrong_way_imports("hybrid_jax", tmp_path) == ["hybrid_jax/cli.py:1 imports server.launcher"]
    assert imported_modules(tmp_path / "pallas_kernels" / "op" / "reference.py", tmp_path) == [
        (1, "pallas_kernels.op"), (2, "pallas_kernels.op")]
