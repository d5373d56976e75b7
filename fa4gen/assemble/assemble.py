"""The `ptx -> cubin` stage: assemble with ptxas or nvJitLink, report resources, enforce policy.

`assemble(ptx, arch, name=...)` returns an AssembleResult (cubin bytes, the assembler log, the
backend used, per-kernel resources, wall time) or raises AssembleError carrying the log, the path
of the kept .ptx and a command line that reproduces the failure.

Policy (why a log line can fail a build that produced a cubin):
- zero warnings: a warning from ptxas is a defect in generated code, never noise;
- zero spills: a spill in an attention kernel's inner loop costs more than any tuning gains;
- setmaxnreg must not be ignored (C7508, C7504): the warp-specialised kernels depend on moving
  registers from the producer warps to the softmax warpgroups; if ptxas drops setmaxnreg the
  kernel still runs, but with the entry register count everywhere, so this is made an error;
- other "Potential Performance Loss" notes (e.g. wgmma serialisation) fail too, unless allowed.

Backends: `ptxas` compiles the whole program (setmaxnreg honoured). `nvjitlink` (cuda-python,
no toolkit needed) always compiles PTX as a relocatable unit (`ptxas -c`), and then ptxas ignores
setmaxnreg with C7504: a kernel that uses setmaxnreg fails the policy under nvjitlink. "auto"
prefers ptxas for that reason. (Seen on the H200 machine, driver 580.159.04: its ptxas 13.0.88 lies
in /usr/local/cuda/bin, off PATH, which find_ptxas searches; the driver's own JIT of PTX text
compiles whole-program too: it kept setmaxnreg under `.maxnreg 168` and reported C7508 without it.)
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from ..spec.plan import ARCH_LIMITS

# PTX ISA release history (PTX ISA 9.x "Release Notes" table): CUDA toolkit/driver -> newest PTX ISA
# it reads. A driver's JIT and a toolkit's ptxas reject any newer `.version`.
PTX_ISA_FOR_CUDA: dict[tuple[int, int], str] = {
    (12, 0): "8.0", (12, 1): "8.1", (12, 2): "8.2", (12, 3): "8.3", (12, 4): "8.4",
    (12, 5): "8.5", (12, 6): "8.5", (12, 7): "8.6", (12, 8): "8.7", (12, 9): "8.8",
    (13, 0): "9.0", (13, 1): "9.1", (13, 2): "9.2",
}
# Oldest `.version` that has each target (same table, column "supported targets").
MIN_PTX_ISA_FOR_ARCH: dict[str, str] = {"sm_90a": "8.0", "sm_100a": "8.6"}

_ARCH_RE = re.compile(r"^sm_\d{2,3}[af]?$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


def _version_tuple(v: str) -> tuple[int, int]:
    major, minor = v.split(".")[:2]
    return int(major), int(minor)


def ptx_isa_version_for(toolkit) -> str:
    """Newest PTX ISA version a CUDA toolkit (or a driver of that CUDA version) accepts.

    `toolkit`: "13.0", "13.0.88", "V13.0.88", "release 13.0" or a (major, minor) tuple.
    """
    if isinstance(toolkit, tuple):
        key = tuple(int(x) for x in toolkit[:2])
    else:
        m = re.search(r"(\d+)\.(\d+)", str(toolkit))
        if not m:
            raise ValueError(f"toolkit version {toolkit!r}: expected something like '13.0'")
        key = (int(m.group(1)), int(m.group(2)))
    if key not in PTX_ISA_FOR_CUDA:
        known = ", ".join(f"{a}.{b}" for a, b in PTX_ISA_FOR_CUDA)
        raise ValueError(f"CUDA {key[0]}.{key[1]}: PTX ISA unknown to fa4gen (table covers {known})")
    return PTX_ISA_FOR_CUDA[key]


def ptx_version_supported(ptx_version: str, toolkit) -> bool:
    return _version_tuple(ptx_version) <= _version_tuple(ptx_isa_version_for(toolkit))


# ---------------------------------------------------------------------------------------------
# Results and errors
# ---------------------------------------------------------------------------------------------

class Backend(Enum):
    AUTO = "auto"
    PTXAS = "ptxas"
    NVJITLINK = "nvjitlink"


class FailureKind(Enum):
    ASSEMBLER = "assembler"  # the assembler rejected the PTX (syntax, types, unsupported ISA)
    TIMEOUT = "timeout"
    WARNING = "warning"  # zero-warnings policy
    SPILL = "spill"  # zero-spills policy
    SETMAXNREG_IGNORED = "setmaxnreg_ignored"  # C7508 / C7504
    PERF_LOSS = "perf_loss"  # other "Potential Performance Loss" notes


@dataclass(frozen=True)
class KernelResources:
    """What ptxas -v reports for one entry (bytes unless said otherwise).

    smem_bytes is the static shared memory of the entry only: dynamic shared memory is a launch
    parameter (the manifest's dynamic_smem_bytes), not part of the cubin.
    """

    name: str
    registers: int
    spill_stores: int = 0
    spill_loads: int = 0
    stack_frame: int = 0
    smem_bytes: int = 0
    barriers: int = 0

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclass(frozen=True)
class AssembleResult:
    cubin: bytes
    log: str
    backend: Backend
    arch: str
    resources: tuple[KernelResources, ...]
    wall_time_s: float
    tool_version: str = ""
    kept: tuple[Path, ...] = ()  # files written to keep_dir

    def kernel(self, name: str) -> KernelResources:
        for r in self.resources:
            if r.name == name:
                return r
        raise KeyError(f"no entry {name!r} in the assembler report (entries: "
                       f"{', '.join(r.name for r in self.resources) or 'none'})")


class AssembleError(RuntimeError):
    """The assembler failed or its report broke the policy.

    Attributes: kind (FailureKind), log (assembler output), ptx_path (the kept .ptx), repro (a shell
    command reproducing the assembler run), backend, codes (ptxas message codes involved),
    resources (when a cubin was produced but refused).
    """

    def __init__(self, message: str, *, kind: FailureKind, log: str, ptx_path: Path, repro: str,
                 backend: Backend, codes: tuple[str, ...] = (), resources: tuple[KernelResources, ...] = ()):
        self.kind = kind
        self.log = log
        self.ptx_path = Path(ptx_path)
        self.repro = repro
        self.backend = backend
        self.codes = codes
        self.resources = resources
        log_tail = "\n".join(log.strip().splitlines()[-40:])
        super().__init__(f"{message}\n  kept PTX: {ptx_path}\n  reproduce: {repro}\n"
                         f"--- {backend.value} log ---\n{log_tail}")


class BackendUnavailableError(RuntimeError):
    """No assembler (or disassembler) was found; the message says what to install."""


@dataclass(frozen=True)
class AssemblePolicy:
    warnings_are_errors: bool = True
    allow_spills: bool = False
    perf_loss_is_error: bool = True
    allowed_codes: tuple[str, ...] = ()  # e.g. ("C7515",) to tolerate one kind of note


STRICT = AssemblePolicy()


# ---------------------------------------------------------------------------------------------
# Finding tools
# ---------------------------------------------------------------------------------------------

def _candidate_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]) / "bin")
    dirs += [Path("/usr/local/cuda/bin"), Path("/usr/local/bin")]
    return dirs


def _find_tool(name: str, env_var: str | None = None) -> Path | None:
    if env_var and os.environ.get(env_var):
        p = Path(os.environ[env_var])
        return p if p.is_file() and os.access(p, os.X_OK) else None
    for d in _candidate_dirs():
        p = d / name
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


def find_ptxas() -> Path | None:
    """$FA4GEN_PTXAS, else PATH, $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin, /usr/local/bin,
    else the ptxas of the nvidia-cuda-nvcc wheel (so `pip install fa4gen[cuda]` needs no toolkit).

    An explicit $FA4GEN_PTXAS is obeyed or refused: when it names no executable file this raises
    BackendUnavailableError naming it, rather than quietly assembling with something else."""
    explicit = os.environ.get("FA4GEN_PTXAS")
    if explicit:
        p = Path(explicit).expanduser()
        if not p.exists():
            why = "does not exist"
        elif not p.is_file():
            why = "is not a file"
        elif not os.access(p, os.X_OK):
            why = "is not executable"
        else:
            return p
        raise BackendUnavailableError(f"FA4GEN_PTXAS={explicit} {why}: point it at a ptxas binary or unset it "
                                      "to search PATH, CUDA_HOME and the nvidia-cuda-nvcc wheel")
    return _find_tool("ptxas") or _wheel_tool("ptxas")


PTXAS_TIMEOUT_ENV = "FA4GEN_PTXAS_TIMEOUT"
PTXAS_TIMEOUT_DEFAULT_S = 120.0  # the largest kernel assembles in about a second here


def ptxas_timeout_s() -> float:
    """Seconds one ptxas run may take: $FA4GEN_PTXAS_TIMEOUT, else 120."""
    from .fsutil import env_seconds

    return env_seconds(PTXAS_TIMEOUT_ENV, PTXAS_TIMEOUT_DEFAULT_S)


@functools.lru_cache(maxsize=8)
def ptxas_version(ptxas: Path) -> str:
    """'13.0.88' from `ptxas --version` ('' if it cannot be read)."""
    try:
        out = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    m = re.search(r"V(\d+\.\d+\.\d+)", out) or re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else ""


def _nvjitlink():
    """The cuda.bindings.nvjitlink module if it imports and its library loads, else None."""
    try:
        from cuda.bindings import nvjitlink
        nvjitlink.version()  # loads libnvJitLink: fails here when the wheel is missing
        return nvjitlink
    except Exception:
        return None


def nvjitlink_available() -> bool:
    return _nvjitlink() is not None


def available_backends() -> tuple[Backend, ...]:
    out = []
    if find_ptxas() is not None:
        out.append(Backend.PTXAS)
    if nvjitlink_available():
        out.append(Backend.NVJITLINK)
    return tuple(out)


_INSTALL_HINT = ("install the CUDA toolkit (ptxas on PATH, or set CUDA_HOME or FA4GEN_PTXAS), or "
                 "`pip install fa4gen[cuda]` (cuda-bindings + nvidia-nvjitlink) for the nvjitlink backend")


def resolve_backend(backend: Backend | str) -> Backend:
    try:
        backend = Backend(backend)
    except ValueError:
        raise ValueError(f"backend={backend!r}: one of auto, ptxas, nvjitlink") from None
    if backend == Backend.AUTO:
        if find_ptxas() is not None:
            return Backend.PTXAS
        if nvjitlink_available():
            return Backend.NVJITLINK
        raise BackendUnavailableError(f"no PTX assembler found: {_INSTALL_HINT}")
    if backend == Backend.PTXAS and find_ptxas() is None:
        raise BackendUnavailableError("backend 'ptxas' requested but no ptxas found: install the CUDA "
                                      "toolkit, put ptxas on PATH or set CUDA_HOME / FA4GEN_PTXAS")
    if backend == Backend.NVJITLINK and not nvjitlink_available():
        raise BackendUnavailableError("backend 'nvjitlink' requested but cuda.bindings.nvjitlink is not "
                                      "usable: `pip install fa4gen[cuda]` (cuda-bindings + nvidia-nvjitlink)")
    return backend


def toolchain_id(backend: Backend | str = "auto") -> str:
    """Who would assemble now, and which version: 'ptxas <resolved path> <version>' or
    'nvJitLink <major.minor>'; 'none' when no assembler is usable. Part of the cubin cache key, so a
    cubin from another assembler (or another ptxas release) is never served as this one's."""
    try:
        chosen = resolve_backend(backend)
    except (BackendUnavailableError, ValueError):
        return "none"
    if chosen == Backend.PTXAS:
        p = find_ptxas()
        return f"ptxas {p.resolve()} {ptxas_version(p) or 'unknown-version'}"
    return "nvJitLink %d.%d" % tuple(_nvjitlink().version())


# ---------------------------------------------------------------------------------------------
# Log parsing
# ---------------------------------------------------------------------------------------------

_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_PROPS_RE = re.compile(r"Function properties for '?([^'\s:]+)'?")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"ptxas info\s*:\s*Used (\d+) registers(.*)")
_SMEM_RE = re.compile(r"(\d+) bytes smem")
_BAR_RE = re.compile(r"used (\d+) barriers")
_WARNING_RE = re.compile(r"\bwarning\s*:", re.IGNORECASE)
_PERF_RE = re.compile(r"\((C\d{4})\)\s*Potential Performance Loss:\s*(.*)")
SETMAXNREG_CODES = ("C7508", "C7504")


def parse_resources(log: str) -> tuple[KernelResources, ...]:
    """Per-entry resources from the `ptxas -v` lines (also present in nvJitLink's info log)."""
    found: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        m = _ENTRY_RE.search(line)
        if m:
            current = m.group(1)
            found.setdefault(current, {})
            continue
        if line.lstrip().startswith("info"):
            continue  # nvJitLink's own summary repeats the ptxas lines (its smem adds sm_90's 1 KiB reserve)
        m = _PROPS_RE.search(line)
        if m:
            current = m.group(1)
            found.setdefault(current, {})
            continue
        if current is None:
            continue
        m = _FRAME_RE.search(line)
        if m:
            found[current].update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)),
                                  spill_loads=int(m.group(3)))
            continue
        m = _USED_RE.search(line)
        if m:
            rest = m.group(2)
            d = found[current]
            d["registers"] = int(m.group(1))
            sm, bar = _SMEM_RE.search(rest), _BAR_RE.search(rest)
            d["smem_bytes"] = int(sm.group(1)) if sm else 0
            d["barriers"] = int(bar.group(1)) if bar else 0
    return tuple(KernelResources(name=n, **{"registers": 0, **d}) for n, d in found.items())


def _perf_notes(log: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2).strip()) for m in map(_PERF_RE.search, log.splitlines()) if m]


def _warnings(log: str) -> list[str]:
    return [line.strip() for line in log.splitlines() if _WARNING_RE.search(line)]


_SETMAXNREG_WHY = {
    "C7508": ("ptxas ignored setmaxnreg (C7508: unable to determine register count at entry). "
              "setmaxnreg only moves registers between warpgroups when ptxas knows the per-thread "
              "register count the kernel starts with; give the entry `.maxnreg N` (N x threads per "
              f"CTA <= {ARCH_LIMITS['sm_90a'].regs_per_sm}: e.g. 168 for 384 threads) -- `.maxntid` alone is not enough. Without "
              "it every warp keeps the entry count and the producer/consumer split is lost."),
    "C7504": ("ptxas ignored setmaxnreg (C7504: to maintain compatibility across compilation units). "
              "The PTX was compiled as relocatable code (`ptxas -c`), which is how nvJitLink always "
              "compiles PTX; setmaxnreg needs whole-program compilation. Assemble with the ptxas "
              "backend (backend='ptxas'), which compiles the whole program."),
}


def _policy_violation(log: str, resources, policy: AssemblePolicy):
    """(kind, message, codes) of the first policy breach, most specific first; None if clean."""
    allowed = set(policy.allowed_codes)
    notes = [(c, t) for c, t in _perf_notes(log) if c not in allowed]
    for code, text in notes:
        if code in SETMAXNREG_CODES:
            return FailureKind.SETMAXNREG_IGNORED, _SETMAXNREG_WHY[code], (code,)
    if not policy.allow_spills:
        spilled = [r for r in resources if r.spills]
        if spilled:
            detail = ", ".join(f"{r.name}: {r.spill_stores} B stores / {r.spill_loads} B loads "
                               f"({r.registers} registers)" for r in spilled)
            return (FailureKind.SPILL, f"registers spilled to local memory ({detail}); reduce live "
                    "values or raise the register budget (.maxnreg / setmaxnreg) of that role", ())
    if policy.perf_loss_is_error and notes:
        codes = tuple(c for c, _ in notes)
        text = "; ".join(f"{c}: {t}" for c, t in notes)
        return FailureKind.PERF_LOSS, f"ptxas reports a potential performance loss ({text})", codes
    if policy.warnings_are_errors:
        warns = _warnings(log)
        if warns:
            return FailureKind.WARNING, "assembler warnings (zero-warnings policy): " + " | ".join(warns), ()
    return None


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------

def _ptxas_cmd(ptxas: str, arch: str, ptx_path: Path, out: str, *, relocatable: bool,
               extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [ptxas, f"-arch={arch}", "-v", "--warn-on-spills"]
    if relocatable:
        cmd.append("-c")
    return [*cmd, *extra, str(ptx_path), "-o", out]


def _run_ptxas(ptx_path: Path, cubin_path: Path, arch: str, extra: tuple[str, ...], timeout_s: float):
    ptxas = find_ptxas()
    cmd = _ptxas_cmd(str(ptxas), arch, ptx_path, str(cubin_path), relocatable=False, extra=extra)
    # its own session, so a timeout kills ptxas and anything it started (a wrapper script's child
    # would otherwise keep the pipes open and the wait going)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        import signal

        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        out, err = proc.communicate()
        return None, (out or "") + (err or "") + f"\n{ptxas} timed out after {timeout_s:g} s", True
    log = out + err
    if proc.returncode != 0 or not cubin_path.exists():
        return None, log, False
    return cubin_path.read_bytes(), log, False


def _run_nvjitlink(ptx: str, arch: str, name: str, extra: tuple[str, ...]):
    nj = _nvjitlink()
    options = [f"-arch={arch}", "-verbose", "-Xptxas=--warn-on-spills", *extra]
    handle = nj.create(len(options), options)

    def read_log(size_fn, get_fn) -> str:
        n = size_fn(handle)
        if not n:
            return ""
        buf = bytearray(n)
        get_fn(handle, buf)
        return bytes(buf).rstrip(b"\0").decode(errors="replace")

    try:
        data = ptx.encode()
        ok = True
        try:
            nj.add_data(handle, nj.InputType.PTX, data, len(data), f"{name}.ptx")
            nj.complete(handle)
        except nj.nvJitLinkError as e:
            ok = False
            failure = str(e)
        log = read_log(nj.get_info_log_size, nj.get_info_log)
        err = read_log(nj.get_error_log_size, nj.get_error_log)
        log = "\n".join(s for s in (log, err) if s)
        if not ok:
            return None, (log + f"\nnvJitLink: {failure}").strip()
        size = nj.get_linked_cubin_size(handle)
        buf = bytearray(size)
        nj.get_linked_cubin(handle, buf)
        return bytes(buf), log
    finally:
        nj.destroy(handle)


def assemble(ptx: str, arch: str, *, name: str, keep_dir: Path | str | None = None,
             backend: Backend | str = "auto", policy: AssemblePolicy = STRICT,
             extra_options: tuple[str, ...] = (), timeout_s: float | None = None) -> AssembleResult:
    """Assemble `ptx` for `arch` (e.g. sm_90a, sm_100a) into a cubin.

    keep_dir: when given, `<name>.ptx`, `<name>.log` and (on success) `<name>.cubin` are written
    there. On failure the .ptx is always kept (in keep_dir, else in a fresh temporary directory
    that is not removed) so the error's repro command works.
    extra_options: passed to ptxas (ptxas backend) or to nvJitLink (e.g. "-Xptxas=-O3").
    timeout_s: seconds ptxas may run (default $FA4GEN_PTXAS_TIMEOUT, else 120).
    """
    if not _ARCH_RE.match(arch or ""):
        raise ValueError(f"arch={arch!r}: expected e.g. 'sm_90a' or 'sm_100a'")
    if not _NAME_RE.match(name or ""):
        raise ValueError(f"name={name!r}: letters, digits, '_', '.', '-' only (it names files)")
    chosen = resolve_backend(backend)
    extra = tuple(extra_options)
    if timeout_s is None:
        timeout_s = ptxas_timeout_s()

    keep = Path(keep_dir) if keep_dir is not None else None
    tmp = None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        work = keep
    else:
        tmp = tempfile.TemporaryDirectory(prefix=f"fa4gen-{name}-")
        work = Path(tmp.name)
    ptx_path = work / f"{name}.ptx"
    ptx_path.write_text(ptx)
    cubin_path = work / f"{name}.cubin"

    tool_version = ""
    t0 = time.perf_counter()
    timed_out = False
    if chosen == Backend.PTXAS:
        tool_version = ptxas_version(find_ptxas())
        cubin, log, timed_out = _run_ptxas(ptx_path, cubin_path, arch, extra, timeout_s)
    else:
        tool_version = "nvJitLink %d.%d" % tuple(_nvjitlink().version())
        cubin, log = _run_nvjitlink(ptx, arch, name, extra)
    wall = time.perf_counter() - t0

    try:
        if keep is not None:
            (keep / f"{name}.log").write_text(log)

        def fail(kind: FailureKind, message: str, codes=(), resources=()):
            kept_ptx = ptx_path
            if keep is None:  # the temporary directory goes away: keep a copy for the repro
                kept_dir = Path(tempfile.mkdtemp(prefix=f"fa4gen-failed-{name}-"))
                kept_ptx = kept_dir / f"{name}.ptx"
                kept_ptx.write_text(ptx)
                (kept_dir / f"{name}.log").write_text(log)
            if keep is not None and cubin_path.exists():
                cubin_path.unlink()  # a refused (or partial) cubin must not be picked up later
            cmd = _ptxas_cmd("ptxas", arch, kept_ptx, "/dev/null",
                             relocatable=(chosen == Backend.NVJITLINK),
                             extra=extra if chosen == Backend.PTXAS else ())
            raise AssembleError(message, kind=kind, log=log, ptx_path=kept_ptx,
                                repro=shlex.join(cmd), backend=chosen, codes=codes, resources=resources)

        if cubin is None:
            if timed_out:
                fail(FailureKind.TIMEOUT, f"{find_ptxas()} (ptxas) did not finish assembling {name} ({arch}) "
                                          f"within {timeout_s:g} s and was killed; raise {PTXAS_TIMEOUT_ENV} "
                                          "if it is merely slow")
            fail(FailureKind.ASSEMBLER, f"{chosen.value} rejected {name} ({arch})")
        resources = parse_resources(log)
        violation = _policy_violation(log, resources, policy)
        if violation is not None:
            kind, message, codes = violation
            fail(kind, f"{name} ({arch}): {message}", codes, resources)
        kept: tuple[Path, ...] = ()
        if keep is not None:
            cubin_path.write_bytes(cubin)
            kept = (ptx_path, cubin_path, keep / f"{name}.log")
        return AssembleResult(cubin=cubin, log=log, backend=chosen, arch=arch, resources=resources,
                              wall_time_s=wall, tool_version=tool_version, kept=kept)
    finally:
        if tmp is not None:
            tmp.cleanup()


# ---------------------------------------------------------------------------------------------
# Disassembly
# ---------------------------------------------------------------------------------------------

def _wheel_tool(name: str) -> Path | None:
    """A CUDA tool shipped in one of NVIDIA's pip wheels (nvidia/cu13/bin/<name>): ptxas comes with
    nvidia-cuda-nvcc, nvdisasm with nvidia-cuda-nvdisasm (both in the `cuda` extra)."""
    try:
        import nvidia  # namespace package of NVIDIA's wheels
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for p in sorted(Path(root).glob(f"*/bin/{name}")):
            if p.is_file():
                if not os.access(p, os.X_OK):
                    try:
                        p.chmod(p.stat().st_mode | 0o111)
                    except OSError:
                        continue
                return p
    return None


def _wheel_nvdisasm() -> Path | None:
    return _wheel_tool("nvdisasm")


def find_disassembler() -> tuple[str, list[str]] | None:
    """(kind, argv prefix) of the first usable SASS disassembler, else None."""
    p = _find_tool("nvdisasm")
    if p:
        return "nvdisasm", [str(p), "-c"]
    p = _find_tool("cuobjdump")
    if p:
        return "cuobjdump", [str(p), "-sass"]
    p = _wheel_nvdisasm()
    if p:
        return "nvdisasm", [str(p), "-c"]
    return None


def disassemble(cubin: bytes, *, timeout_s: float = 300.0) -> str:
    """SASS text of a cubin via nvdisasm, cuobjdump -sass, or the nvidia-cuda-nvdisasm wheel."""
    tool = find_disassembler()
    if tool is None:
        raise BackendUnavailableError("no SASS disassembler found: install the CUDA toolkit (nvdisasm or "
                                      "cuobjdump on PATH) or `pip install nvidia-cuda-nvdisasm`")
    kind, argv = tool
    with tempfile.TemporaryDirectory(prefix="fa4gen-sass-") as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([*argv, str(path)], capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout[-2000:]}")
    return proc.stdout


if __name__ == "__main__":  # python -m fa4gen.assemble.assemble file.ptx sm_90a
    if len(sys.argv) != 3:
        sys.exit("usage: python -m fa4gen.assemble.assemble FILE.ptx ARCH")
    src = Path(sys.argv[1])
    res = assemble(src.read_text(), sys.argv[2], name=src.stem)
    for r in res.resources:
        print(r)
