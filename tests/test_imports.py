"""The package's folders are the chain: spec -> ir -> verify -> lower -> render -> assemble -> codegen ->
runtime (load and launch), with evidence/ beside it and cli.py and integrations/ (framework adapters) on top. Every module belongs to one stage, imports run down
the chain only (a stage imports its own and earlier stages, even inside a function), no stage imports
evidence/, nothing imports the CLI, and no two modules import each other, directly or around a circle.
Inside spec/, the plan reads only the config, the tile rules and the ISA's facts (encodings.py), and those
two leaves import nothing of the package."""
import ast
import functools
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "fa4gen"

# The chain, in order: a module may import its own stage and the ones before it.
CHAIN = ("spec", "ir", "verify", "lower", "render", "assemble", "codegen", "runtime")
BESIDE = {"evidence": set(CHAIN) | {"evidence", "package"},  # may read any stage; no stage reads it
          "cli": set(CHAIN) | {"evidence", "package", "cli"},  # the command line: everything, imported by nothing
          "integrations": set(CHAIN) | {"integrations", "package"},  # framework adapters: on top, imported by nothing
          "package": set(CHAIN) | {"package"}}  # fa4gen/__init__.py: the public API (config, runtime, lazily)


def _imports(path: Path, src: str | None = None) -> set[str]:
    """Modules a file imports (absolute names inside fa4gen), including imports inside functions."""
    return set(_parsed_imports(path, src if src is not None else path.read_text()))


@functools.lru_cache(maxsize=None)
def _parsed_imports(path: Path, src: str) -> frozenset[str]:
    """_imports, once per file content: each test that edits one module re-reads only that one."""
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    pkg = parts[:-1] if path.name != "__init__.py" else parts
    out = set()
    for node in ast.walk(ast.parse(src)):
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
    return frozenset(m for m in out if m.startswith("fa4gen"))


def stage_of(mod: str) -> str:
    """The stage a module of the package belongs to: its folder under fa4gen/, or codegen / cli / package."""
    parts = mod.split(".")
    if parts[0] != "fa4gen":
        raise ValueError(mod)
    if len(parts) == 1:
        return "package"
    if parts[1] in CHAIN or parts[1] in BESIDE:
        return parts[1]
    raise AssertionError(f"{mod}: no stage (fa4gen/ holds only the stage folders, codegen.py and cli.py)")


def may_import(importer: str, imported: str) -> bool:
    a, b = stage_of(importer), stage_of(imported)
    if a in BESIDE:
        return b in BESIDE[a]
    return b in CHAIN and CHAIN.index(b) <= CHAIN.index(a)


def _upward_imports(files: dict) -> dict[str, list[str]]:
    """module -> what it imports against the chain's direction."""
    bad = {}
    for mod, (path, src) in files.items():
        wrong = sorted(m for m in _targets(mod, path, src, files) if not may_import(mod, m))
        if wrong:
            bad[mod] = wrong
    return bad


def test_every_module_belongs_to_a_stage():
    for mod in _package_files():
        stage_of(mod)  # raises for a module outside the stages


def test_imports_run_down_the_chain():
    bad = _upward_imports(_package_files())
    assert not bad, f"imports against the chain {' -> '.join(CHAIN)} (evidence and cli beside it): {bad}"


@pytest.mark.parametrize("importer, imported", [
    ("fa4gen.spec.config", "fa4gen.render.jinja"),  # the fingerprint once read the templates' folder from render
    ("fa4gen.lower.sm90", "fa4gen.assemble.assemble"),  # the PTX version table once lived in assemble
    ("fa4gen.lower.sm100", "fa4gen.render.jinja"),  # rendering belongs to render/, after the lowering
    ("fa4gen.verify.verify", "fa4gen.lower.walk"),
    ("fa4gen.codegen", "fa4gen.evidence.check"),
    ("fa4gen.runtime.api", "fa4gen.cli"),
    ("fa4gen.evidence.check", "fa4gen.cli"),
    ("fa4gen.runtime.api", "fa4gen.integrations.transformers"),
])
def test_an_import_against_the_chain_is_found(importer, imported):
    files = _package_files()
    path, src = files[importer]
    files[importer] = (path, src + f"\n\ndef _late():\n    import {imported}\n")
    assert imported in _upward_imports(files).get(importer, [])


def test_the_stage_order_is_the_one_the_package_shows():
    """Each stage folder exists and is a package: the layout and CHAIN cannot drift apart."""
    folders = {p.parent.name for p in PKG.glob("*/__init__.py")}
    assert folders == set(CHAIN) - {"codegen"} | {"evidence", "integrations"}
    assert {p.name for p in PKG.glob("*.py")} == {"__init__.py", "codegen.py", "cli.py"}
    # a folder named like a public name would replace it as the package's attribute once imported
    # (fa4gen.load, the function, became the module fa4gen.load when the stage 7 folder had that name)
    import fa4gen

    assert not folders & (set(fa4gen.__all__) | {"distributed"})


def test_the_plan_imports_only_the_config_the_tile_rules_and_the_isa_encodings():
    allowed = ("fa4gen.spec.config", "fa4gen.spec.tiles", "fa4gen.spec.encodings")
    assert {m for m in _imports(PKG / "spec" / "plan.py") if not m.startswith(allowed)} == set()


@pytest.mark.parametrize("leaf", ["tiles.py", "encodings.py"])
def test_the_tile_rules_and_the_isa_encodings_import_nothing_of_the_package(leaf):
    assert _imports(PKG / "spec" / leaf) == set()


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(mod: str, path: Path, src: str, files: dict) -> set[str]:
    """The package's modules one file imports. `from . import x` names the module x when x is one,
    so a package's __init__ is not counted as the importer's target in its place."""
    mods = set(files)
    out = set()
    for m in _imports(path, src):
        if m in mods:
            out.add(m)
        elif m.rsplit(".", 1)[0] in mods and m.rsplit(".", 1)[0] != mod:
            out.add(m.rsplit(".", 1)[0])  # `from .x import name`: the module x
    # `from .runtime import api` reads as both "fa4gen.load" and "fa4gen.runtime.api": the package itself is only
    # a target when no submodule of it was what the import named
    out -= {m for m in out if any(o.startswith(m + ".") for o in out)}
    return out - {mod}


def _graph(files: dict[str, str]) -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    return {mod: _targets(mod, path, src, files) for mod, (path, src) in files.items()}


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


@pytest.mark.parametrize("a, b", [("fa4gen.spec.config", "fa4gen.spec.plan"),
                                  ("fa4gen.evidence.ptxemu.kvcache", "fa4gen.evidence.ptxemu.harness")])
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
    """PrebuiltKernel.__call__ once named its launch closure `launch`, hiding the fa4gen.runtime.launch module its
    own next line called (an UnboundLocalError / AttributeError on the GPU only)."""
    bad = {str(p.relative_to(PKG)): _shadowed_imports(p.read_text(), str(p)) for p in sorted(PKG.rglob("*.py"))}
    assert not {k: v for k, v in bad.items() if v}


def test_a_shadowed_module_is_found():
    src = ("from . import launch\n\nclass K:\n    def __call__(self):\n        def launch(x):\n            return x\n"
           "        return launch.answer(launch)\n")
    assert _shadowed_imports(src, "x.py") == ["K.__call__: launch"]
