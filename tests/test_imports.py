"""The chain's imports run one way: tiles -> config -> plan -> ir -> passes -> lower -> codegen / api
(the plan also reads fa4gen/encodings.py, the ISA's facts, which imports nothing of the package).
Nothing in ir/, passes/ or the plan imports lower/ (a fact must not flow back up from a lowering), and
no two modules of the package import each other, directly or around a circle, even inside a function."""
import ast
from pathlib import Path

import pytest

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


def test_the_plan_imports_only_the_config_the_tile_rules_and_the_isa_encodings():
    allowed = ("fa4gen.config", "fa4gen.tiles", "fa4gen.encodings")
    assert {m for m in _imports(PKG / "plan.py") if not m.startswith(allowed)} == set()


@pytest.mark.parametrize("leaf", ["tiles.py", "encodings.py"])
def test_the_tile_rules_and_the_isa_encodings_import_nothing_of_the_package(leaf):
    assert _imports(PKG / leaf) == set()


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph(files: dict[str, str]) -> dict[str, set[str]]:
    """module -> the package's modules it imports. `from . import x` names the module x when x is one,
    so a package's __init__ is not counted as the importer's target in its place."""
    mods = set(files)
    graph = {}
    for mod, (path, src) in files.items():
        out = set()
        for m in _imports(path, src):
            if m in mods:
                out.add(m)
            elif m.rsplit(".", 1)[0] in mods and m.rsplit(".", 1)[0] != mod:
                out.add(m.rsplit(".", 1)[0])  # `from .x import name`: the module x
        # `from . import api` reads as both "fa4gen" and "fa4gen.api": the package itself is only a target
        # when no submodule of it was what the import named
        out -= {m for m in out if any(o.startswith(m + ".") for o in out)}
        graph[mod] = out - {mod}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package_files() -> dict:
    return {_module_of(p): (p, p.read_text()) for p in sorted(PKG.rglob("*.py"))}


def test_no_import_circle_in_the_package():
    circles = _circles(_graph(_package_files()))
    assert not circles, "modules that import each other (directly or around a circle): " + "; ".join(
        " <-> ".join(c) for c in circles)


@pytest.mark.parametrize("a, b", [("fa4gen.config", "fa4gen.plan"), ("fa4gen.ptxemu.kvcache", "fa4gen.ptxemu.harness")])
def test_a_circle_through_an_import_inside_a_function_is_found(a, b):
    files = _package_files()
    path_a, src_a = files[a]
    files[a] = (path_a, src_a + f"\n\ndef _late():\n    import {b}\n")
    assert any(a in c and b in c for c in _circles(_graph(files)))


def test_an_upward_import_inside_a_function_is_seen():
    src = "def f():\n    from ..lower.sm90 import smem_plan\n    return smem_plan\n"
    assert "fa4gen.lower.sm90" in _imports(PKG / "ir" / "x.py", src)


def _shadowed_imports(src: str, filename: str) -> list[str]:
    """Functions that bind a local name (a def, an assignment) equal to a module-level import they
    also read: every read of it in that function sees the local, never the module."""
    import symtable

    top = symtable.symtable(src, filename, "exec")
    imported = {s.get_name() for s in top.get_symbols() if s.is_imported()}
    out = []

    def walk(t, path):
        for child in t.get_children():
            where = f"{path}.{child.get_name()}" if path else child.get_name()
            if child.get_type() == "function":
                for s in child.get_symbols():
                    if (s.get_name() in imported and s.is_local() and not s.is_imported() and s.is_referenced()
                            and s.is_assigned()):
                        out.append(f"{where}: {s.get_name()}")
            walk(child, where)

    walk(top, "")
    return out


def test_no_function_shadows_a_module_it_reads():
    """PrebuiltKernel.__call__ once named its launch closure `launch`, hiding the fa4gen.launch module its
    own next line called (an UnboundLocalError / AttributeError on the GPU only)."""
    bad = {str(p.relative_to(PKG)): _shadowed_imports(p.read_text(), str(p)) for p in sorted(PKG.rglob("*.py"))}
    assert not {k: v for k, v in bad.items() if v}


def test_a_shadowed_module_is_found():
    src = ("from . import launch\n\nclass K:\n    def __call__(self):\n        def launch(x):\n            return x\n"
           "        return launch.answer(launch)\n")
    assert _shadowed_imports(src, "x.py") == ["K.__call__: launch"]
