"""The chain's imports run one way: config -> plan -> ir -> passes -> lower -> codegen / api.
Nothing in ir/, passes/ or the plan imports lower/ (a fact must not flow back up from a lowering)."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "fa4gen"


def _imports(path: Path, src: str | None = None) -> set[str]:
    """Modules a file imports (absolute names inside fa4gen), including imports inside functions."""
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    pkg = parts[:-1] if path.name != "__init__.py" else parts
    out = set()
    for node in ast.walk(ast.parse(src if src is not None else path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("fa4gen")}


def test_nothing_below_the_lowering_imports_it():
    below = [*sorted((PKG / "ir").glob("*.py")), *sorted((PKG / "passes").glob("*.py")), PKG / "plan.py",
             PKG / "config.py"]
    bad = {str(p.relative_to(PKG)): sorted(m for m in _imports(p) if m.startswith("fa4gen.lower"))
           for p in below}
    assert not {k: v for k, v in bad.items() if v}


def test_the_plan_imports_only_the_config():
    assert {m for m in _imports(PKG / "plan.py") if not m.startswith("fa4gen.config")} == set()


def test_an_upward_import_inside_a_function_is_seen():
    src = "def f():\n    from ..lower.sm90 import smem_plan\n    return smem_plan\n"
    assert "fa4gen.lower.sm90" in _imports(PKG / "ir" / "x.py", src)
