"""The sm_100a emitter end to end: codegen.build over the default matrix, assembled for sm_100a.

Assembly needs ptxas (or nvJitLink, which ignores setmaxnreg and so fails the policy: ptxas only);
those tests skip without it. Builds are cached for the session (one assembly per config), and the
verifier's on-disk cache is pointed at a session temporary directory. Nothing here runs a kernel:
there is no Blackwell GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from fa4gen import codegen
from fa4gen.assemble.assemble import AssembleError, FailureKind, assemble, find_disassembler, find_ptxas
from fa4gen.spec.config import KernelConfig
from fa4gen.spec.encodings import MmaType, TcgenInstrDesc
from fa4gen.spec.exp2 import emulated_mask
from fa4gen.ir import build_pipeline
from fa4gen.lower.sm100 import Sm100LoweringError, lower_sm100
from fa4gen.lower.walk import LoweringError, smem_layout
from fa4gen.verify.verify import VerificationError
from fa4gen.evidence.reference import fa4_forward, round_to_dtype
from fa4gen.evidence.simulate import simulate

MATRIX = list(codegen.DEFAULT_MATRIX)
ROOT = Path(__file__).resolve().parent.parent

needs_ptxas = pytest.mark.skipif(find_ptxas() is None, reason="ptxas not found (sm_100a assembly needs "
                                                                "whole-program ptxas for setmaxnreg)")


@pytest.fixture(scope="module", autouse=True)
def _verify_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("FA4GEN_CACHE_DIR", str(tmp_path_factory.mktemp("fa4gen-cache")))
    yield
    mp.undo()


@functools.lru_cache(maxsize=None)
def built(cfg: KernelConfig, cubin: bool = True):
    return codegen.build(cfg, emit=("ptx", "cubin") if cubin else ("ptx",), backend="ptxas" if cubin else "auto")


# ---- assembly ---------------------------------------------------------------------------------------

@needs_ptxas
@pytest.mark.parametrize("cfg", MATRIX, ids=lambda c: c.name)
def test_default_matrix_assembles_clean(cfg):
    """ptxas -v for sm_100a: no warning, no spill, setmaxnreg honoured (assemble() enforces all three
    and would raise), and the entry's register count is the .maxnreg that setmaxnreg redistributes."""
    res = built(cfg)
    assert res.cubin and res.cubin[:4] == b"\x7fELF"
    (entry,) = res.resources
    assert entry.name == "fa4_fwd"
    assert entry.spills == 0 and entry.stack_frame == 0
    assert entry.registers == 65536 // 512
    asm = res.manifest["assembler"]
    assert asm["arch"] == "sm_100a" and asm["entries"][0]["spill_stores"] == 0
    assert res.report is not None and res.report.ok


@needs_ptxas
def test_ptxas_drops_setmaxnreg_without_maxnreg_and_the_policy_refuses():
    """Why the entry carries `.maxnreg`: without it ptxas cannot size the setmaxnreg regions."""
    ptx = built(KernelConfig(causal=True, gqa_ratio=4)).ptx
    assert ".maxnreg 128" in ptx
    with pytest.raises(AssembleError) as e:
        assemble(ptx.replace(".maxnreg 128\n", ""), "sm_100a", name="no_maxnreg", backend="ptxas")
    assert e.value.kind is FailureKind.SETMAXNREG_IGNORED


@needs_ptxas
def test_tight_budget_spills_are_refused():
    """The same PTX with the softmax warpgroups held to 136 registers (128 fp32 scores + temps do not
    fit) must fail the no-spill policy: the clean result above is the kernel's, not a lax policy's."""
    ptx = built(KernelConfig()).ptx.replace("setmaxnreg.inc.sync.aligned.u32 200;", "setmaxnreg.inc.sync.aligned.u32 136;")
    with pytest.raises(AssembleError) as e:
        assemble(ptx, "sm_100a", name="squeezed", backend="ptxas")
    assert e.value.kind is FailureKind.SPILL


# ---- manifest ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [KernelConfig(), KernelConfig(causal=True, gqa_ratio=4, head_dim=64)],
                         ids=lambda c: c.name)
def test_manifest_follows_the_abi(cfg):
    m = built(cfg, cubin=False).manifest
    pipe = build_pipeline(cfg)
    assert m["entry"] == "fa4_fwd" and m["arch"] == "sm_100a" and m["threads_per_cta"] == 512
    assert m["params"] == ["tmap_q", "tmap_k", "tmap_v", "tmap_o", "lse_ptr", "batch", "seqlen_q", "seqlen_k",
                           "num_heads_kv", "scale_log2", "num_m_blocks", "num_tasks", "l2_group"]
    g, sqt = cfg.gqa_ratio, cfg.seq_q_per_tile
    assert m["tensor_maps"]["q"] == {"dims": ["D", "G", "Hkv", "Sq", "B"], "box": [64, g, 1, sqt, 1],
                                     "swizzle": "128B", "dtype": cfg.dtype, "l2_promotion": "256B"}
    assert m["tensor_maps"]["o"] == m["tensor_maps"]["q"]
    for t in ("k", "v"):
        assert m["tensor_maps"][t] == {"dims": ["D", "Hkv", "Skv", "B"], "box": [64, 1, 128, 1], "swizzle": "128B",
                                       "dtype": cfg.dtype, "l2_promotion": "256B"}
    # the box is one 128-row tile of 64 columns: what one TMA copy moves (expect_tx counts D/64 of them)
    assert 64 * g * sqt * 2 * (cfg.head_dim // 64) == 128 * cfg.head_dim * 2
    assert m["grid"]["policy"] == ("one_per_task" if cfg.causal else "persistent")
    assert pipe.smem_bytes < m["dynamic_smem_bytes"] <= pipe.smem_limit
    assert m["tmem_alloc_cols"] == 512
    assert [r["region"] for r in m["tmem_map"]] == ["S0", "P0", "S1", "P1", "O0", "O1"]
    assert {r["role"]: r["setmaxnreg"] for r in m["roles"]} == {
        "softmax0": 200, "softmax1": 200, "correction": 64, "mma": 48, "load": 48, "store": 48, "idle": 48}
    assert m["registers_per_cta"] == 65536
    assert {b["name"] for b in m["barriers"]} == {b.name for b in pipe.barriers}
    assert m["verify"]["ok"] is True and m["verify"]["runs"] > 0
    json.dumps(m)  # serialisable as written to <name>.json


def test_noncausal_epilogue_is_chunked_and_the_simulator_agrees():
    """WG2 (64 registers) cannot hold a 128-column fp32 O row: the IR gives it a load/normalize/store
    epilogue per 32-column chunk. The CPU simulator runs it against the reference (Skv tail, Sq not
    a multiple of the tile, GQA, LSE)."""
    from fa4gen.ir.core import walk_ops, TmemLd, SmemSt
    cfg = KernelConfig(head_dim=64, gqa_ratio=2)
    pipe = build_pipeline(cfg)
    kinds = [type(op).__name__ for op in walk_ops(pipe.role("correction").program)
             if isinstance(op, (TmemLd, SmemSt)) and getattr(op, "region", "").startswith("O")]
    assert kinds[-4:] == ["TmemLd", "SmemSt", "TmemLd", "SmemSt"]  # chunk by chunk
    rng = np.random.default_rng(7)
    q = round_to_dtype(rng.standard_normal((1, 150, 2, 64)), "bf16")
    k = round_to_dtype(rng.standard_normal((1, 300, 1, 64)), "bf16")
    v = round_to_dtype(rng.standard_normal((1, 300, 1, 64)), "bf16")
    res = simulate(pipe, q, k, v, seed=3)
    assert res.findings == []
    o, lse = fa4_forward(q, k, v, cfg)
    np.testing.assert_allclose(res.o, o, rtol=0, atol=2e-2)
    np.testing.assert_allclose(res.lse, lse, rtol=1e-5, atol=1e-5)


# ---- --emit variants and failures -----------------------------------------------------------------

def test_emit_ptx_only_writes_manifest_and_ptx(tmp_path):
    cfg = KernelConfig(causal=True)
    res = codegen.build(cfg, out_dir=tmp_path, emit=("ptx",))
    assert res.cubin is None and res.resources == ()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{cfg.name}.json", f"{cfg.name}.ptx"]
    assert (tmp_path / f"{cfg.name}.ptx").read_text() == res.ptx
    m = json.loads((tmp_path / f"{cfg.name}.json").read_text())
    assert m["name"] == cfg.name and "assembler" not in m


@needs_ptxas
def test_emit_ir_ptx_cubin(tmp_path):
    cfg = KernelConfig(head_dim=64)
    res = codegen.build(cfg, out_dir=tmp_path, emit=("ir", "ptx", "cubin"))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(f"{cfg.name}{s}" for s in (".json", ".ptx", ".cubin", ".ir.json"))
    assert (tmp_path / f"{cfg.name}.cubin").read_bytes() == res.cubin
    ir = json.loads((tmp_path / f"{cfg.name}.ir.json").read_text())
    assert [r["name"] for r in ir["roles"]] == [r.name for r in build_pipeline(cfg).roles]


@needs_ptxas
@pytest.mark.skipif(find_disassembler() is None, reason="no SASS disassembler (nvdisasm/cuobjdump)")
def test_emit_sass(tmp_path):
    cfg = KernelConfig(head_dim=64, causal=True)
    codegen.build(cfg, out_dir=tmp_path, emit=("sass",))
    sass = (tmp_path / f"{cfg.name}.sass").read_text()
    assert "UTCHMMA" in sass or "UTCBAR" in sass or "HMMA" in sass or "UTC" in sass


def test_emit_rejects_unknown_artifacts():
    with pytest.raises(ValueError, match="emit"):
        codegen.build(KernelConfig(), emit=("ptx", "elf"))


def test_a_broken_pipeline_is_not_emitted(tmp_path, monkeypatch):
    """The chain verifies what it lowers: a corpus mutation raises VerificationError, writes nothing."""
    from fa4gen import ir as ir_pkg
    from fa4gen.verify.mutations import by_name

    real = ir_pkg.build_pipeline
    monkeypatch.setattr(ir_pkg, "build_pipeline", lambda cfg: by_name("missing_wait_st").apply(real(cfg)))
    with pytest.raises(VerificationError) as e:
        codegen.build(KernelConfig(), out_dir=tmp_path, emit=("ptx",))
    assert "HAZARD" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_lowering_refuses_what_it_cannot_emit():
    pipe = build_pipeline(KernelConfig())
    with pytest.raises(Sm100LoweringError):
        lower_sm100(pipe.__class__(**{**pipe.__dict__, "arch": "sm_90a"}))
    big = KernelConfig(kv_stages=4)
    with pytest.raises(LoweringError, match="SMEM"):  # the layout is the walker's, for both targets
        smem_layout(build_pipeline(big))
    with pytest.raises(Sm100LoweringError, match="SMEM"):
        lower_sm100(build_pipeline(big))


# ---- beyond the seed ------------------------------------------------------------------------------

def _sec(ptx: str, role: str) -> str:
    a, b = ptx.index(f"// role {role}\n"), ptx.index(f"// end role {role}\n")
    return ptx[a:b]


def test_head_dim_64_and_fp16_change_the_instruction_encodings():
    for cfg in (KernelConfig(head_dim=64, dtype="fp16"), KernelConfig()):
        ptx = built(cfg, cubin=False).ptx
        idescs = {TcgenInstrDesc.decode(int(x, 16)) for x in re.findall(r"tcgen05\.mma\S* [^;]*?, (0x[0-9a-f]+), ", ptx)}
        assert {d.n for d in idescs} == {128, cfg.head_dim}  # QK: N = 128 keys; PV: N = head_dim
        want = MmaType.F16 if cfg.dtype == "fp16" else MmaType.BF16
        assert {d.a_type for d in idescs} == {want}
        cvt = "cvt.rn.f16x2.f32" if cfg.dtype == "fp16" else "cvt.rn.bf16x2.f32"
        assert cvt in ptx and ("cvt.rn.bf16x2" in ptx) == (cfg.dtype == "bf16")
        qk = len(re.findall(r"tcgen05\.mma[^;]*%dak", _sec(ptx, "mma")))
        assert qk == 2 * 2 * (cfg.head_dim // 16)  # two Q tiles, prologue + loop, D/16 k steps each


def test_runtime_shapes_come_from_params_not_constants():
    """Skv tail mask, Sq (TMA clips), LSE on/off, SM count: read at run time."""
    for cfg in (KernelConfig(), KernelConfig(causal=True)):
        ptx = built(cfg, cubin=False).ptx
        sm = _sec(ptx, "softmax0")
        # the mask limit is derived from seqlen_k (and seqlen_q when causal) and applied to the
        # first block that is not fully visible: non-causal that is the Skv tail block
        assert re.search(r"shr\.(u|s)32 %nunm", sm)
        assert "%skv" in sm and ("%sq" in sm) == cfg.causal or "%sq" in sm
        assert re.search(r"setp\.ge\.s32 %p_mask, %nb, %nunm", sm)
        # LSE: only when lse_ptr != 0, only rows < Sq
        assert re.search(r"setp\.eq\.u64 %p_c, %lse, 0;\n\s*@%p_c bra", sm)
        assert re.search(r"setp\.lt\.u32 %p_v, %seq, %sq;", sm) and "@%p_v st.global.f32" in sm
        # persistent / one-per-task loop steps by the launched grid, never a baked SM count
        assert "mov.u32 %nctas, %nctaid.x;" in ptx and "add.u32 %task, %task, %nctas;" in ptx
        assert not re.search(r"\b148\b", ptx)


# ---- instruction profile --------------------------------------------------------------------------

def kv_body(ptx: str, role: str) -> str:
    sec = _sec(ptx, role)
    m = re.search(rf"(\$L_{role}_kv\d+):\n(.*?)\n\$L_{role}_kv_done\d+:", sec, re.S)
    return m.group(2)


def profile(ptx: str) -> dict:
    """Counts per K/V block of the steady state (the K/V loop bodies)."""
    mma, sm0, corr, load = (kv_body(ptx, r) for r in ("mma", "softmax0", "correction", "load"))
    exp_emu = re.search(r"@%p_mask bra (\$\S+);\n(.*?)\n\s*bra.uni", sm0, re.S)
    unmasked = exp_emu.group(2) if exp_emu else ""
    return {
        "mma: tcgen05.mma": mma.count("tcgen05.mma"),
        "mma: tcgen05.commit": mma.count("tcgen05.commit"),
        "mma: mbarrier waits": mma.count("mbarrier.try_wait"),
        "load: TMA loads": load.count("cp.async.bulk.tensor"),
        "load: mbarrier waits": load.count("mbarrier.try_wait"),
        "softmax (per WG): tcgen05.ld": sm0.count("tcgen05.ld."),
        "softmax (per WG): tcgen05.st": sm0.count("tcgen05.st."),
        "softmax (per WG): mbarrier waits": sm0.count("mbarrier.try_wait"),
        "softmax (per WG): mbarrier arrives": sm0.count("mbarrier.arrive"),
        "softmax (per WG): ex2.approx, unmasked block": unmasked.count("ex2.approx"),
        # the cubic runs two exponentials per f32x2 instruction (scalar add.rm.f32 would be one)
        "softmax (per WG): FMA-emulated exp2, unmasked block": 2 * unmasked.count("add.rm.f32x2")
        + len(re.findall(r"add\.rm\.f32 ", unmasked)),
        "softmax (per WG): ex2.approx, masked block": sm0.count("ex2.approx") - unmasked.count("ex2.approx") - 1,
        "correction: mbarrier arrives": corr.count("mbarrier.arrive"),
        "correction: bar.sync": corr.count("bar.sync"),
        "correction: tcgen05.ld+st when rescaling": corr.count("tcgen05.ld.") + corr.count("tcgen05.st."),
    }


@pytest.mark.parametrize("cfg", [KernelConfig(), KernelConfig(causal=True)], ids=lambda c: c.name)
def test_instruction_profile_per_kv_block(cfg):
    p = profile(built(cfg, cubin=False).ptx)
    d = cfg.head_dim
    assert p["mma: tcgen05.mma"] == 2 * (d // 16) + 2 * (128 // 16)
    assert p["mma: tcgen05.commit"] == 4  # s_ready x2, kv_empty for K and V
    assert p["load: TMA loads"] == 2 * (d // 64)
    assert p["softmax (per WG): tcgen05.ld"] == 4 and p["softmax (per WG): tcgen05.st"] == 4
    n_emu = sum(int(emulated_mask(cfg, f, False).sum()) for f in range(4))
    assert p["softmax (per WG): FMA-emulated exp2, unmasked block"] == n_emu
    assert p["softmax (per WG): ex2.approx, unmasked block"] == 128 - n_emu
    assert p["softmax (per WG): ex2.approx, masked block"] == 128
    assert p["correction: tcgen05.ld+st when rescaling"] == 2 * 2 * (d // 16)
    assert n_emu == (24 if cfg.causal else 16)  # seed: 18.75% causal, 12.5% non-causal


# ---- generated/ -----------------------------------------------------------------------------------

def _regen_module():
    spec = importlib.util.spec_from_file_location("regen_generated", ROOT / "scripts" / "regen_generated.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stable(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k not in codegen.UNSTABLE_MANIFEST_KEYS}


def test_generated_matches_a_fresh_regeneration(tmp_path):
    """`python scripts/regen_generated.py` output is checked in: regenerate and diff (PTX byte for
    byte; manifests except the source-fingerprint hash and the assembler section)."""
    files = _regen_module().regenerate(tmp_path, assemble=False, quiet=True)
    names = sorted(p.name for p in files)
    checked_in = sorted(p.name for p in (ROOT / "generated").iterdir() if p.suffix in (".ptx", ".json"))
    assert names == checked_in, "generated/ has missing or stale files: run python scripts/regen_generated.py"
    for p in files:
        old = (ROOT / "generated" / p.name).read_text()
        if p.suffix == ".ptx":
            assert p.read_text() == old, f"{p.name} changed: run python scripts/regen_generated.py"
        else:
            assert _stable(json.loads(p.read_text())) == _stable(json.loads(old)), \
                f"{p.name} changed: run python scripts/regen_generated.py"


@needs_ptxas
@pytest.mark.parametrize("cfg", codegen.GENERATED_MATRIX, ids=lambda c: c.name)
def test_generated_assembler_report_is_current(cfg):
    old = json.loads((ROOT / "generated" / f"{cfg.name}.json").read_text())
    assert old["assembler"]["entries"] == built(cfg).manifest["assembler"]["entries"]
    assert old["assembler"]["entries"][0]["spill_stores"] == 0


def test_verify_cache_reuses_only_passing_reports_of_the_same_pipeline(tmp_path, monkeypatch):
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(tmp_path))
    pipe = build_pipeline(KernelConfig(head_dim=64))
    rep1, hit1 = codegen.verify_cached(pipe)
    rep2, hit2 = codegen.verify_cached(pipe)
    assert rep1.ok and (hit1, hit2) == (False, True) and rep2 == rep1
    from fa4gen.verify.mutations import by_name

    broken = by_name("missing_wait_st").apply(pipe)
    rep3, hit3 = codegen.verify_cached(broken)
    assert not rep3.ok and not hit3  # a different pipeline never borrows the passing record
    assert len(list((tmp_path / "verify").iterdir())) == 1  # failing reports are not stored
    monkeypatch.setenv("FA4GEN_VERIFY_CACHE", "0")
    assert codegen.verify_cached(pipe)[1] is False
