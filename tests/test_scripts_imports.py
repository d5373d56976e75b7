"""The maintainers' tools (scripts/) and benchmarks (bench/) run on the GPU machine, where CI never goes:
every `from fa4gen... import name` in them (Python files and the Python here-documents of the shell
scripts) must name something fa4gen still has. A name moved inside the package once broke
scripts/gpu_check.sh's prebuild with no CPU test noticing."""
import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _sources():
    for p in sorted([*ROOT.glob("scripts/*.py"), *ROOT.glob("bench/*.py")]):
        yield p.relative_to(ROOT).as_posix(), p.read_text()
    for p in sorted(ROOT.glob("scripts/*.sh")):
        text = p.read_text()
        # python here-documents: `"$PY" - <<'EOF' ... EOF` (any delimiter)
        for k, m in enumerate(re.finditer(r"<<\s*'?(\w+)'?[^\n]*\n(.*?)\n\1\n", text, re.S)):
            if "import " in m.group(2):
                yield f"{p.relative_to(ROOT).as_posix()}#heredoc{k}", m.group(2)


def _fa4gen_imports(src: str):
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("fa4gen"):
            yield node.module, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("fa4gen"):
                    yield a.name, [], node.lineno


SOURCES = list(_sources())


def test_the_shell_scripts_python_is_found():
    assert any(name.startswith("scripts/gpu_check.sh#") for name, _ in SOURCES)


@pytest.mark.parametrize("name, src", SOURCES, ids=[n for n, _ in SOURCES])
def test_every_fa4gen_name_a_tool_imports_exists(name, src):
    missing = []
    for module, names, line in _fa4gen_imports(src):
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            if "torch" in str(e) or "cuda" in str(e):
                continue  # needs the GPU machine's packages: its names are checked where it imports
            missing.append(f"line {line}: import {module} ({e})")
            continue
        missing += [f"line {line}: {module}.{n}" for n in names
                    if not hasattr(mod, n) and importlib.util.find_spec(f"{module}.{n}") is None]
    assert not missing, f"{name} imports names fa4gen does not have: {missing}"
