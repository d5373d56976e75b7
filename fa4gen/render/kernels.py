"""The two kernels rendered: each lowering's template context through its target's template, tidied.

build_sm90 / build_sm100 give (PTX text, ABI manifest); fa4gen.codegen.build is the verified chain around them.
"""

from __future__ import annotations

from ..lower.sm90 import Sm90Options, lowered_sm90
from ..lower.sm100 import lowered_sm100
from .jinja import render

__all__ = ["build_sm100", "build_sm90", "tidy"]


def build_sm90(cfg_or_pipe, options: Sm90Options | None = None) -> tuple[str, dict]:
    """(PTX text, manifest) of the sm_90a kernel, lowered from its pipeline IR. Takes a KernelConfig
    (builds its pipeline, unverified: fa4gen.codegen.build is the verified chain) or a Pipeline."""
    ctx, manifest = lowered_sm90(cfg_or_pipe, options)
    return tidy(render("sm90/fa4_fwd.ptx.j2", ctx)), manifest


def build_sm100(pipe_or_cfg) -> tuple[str, dict]:
    """(PTX text, ABI manifest) of the sm_100a kernel. Takes a KernelConfig (builds its pipeline,
    unverified: fa4gen.codegen.build is the verified chain) or a Pipeline."""
    ctx, manifest = lowered_sm100(pipe_or_cfg)
    return tidy(render("sm100/fa4_fwd.ptx.j2", ctx)), manifest


def tidy(ptx: str) -> str:
    """Drop the empty lines macro calls leave; one empty line before each role and dispatch block."""
    out = []
    for line in ptx.splitlines():
        if not line.strip():
            continue
        if line.startswith(("// role ", "// ====")):
            out.append("")
        out.append(line)
    return "\n".join(out) + "\n"
