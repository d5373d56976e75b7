"""The ptx -> cubin stage: both backends, the error contract, the policy, resource parsing."""

import shlex
import shutil
import subprocess

import pytest

from fa4gen.assemble import assemble as asm
from fa4gen.assemble.assemble import MIN_PTX_ISA_FOR_ARCH, AssembleError, AssemblePolicy, Backend, BackendUnavailableError, FailureKind, assemble, disassemble, parse_resources, ptx_isa_version_for, ptx_version_supported
from fa4gen.spec.plan import PTX_VERSION_FOR_ARCH

HAVE_PTXAS = asm.find_ptxas() is not None
HAVE_NVJITLINK = asm.nvjitlink_available()
BACKENDS = [
    pytest.param(Backend.PTXAS, marks=pytest.mark.skipif(not HAVE_PTXAS, reason="ptxas not found")),
    pytest.param(Backend.NVJITLINK, marks=pytest.mark.skipif(not HAVE_NVJITLINK, reason="nvJitLink not installed")),
]
ARCHS = ["sm_90a", "sm_100a"]


def _header(arch: str) -> str:
    return f".version {PTX_VERSION_FOR_ARCH[arch]}\n.target {arch}\n.address_size 64\n\n"


def smem_kernel(arch: str) -> str:
    """4096 B of static shared memory and one bar.sync: known resources."""
    return _header(arch) + """\
.visible .entry smem4k(.param .u64 p)
{
  .reg .b64 %rd<3>;
  .reg .b32 %r<3>;
  .shared .align 16 .b8 sbuf[4096];
  ld.param.u64 %rd1, [p];
  cvta.to.global.u64 %rd2, %rd1;
  mov.u32 %r1, %tid.x;
  st.shared.u32 [sbuf], %r1;
  bar.sync 0;
  ld.shared.u32 %r2, [sbuf+4092];
  st.global.u32 [%rd2], %r2;
  ret;
}
"""


def syntax_error_kernel(arch: str) -> str:
    return _header(arch) + """\
.visible .entry broken()
{
  .reg .b32 %r<2>;
  mov.u32 %r1, %tid.q;
  ret;
}
"""


def spill_kernel(arch: str, live: int = 64) -> str:
    """`live` volatile loads all alive at once under .maxnreg 24 (the floor ptxas accepts)."""
    loads = "\n".join(f"  ld.volatile.global.u32 %r{i}, [%rd2+{4 * i}];" for i in range(live))
    stores = "\n".join(f"  st.volatile.global.u32 [%rd2+{4 * (live + i)}], %r{live - 1 - i};" for i in range(live))
    return _header(arch) + f"""\
.visible .entry spills(.param .u64 p)
.maxnreg 24
{{
  .reg .b64 %rd<3>;
  .reg .b32 %r<{live}>;
  ld.param.u64 %rd1, [p];
  cvta.to.global.u64 %rd2, %rd1;
{loads}
{stores}
  ret;
}}
"""


def setmaxnreg_kernel(arch: str, maxnreg: int | None) -> str:
    """Two warpgroups re-balance registers, as the warp-specialised kernels do (384 threads)."""
    cap = f".maxnreg {maxnreg}\n" if maxnreg else ""
    return _header(arch) + f"""\
.visible .entry rebalance(.param .u64 p)
.maxntid 384, 1, 1
{cap}{{
  .reg .b32 %r<3>;
  .reg .b64 %rd<3>;
  .reg .pred %p<2>;
  ld.param.u64 %rd1, [p];
  cvta.to.global.u64 %rd2, %rd1;
  mov.u32 %r1, %tid.x;
  setp.lt.u32 %p1, %r1, 128;
  @%p1 bra PRODUCER;
  setmaxnreg.inc.sync.aligned.u32 232;
  st.global.u32 [%rd2], %r1;
  ret;
PRODUCER:
  setmaxnreg.dec.sync.aligned.u32 40;
  ret;
}}
"""


# ---- PTX version ----------------------------------------------------------------------------

def test_ptx_isa_table():
    """PTX ISA release notes: CUDA 13.0 (driver r580) reads up to 9.0, 12.9 up to 8.8."""
    assert ptx_isa_version_for("13.0") == "9.0"
    assert ptx_isa_version_for("13.0.88") == "9.0"
    assert ptx_isa_version_for("V13.0.88") == "9.0"
    assert ptx_isa_version_for((12, 9)) == "8.8"
    assert ptx_isa_version_for("12.6") == "8.5"
    with pytest.raises(ValueError, match="unknown"):
        ptx_isa_version_for("11.0")
    with pytest.raises(ValueError):
        ptx_isa_version_for("latest")


def test_ptx_version_fits_h200_driver_and_targets():
    """The H200 machines run driver 580 = CUDA 13.0; sm_100a needs >= 8.6, sm_90a >= 8.0."""
    assert set(PTX_VERSION_FOR_ARCH) == set(MIN_PTX_ISA_FOR_ARCH) == set(ARCHS)
    for arch, version in PTX_VERSION_FOR_ARCH.items():
        assert ptx_version_supported(version, "13.0"), arch
        assert ptx_version_supported(version, "12.9"), arch
        assert asm._version_tuple(version) >= asm._version_tuple(MIN_PTX_ISA_FOR_ARCH[arch]), arch


def test_lowerings_declare_the_table_version():
    """Both lowerings print their target's PTX_VERSION_FOR_ARCH entry, the one place it is said."""
    from fa4gen.spec.config import KernelConfig
    from fa4gen.render.kernels import build_sm90, build_sm100

    sm90, _ = build_sm90(KernelConfig(arch="sm_90a", head_dim=128, causal=True))
    sm100, _ = build_sm100(KernelConfig(arch="sm_100a", head_dim=128, causal=True))
    for arch, ptx in (("sm_90a", sm90), ("sm_100a", sm100)):
        assert f"\n.version {PTX_VERSION_FOR_ARCH[arch]}\n.target {arch}\n" in ptx, arch


@pytest.mark.skipif(not HAVE_PTXAS, reason="ptxas not found")
def test_local_ptxas_reads_ptx_version():
    version = asm.ptxas_version(asm.find_ptxas())
    assert version, "could not read ptxas --version"
    for arch, ptx_version in PTX_VERSION_FOR_ARCH.items():
        assert ptx_version_supported(ptx_version, version), arch


# ---- valid kernels --------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_assemble_valid_kernel(arch, backend, tmp_path):
    res = assemble(smem_kernel(arch), arch, name="smem4k", keep_dir=tmp_path, backend=backend)
    assert res.backend == backend and res.arch == arch
    assert res.cubin[:4] == b"\x7fELF"
    k = res.kernel("smem4k")
    # Static smem is what the PTX declares; nvJitLink's own summary would add sm_90's 1 KiB reserve.
    assert (k.smem_bytes, k.barriers, k.spills, k.stack_frame) == (4096, 1, 0, 0)
    assert 0 < k.registers <= 255
    assert res.wall_time_s > 0 and res.tool_version
    assert (tmp_path / "smem4k.ptx").read_text() == smem_kernel(arch)
    assert (tmp_path / "smem4k.cubin").read_bytes() == res.cubin
    assert "Compiling entry function 'smem4k'" in (tmp_path / "smem4k.log").read_text()
    with pytest.raises(KeyError, match="smem4k"):
        res.kernel("other")


def test_auto_prefers_ptxas(monkeypatch):
    if HAVE_PTXAS:
        assert asm.resolve_backend("auto") == Backend.PTXAS
    monkeypatch.setattr(asm, "find_ptxas", lambda: None)
    if HAVE_NVJITLINK:
        assert asm.resolve_backend("auto") == Backend.NVJITLINK
    monkeypatch.setattr(asm, "nvjitlink_available", lambda: False)
    with pytest.raises(BackendUnavailableError, match=r"pip install fa4gen\[cuda\]"):
        assemble(smem_kernel("sm_90a"), "sm_90a", name="x")
    with pytest.raises(BackendUnavailableError, match="nvidia-nvjitlink"):
        asm.resolve_backend("nvjitlink")
    with pytest.raises(BackendUnavailableError, match="CUDA_HOME"):
        asm.resolve_backend("ptxas")
    with pytest.raises(ValueError, match="one of auto"):
        asm.resolve_backend("nvcc")


def test_ptxas_found_through_env(monkeypatch, tmp_path):
    fake = tmp_path / "myptxas"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("FA4GEN_PTXAS", str(fake))
    assert asm.find_ptxas() == fake
    monkeypatch.setenv("FA4GEN_PTXAS", str(tmp_path / "missing"))
    with pytest.raises(BackendUnavailableError, match="does not exist"):  # no silent fallback
        asm.find_ptxas()


def test_bad_arguments():
    with pytest.raises(ValueError, match="arch"):
        assemble("", "hopper", name="x")
    with pytest.raises(ValueError, match="name"):
        assemble("", "sm_90a", name="../x")


# ---- failures carry log, kept PTX and a repro -----------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_syntax_error(backend, tmp_path):
    ptx = syntax_error_kernel("sm_90a")
    with pytest.raises(AssembleError) as ei:
        assemble(ptx, "sm_90a", name="broken", keep_dir=tmp_path, backend=backend)
    e = ei.value
    assert e.kind == FailureKind.ASSEMBLER and e.backend == backend
    assert "Unknown vector selector" in e.log and "error" in e.log
    assert e.ptx_path == tmp_path / "broken.ptx" and e.ptx_path.read_text() == ptx
    assert "-arch=sm_90a" in e.repro and str(e.ptx_path) in e.repro
    assert str(e.ptx_path) in str(e) and "Unknown vector selector" in str(e)
    assert not (tmp_path / "broken.cubin").exists()
    if HAVE_PTXAS:  # the repro command really reproduces the failure
        argv = shlex.split(e.repro)
        argv[0] = str(asm.find_ptxas())
        proc = subprocess.run(argv, capture_output=True, text=True)
        assert proc.returncode != 0 and "Unknown vector selector" in proc.stderr + proc.stdout


def test_failure_without_keep_dir_keeps_ptx_in_temp_dir():
    if not asm.available_backends():
        pytest.skip("no assembler")
    ptx = syntax_error_kernel("sm_100a")
    with pytest.raises(AssembleError) as ei:
        assemble(ptx, "sm_100a", name="broken")
    path = ei.value.ptx_path
    try:
        assert path.read_text() == ptx
        assert (path.parent / "broken.log").read_text() == ei.value.log
    finally:
        shutil.rmtree(path.parent)


@pytest.mark.parametrize("backend", BACKENDS)
def test_spill_is_an_error(backend, tmp_path):
    ptx = spill_kernel("sm_90a")
    with pytest.raises(AssembleError) as ei:
        assemble(ptx, "sm_90a", name="spills", keep_dir=tmp_path, backend=backend)
    e = ei.value
    assert e.kind == FailureKind.SPILL and "spilled" in str(e)
    (k,) = e.resources
    assert k.name == "spills" and k.spill_stores > 0 and k.spill_loads > 0 and k.registers <= 24
    assert not (tmp_path / "spills.cubin").exists(), "a refused cubin must not be left behind"
    # Spilling also makes ptxas warn (--warn-on-spills): with spills allowed, the warning still fails.
    with pytest.raises(AssembleError) as ei:
        assemble(ptx, "sm_90a", name="spills", keep_dir=tmp_path, backend=backend,
                 policy=AssemblePolicy(allow_spills=True))
    assert ei.value.kind == FailureKind.WARNING and "Registers are spilled" in str(ei.value)
    res = assemble(ptx, "sm_90a", name="spills", keep_dir=tmp_path, backend=backend,
                   policy=AssemblePolicy(allow_spills=True, warnings_are_errors=False))
    assert res.kernel("spills").spill_stores == k.spill_stores


@pytest.mark.parametrize("backend", BACKENDS)
def test_warning_is_an_error(backend, tmp_path):
    """ptxas raises a .maxnreg below its floor with a warning; zero-warnings policy refuses it."""
    ptx = smem_kernel("sm_90a").replace(".visible .entry smem4k(.param .u64 p)\n",
                                        ".visible .entry smem4k(.param .u64 p)\n.maxnreg 16\n")
    with pytest.raises(AssembleError) as ei:
        assemble(ptx, "sm_90a", name="smem4k", keep_dir=tmp_path, backend=backend)
    assert ei.value.kind == FailureKind.WARNING and "lower bound" in str(ei.value)


@pytest.mark.skipif(not HAVE_PTXAS, reason="ptxas not found")
@pytest.mark.parametrize("arch", ARCHS)
def test_setmaxnreg_without_register_cap_is_c7508(arch, tmp_path):
    with pytest.raises(AssembleError) as ei:
        assemble(setmaxnreg_kernel(arch, None), arch, name="rebalance", keep_dir=tmp_path, backend="ptxas")
    e = ei.value
    assert e.kind == FailureKind.SETMAXNREG_IGNORED and e.codes == ("C7508",)
    assert "C7508" in e.log and ".maxnreg" in str(e)
    # With the entry register count given, ptxas keeps setmaxnreg and the kernel assembles.
    res = assemble(setmaxnreg_kernel(arch, 168), arch, name="rebalance", keep_dir=tmp_path, backend="ptxas")
    assert res.kernel("rebalance").registers == 168
    assert "C75" not in res.log


@pytest.mark.skipif(not HAVE_NVJITLINK, reason="nvJitLink not installed")
def test_nvjitlink_drops_setmaxnreg_c7504(tmp_path):
    """nvJitLink compiles PTX as relocatable code, where ptxas ignores setmaxnreg (C7504)."""
    with pytest.raises(AssembleError) as ei:
        assemble(setmaxnreg_kernel("sm_90a", 168), "sm_90a", name="rebalance", keep_dir=tmp_path,
                 backend="nvjitlink")
    e = ei.value
    assert e.kind == FailureKind.SETMAXNREG_IGNORED and e.codes == ("C7504",)
    assert "backend='ptxas'" in str(e)
    assert " -c " in e.repro  # the repro compiles relocatable code, as nvJitLink does
    if HAVE_PTXAS:
        argv = shlex.split(e.repro)
        argv[0] = str(asm.find_ptxas())
        proc = subprocess.run(argv, capture_output=True, text=True)
        assert "C7504" in proc.stdout + proc.stderr


# ---- parsing --------------------------------------------------------------------------------

PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'fa4_fwd' for 'sm_100a'
ptxas info    : Function properties for fa4_fwd
    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 3 barriers, 1024 bytes smem, 920 bytes cmem[0]
ptxas info    : Compile time = 812.020 ms
ptxas info    : Compiling entry function 'tiny' for 'sm_100a'
ptxas info    : Function properties for tiny
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 6 registers, 360 bytes cmem[0]
"""

NVJITLINK_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 1 barriers, 4096 bytes smem
info    : 0 bytes gmem
info    : Function properties for 'k':
info    : used 8 registers, used 1 barriers, 0 stack, 5120 bytes smem, 536 bytes cmem[0], 0 bytes lmem
"""


def test_parse_resources_ptxas_log():
    fa4, tiny = parse_resources(PTXAS_LOG)
    assert fa4 == asm.KernelResources("fa4_fwd", registers=168, spill_stores=8, spill_loads=12,
                                      stack_frame=16, smem_bytes=1024, barriers=3)
    assert tiny == asm.KernelResources("tiny", registers=6)


def test_parse_resources_nvjitlink_log_uses_ptxas_lines():
    (k,) = parse_resources(NVJITLINK_LOG)
    assert (k.name, k.registers, k.smem_bytes, k.barriers) == ("k", 8, 4096, 1)


def test_policy_on_canned_logs():
    res = parse_resources(PTXAS_LOG)
    kind, msg, _ = asm._policy_violation(PTXAS_LOG, res, asm.STRICT)
    assert kind == FailureKind.SPILL and "fa4_fwd: 8 B stores / 12 B loads" in msg
    perf = "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized\n"
    kind, msg, codes = asm._policy_violation(perf, (), asm.STRICT)
    assert kind == FailureKind.PERF_LOSS and codes == ("C7515",) and "serialized" in msg
    assert asm._policy_violation(perf, (), AssemblePolicy(allowed_codes=("C7515",))) is None
    assert asm._policy_violation(perf, (), AssemblePolicy(perf_loss_is_error=False)) is None
    assert asm._policy_violation(NVJITLINK_LOG, parse_resources(NVJITLINK_LOG), asm.STRICT) is None


# ---- disassembly ----------------------------------------------------------------------------

def test_disassemble(tmp_path):
    if not asm.available_backends():
        pytest.skip("no assembler")
    if asm.find_disassembler() is None:
        pytest.skip("no nvdisasm / cuobjdump / nvidia-cuda-nvdisasm")
    res = assemble(smem_kernel("sm_90a"), "sm_90a", name="smem4k", keep_dir=tmp_path)
    sass = disassemble(res.cubin)
    assert "smem4k" in sass and "EXIT" in sass and "BAR.SYNC" in sass


def test_disassemble_without_tools(monkeypatch):
    monkeypatch.setattr(asm, "find_disassembler", lambda: None)
    with pytest.raises(BackendUnavailableError, match="nvidia-cuda-nvdisasm"):
        disassemble(b"\x7fELF")


def test_ptxas_from_the_nvcc_wheel_when_no_toolkit(monkeypatch):
    """Without a CUDA toolkit on the machine, the ptxas of the nvidia-cuda-nvcc wheel (the `cuda`
    extra) is found, so warp-specialised kernels (which need ptxas: nvJitLink drops setmaxnreg)
    still build after a plain pip install."""
    import fa4gen.assemble.assemble as A
    monkeypatch.delenv("FA4GEN_PTXAS", raising=False)
    monkeypatch.setattr(A, "_candidate_dirs", lambda: [])
    wheel = A._wheel_tool("ptxas")
    if wheel is None:
        pytest.skip("nvidia-cuda-nvcc wheel not installed")
    assert A.find_ptxas() == wheel
    assert A.ptxas_version(wheel).startswith("13.0")


# ---- GQA ratios that do not divide 128: the real kernels assemble without spills -------------------

@pytest.mark.skipif(not HAVE_PTXAS, reason="ptxas not found")
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", [3, 6])
@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
def test_unpacked_gqa_kernels_assemble_without_spills(arch, g, d, causal):
    from fa4gen import codegen
    from fa4gen.spec.config import KernelConfig

    cfg = KernelConfig(arch=arch, gqa_ratio=g, head_dim=d, causal=causal)
    res = codegen.build(cfg, emit=("ptx",), verify=False)
    out = assemble(res.ptx, arch, name=cfg.name, backend=Backend.PTXAS)  # default policy: spills are errors
    k = out.kernel("fa4_fwd")
    assert (k.spill_stores, k.spill_loads, k.stack_frame) == (0, 0, 0)
