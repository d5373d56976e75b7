"""The on-disk cubin cache and the in-process table of loaded kernels.

An entry is two files in the cache directory, named by the config's readable name, its
`content_hash` (which covers every config field and GENERATOR_VERSION, so a generator change misses)
and a short hash of the assembler's identity and version (`assemble.toolchain_id()`: another ptxas
or nvJitLink release gets its own entries):

    <name>-<hash>-<toolchain>.cubin   the assembled kernel
    <name>-<hash>-<toolchain>.json    its manifest (docs/ABI.md) plus `cubin_sha256`, `cubin_size`
                                      and `toolchain`

The manifest is the entry's commit record: it is written after the cubin and names the cubin's
sha256, so an entry is trusted only when the manifest parses, its content_hash (and config, when
present) and toolchain equal ours, the cubin on disk has exactly that size and hash, and its ELF
header is a CUDA cubin for the config's SM (fa4gen/assemble/cubin.py). Anything else (a truncated copy, a
flipped byte, a manifest from another config, a cubin with no manifest, bytes that are not a cubin
for this arch) is reported and rebuilt, never loaded.

Each file is written to a temporary file in the same directory (`.<file>.<pid>.<random>.tmp`) and
renamed over the old one with os.replace, which is atomic on POSIX file systems; temporaries whose
writer died (kill -9) or that are older than ten minutes are removed at the next store. Writers of
one entry take an exclusive flock on `<stem>.lock` and readers a shared one, so a reader never pairs
one writer's cubin with another's manifest. Processes that miss at once serialise on
`<stem>.build.lock`: one builds, the others wait and then read its entry. Every lock wait is bounded
by $FA4GEN_LOCK_TIMEOUT seconds (default 300); past it the lock's path and holder pid are logged and
the kernel is built without the cache, so a stopped holder never hangs a later process.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..spec.config import KernelConfig
from .cubin import cubin_problem
from .fsutil import atomic_write, clean_stale_tmp, pid_alive, env_seconds

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: rely on os.replace alone
    fcntl = None

log = logging.getLogger("fa4gen.assemble.cache")

ENV_VAR = "FA4GEN_CACHE_DIR"
LOCK_TIMEOUT_ENV = "FA4GEN_LOCK_TIMEOUT"
LOCK_TIMEOUT_DEFAULT_S = 300.0

BuildFn = Callable[[KernelConfig], "tuple[bytes, dict]"]


class CacheError(RuntimeError):
    """A build function returned something that cannot be cached (not a cubin, wrong config)."""


class CacheLockTimeout(CacheError):
    """A cache lock was not granted within the lock timeout; names the lock file and its holder."""

    def __init__(self, path: Path, waited_s: float, holder: int | None):
        self.path = path
        self.holder = holder
        if holder is None:
            who = "holder unknown"
        else:
            who = f"held by pid {holder}" + ("" if pid_alive(holder) else ", which is gone")
        super().__init__(f"waited {waited_s:g} s for the fa4gen cache lock {path} ({who}; a stopped or hung "
                         f"fa4gen process? {LOCK_TIMEOUT_ENV} sets the wait)")


def lock_timeout_s() -> float:
    """Seconds to wait for a cache lock: $FA4GEN_LOCK_TIMEOUT, else 300."""
    return env_seconds(LOCK_TIMEOUT_ENV, LOCK_TIMEOUT_DEFAULT_S, allow_zero=True)


class EntryState(enum.Enum):
    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"


@dataclass(frozen=True)
class Lookup:
    state: EntryState
    reason: str = ""
    cubin: bytes | None = None
    manifest: dict | None = None


@dataclass(frozen=True)
class CacheResult:
    cubin: bytes
    manifest: dict
    hit: bool
    found: EntryState  # what the lookup saw: OK (hit), MISSING, or CORRUPT (rebuilt)
    reason: str  # why a found entry was not used ("" on a hit or a plain miss)
    build_s: float  # seconds in build_fn (0 on a hit)
    stored: bool  # False when the directory could not be written (the result is still returned)
    path: Path  # the cubin's path


def default_cache_dir() -> Path:
    """$FA4GEN_CACHE_DIR, else $XDG_CACHE_HOME/fa4gen, else ~/.cache/fa4gen (read at each call)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "fa4gen"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_atomic_write = atomic_write


def _lock_holder(fd: int) -> int | None:
    """The pid an exclusive holder wrote into the lock file, if any."""
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


class CubinCache:
    def __init__(self, root: str | os.PathLike | None = None, toolchain: str | None = None):
        """toolchain: the assembler identity entries are keyed by (default: assemble.toolchain_id(),
        read at first use)."""
        self.root = Path(root).expanduser() if root is not None else default_cache_dir()
        self._toolchain = toolchain

    @property
    def toolchain(self) -> str:
        if self._toolchain is None:
            from .assemble import toolchain_id

            self._toolchain = toolchain_id()
        return self._toolchain

    def stem(self, cfg: KernelConfig) -> str:
        tc = hashlib.sha256(self.toolchain.encode()).hexdigest()[:8]
        return f"{cfg.name}-{cfg.content_hash}-{tc}"

    def cubin_path(self, cfg: KernelConfig) -> Path:
        return self.root / f"{self.stem(cfg)}.cubin"

    def manifest_path(self, cfg: KernelConfig) -> Path:
        return self.root / f"{self.stem(cfg)}.json"

    def lock_path(self, cfg: KernelConfig, build: bool = False) -> Path:
        return self.root / f"{self.stem(cfg)}{'.build' if build else ''}.lock"

    @contextlib.contextmanager
    def _locked(self, cfg: KernelConfig, exclusive: bool, build: bool = False):
        """flock on the entry's lock file (build: the per-key build lock), waiting at most
        lock_timeout_s(); raises CacheLockTimeout past it. An exclusive holder writes its pid in."""
        if fcntl is None:
            yield
            return
        path = self.lock_path(cfg, build)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # read-only or missing directory: nothing to coordinate with
            yield
            return
        try:
            timeout = lock_timeout_s()
            op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
            t0 = time.monotonic()
            delay = 0.005
            while True:
                try:
                    fcntl.flock(fd, op)
                    break
                except BlockingIOError:
                    waited = time.monotonic() - t0
                    if waited >= timeout:
                        raise CacheLockTimeout(path, timeout, _lock_holder(fd)) from None
                    time.sleep(min(delay, max(timeout - waited, 0.001)))
                    delay = min(delay * 2, 0.1)
            if exclusive:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # closing drops the flock

    # ---- read ----------------------------------------------------------------------------------
    def lookup(self, cfg: KernelConfig) -> Lookup:
        with self._locked(cfg, exclusive=False):
            return self._lookup_unlocked(cfg)

    def _lookup_unlocked(self, cfg: KernelConfig) -> Lookup:
        mpath, cpath = self.manifest_path(cfg), self.cubin_path(cfg)
        try:
            raw = mpath.read_bytes()
        except FileNotFoundError:
            if cpath.exists():
                return Lookup(EntryState.CORRUPT, f"{cpath.name} has no manifest (an interrupted write)")
            return Lookup(EntryState.MISSING)
        except OSError as e:
            return Lookup(EntryState.CORRUPT, f"cannot read {mpath.name}: {e}")
        try:
            manifest = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            return Lookup(EntryState.CORRUPT, f"{mpath.name} is not valid JSON ({e})")
        if not isinstance(manifest, dict):
            return Lookup(EntryState.CORRUPT, f"{mpath.name} is not a JSON object")
        if manifest.get("content_hash") != cfg.content_hash:
            return Lookup(EntryState.CORRUPT, f"{mpath.name} has content_hash {manifest.get('content_hash')!r}, "
                                              f"the config's is {cfg.content_hash!r}")
        if "config" in manifest and manifest["config"] != cfg.to_dict():
            return Lookup(EntryState.CORRUPT, f"{mpath.name} describes another config")
        if manifest.get("toolchain") != self.toolchain:
            return Lookup(EntryState.CORRUPT, f"{mpath.name} was built by {manifest.get('toolchain')!r}, "
                                              f"the assembler now is {self.toolchain!r}")
        want_sha, want_size = manifest.get("cubin_sha256"), manifest.get("cubin_size")
        if not isinstance(want_sha, str) or not isinstance(want_size, int):
            return Lookup(EntryState.CORRUPT, f"{mpath.name} lacks cubin_sha256/cubin_size")
        try:
            cubin = cpath.read_bytes()
        except FileNotFoundError:
            return Lookup(EntryState.CORRUPT, f"{cpath.name} is missing")
        except OSError as e:
            return Lookup(EntryState.CORRUPT, f"cannot read {cpath.name}: {e}")
        if len(cubin) != want_size:
            return Lookup(EntryState.CORRUPT, f"{cpath.name} has {len(cubin)} bytes, the manifest says {want_size}")
        if _sha256(cubin) != want_sha:
            return Lookup(EntryState.CORRUPT, f"{cpath.name}'s sha256 differs from the manifest's")
        bad = cubin_problem(cubin, cfg.arch)
        if bad:
            return Lookup(EntryState.CORRUPT, f"{cpath.name} is {bad}")
        return Lookup(EntryState.OK, "", cubin, manifest)

    # ---- write ---------------------------------------------------------------------------------
    def entry_manifest(self, cfg: KernelConfig, cubin: bytes, manifest: dict) -> dict:
        """The manifest as stored: the builder's, checked against cfg, plus the cubin's size and hash."""
        if not isinstance(cubin, (bytes, bytearray)) or not cubin:
            raise CacheError(f"build for {cfg.name} returned no cubin bytes ({type(cubin).__name__})")
        if not isinstance(manifest, dict):
            raise CacheError(f"build for {cfg.name} returned a {type(manifest).__name__} manifest, not a dict")
        if manifest.get("content_hash", cfg.content_hash) != cfg.content_hash:
            raise CacheError(f"build for {cfg.name} returned a manifest with content_hash "
                             f"{manifest['content_hash']!r}, expected {cfg.content_hash!r}")
        bad = cubin_problem(bytes(cubin), cfg.arch)
        if bad:
            raise CacheError(f"build for {cfg.name} returned bytes that are {bad}")
        out = dict(manifest)
        out["content_hash"] = cfg.content_hash
        out["toolchain"] = self.toolchain
        out["cubin_sha256"] = _sha256(bytes(cubin))
        out["cubin_size"] = len(cubin)
        return out

    def store(self, cfg: KernelConfig, cubin: bytes, manifest: dict) -> dict:
        """Write an entry (cubin first, manifest last: the manifest commits it); returns the stored manifest."""
        entry = self.entry_manifest(cfg, cubin, manifest)
        text = json.dumps(entry, indent=1, sort_keys=True).encode()
        self.root.mkdir(parents=True, exist_ok=True)
        clean_stale_tmp(self.root)  # what writers killed mid-store (kill -9) left behind
        with self._locked(cfg, exclusive=True):
            _atomic_write(self.cubin_path(cfg), bytes(cubin))
            _atomic_write(self.manifest_path(cfg), text)
        return entry

    def _build_uncached(self, cfg, build_fn, found: Lookup, why: CacheLockTimeout) -> CacheResult:
        log.warning("fa4gen %s; building %s without the cache", why, cfg.name)
        t0 = time.perf_counter()
        cubin, manifest = build_fn(cfg)
        build_s = time.perf_counter() - t0
        entry = self.entry_manifest(cfg, cubin, manifest)
        return CacheResult(bytes(cubin), entry, False, found.state, str(why), build_s, False, self.cubin_path(cfg))

    def get_or_build(self, cfg: KernelConfig, build_fn: BuildFn) -> CacheResult:
        """The entry for cfg, else built by build_fn and stored. Concurrent misses of one key (in
        any process) build once: the others wait on the key's build lock, then read the entry."""
        try:
            found = self.lookup(cfg)
        except CacheLockTimeout as e:
            return self._build_uncached(cfg, build_fn, Lookup(EntryState.MISSING), e)
        if found.state is EntryState.OK:
            log.debug("cache hit %s", self.cubin_path(cfg))
            return CacheResult(found.cubin, found.manifest, True, EntryState.OK, "", 0.0, True, self.cubin_path(cfg))
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # unwritable: _locked and store find out and degrade
        build_lock = self._locked(cfg, exclusive=True, build=True)
        try:
            build_lock.__enter__()
        except CacheLockTimeout as e:
            return self._build_uncached(cfg, build_fn, found, e)
        try:
            again = self._lookup_or_none(cfg)
            if again is not None and again.state is EntryState.OK:  # another process built it meanwhile
                log.debug("cache hit %s after waiting for its build", self.cubin_path(cfg))
                return CacheResult(again.cubin, again.manifest, True, EntryState.OK, "", 0.0, True,
                                   self.cubin_path(cfg))
            if found.state is EntryState.CORRUPT:
                log.warning("fa4gen cache entry %s is unusable (%s); rebuilding it", self.stem(cfg), found.reason)
            t0 = time.perf_counter()
            cubin, manifest = build_fn(cfg)
            build_s = time.perf_counter() - t0
            entry = self.entry_manifest(cfg, cubin, manifest)
            try:
                entry = self.store(cfg, cubin, manifest)
                stored = True
            except CacheLockTimeout as e:
                log.warning("fa4gen %s; the kernel is used without caching", e)
                stored = False
            except OSError as e:
                log.warning("fa4gen cannot write its cache in %s (%s); the kernel is used without caching",
                            self.root, e)
                stored = False
            return CacheResult(bytes(cubin), entry, False, found.state, found.reason, build_s, stored,
                               self.cubin_path(cfg))
        finally:
            build_lock.__exit__(None, None, None)

    def _lookup_or_none(self, cfg: KernelConfig) -> Lookup | None:
        try:
            return self.lookup(cfg)
        except CacheLockTimeout:
            return None


def get_or_build(cfg: KernelConfig, build_fn: BuildFn, cache_dir=None) -> tuple[bytes, dict, bool]:
    """(cubin, manifest, hit) for cfg from the cache in cache_dir (default: `default_cache_dir()`)."""
    r = CubinCache(cache_dir).get_or_build(cfg, build_fn)
    return r.cubin, r.manifest, r.hit


class KernelRegistry:
    """Loaded kernels of this process, one per (content_hash, device): a CUmodule belongs to one
    device's context, so the same cubin is loaded once per device."""

    def __init__(self):
        self._lock = threading.Lock()
        self._kernels: dict[tuple[str, object], object] = {}

    def get_or_create(self, key: tuple[str, object], factory: Callable[[], object]) -> tuple[object, bool]:
        """(kernel, created). The lock is held while the factory runs: concurrent first calls build
        and load once instead of racing the assembler."""
        with self._lock:
            k = self._kernels.get(key)
            if k is not None:
                return k, False
            k = factory()
            self._kernels[key] = k
            return k, True

    def peek(self, key: tuple[str, object]):
        """The loaded kernel for key, or None (no lock: one dict read is atomic in CPython)."""
        return self._kernels.get(key)

    def clear(self) -> None:
        with self._lock:
            self._kernels.clear()

    def __len__(self) -> int:
        return len(self._kernels)

    def __contains__(self, key) -> bool:
        return key in self._kernels


KERNELS = KernelRegistry()
