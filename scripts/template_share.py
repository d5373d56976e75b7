#!/usr/bin/env python3
"""How much of the sm_100a kernel's PTX comes from templates the H200 executes.

    python scripts/template_share.py

Every instruction line of every template macro is tagged with its file and macro (in a temporary
copy of templates/; the tag follows the instruction's own comment where the lowering prints one),
the kernels are rendered from that copy, and each PTX instruction line is attributed to the
innermost macro that printed it (untagged lines come from the kernel's top-level
template or a non-macro block). A sm_100a line counts as "executed on the H200" when it comes from a
templates/common/ macro that the sm_90a kernels the GPU tests run also expand (both exp2 splits).
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fa4gen import KernelConfig
from fa4gen.render import jinja as render  # noqa: E402

TAG = re.compile(r"//@m:(\S+)")


def tagged_copy(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    for f in dst.rglob("*.j2"):
        rel = f.relative_to(dst).as_posix()
        macro, out = None, []
        for line in f.read_text().splitlines():
            m = re.search(r"\{%-?\s*macro\s+(\w+)", line)
            if m:
                macro = m.group(1)
            if re.search(r"\{%-?\s*endmacro", line):
                macro = None
            s = line.rstrip()
            # an instruction line ends in ';', or in ';' + the lowering's comment (`{{ note | comment }}`)
            if macro and re.search(r";(\{\{[^{}]*\|\s*comment\s*\}\})?$", s) and not s.lstrip().startswith("//"):
                line = f"{s} //@m:{rel}:{macro}"
            out.append(line)
        f.write_text("\n".join(out) + "\n")


def instruction_origins(ptx: str) -> Counter:
    c = Counter()
    for line in ptx.splitlines():
        code = line.split("//@m:")[0].split("//")[0].strip()
        if not code.endswith(";") or code.startswith("."):
            continue
        m = TAG.search(line)
        c[m.group(1).rsplit("//@m:", 1)[-1] if m else "(top level)"] += 1
    return c


def render_with(tdir: Path, fn):
    render.environment.cache_clear()
    with mock.patch.object(render, "templates_dir", lambda: tdir):
        try:
            return fn()
        finally:
            render.environment.cache_clear()


def main():
    from fa4gen import codegen
    from fa4gen.render.kernels import build_sm90

    with tempfile.TemporaryDirectory() as tmp:
        tdir = Path(tmp) / "templates"
        tagged_copy(render.templates_dir(), tdir)
        h200 = Counter()
        for causal in (False, True):
            for emu in (0, 2):
                for d in (64, 128):
                    cfg = KernelConfig(arch="sm_90a", head_dim=d, causal=causal, emu_pairs=emu)
                    h200 += instruction_origins(render_with(tdir, lambda: build_sm90(cfg)[0]))
        executed = {k for k in h200 if k.startswith("common/")}
        print("common/ macros the sm_90a kernels expand:", ", ".join(sorted(executed)))
        for causal in (False, True):
            cfg = KernelConfig(arch="sm_100a", causal=causal, gqa_ratio=4)
            ptx = render_with(tdir, lambda: codegen.build(cfg, emit=("ptx",)).ptx)
            c = instruction_origins(ptx)
            total = sum(c.values())
            shared = sum(n for k, n in c.items() if k in executed)
            common = sum(n for k, n in c.items() if k.startswith("common/"))
            print(f"\n{cfg.name}: {total} PTX instruction lines; {common} ({100 * common / total:.1f}%) from "
                  f"templates/common/, {shared} ({100 * shared / total:.1f}%) from common macros the H200 executes")
            for k, n in c.most_common(12):
                print(f"  {n:6d}  {k}")


if __name__ == "__main__":
    main()
