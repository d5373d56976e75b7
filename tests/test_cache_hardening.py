"""The cubin cache against stopped lock holders, bytes that are not a cubin, killed writers and
processes that miss at once (issue 10, items 7, 8, 9, 11)."""
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time

import pytest

from fa4gen.assemble.cache import CubinCache, EntryState
from fa4gen.spec.config import KernelConfig
from fa4gen.assemble.cubin import fake_header

CFG = KernelConfig(arch="sm_90a", head_dim=64, causal=False, gqa_ratio=1, dtype="bf16")
TOOLCHAIN = "ptxas /opt/cuda/bin/ptxas 13.0.88"


def build(cfg):
    return fake_header(cfg.arch) + cfg.content_hash.encode() * 8, {"name": cfg.name, "config": cfg.to_dict()}


class Counting:
    def __init__(self):
        self.calls = 0

    def __call__(self, cfg):
        self.calls += 1
        return build(cfg)


def _in_thread(fn, timeout):
    """fn() in a daemon thread: (finished, result-or-exception); a hang shows as finished=False."""
    out = []
    t = threading.Thread(target=lambda: out.append(_catch(fn)), daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), (out[0] if out else None)


def _catch(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - handed to the test to assert on
        return e


def _hold_lock(path):
    """A separate process that takes an exclusive flock on path, writes its pid and sleeps (a
    stopped or hung fa4gen); returns the Popen once the lock is held."""
    code = ("import fcntl, os, sys, time\n"
            f"fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT, 0o644)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.ftruncate(fd, 0); os.pwrite(fd, f'{os.getpid()}\\n'.encode(), 0)\n"
            "print('locked', flush=True)\n"
            "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


# ---- item 7: a lock that is never released does not hang the next build --------------------------
@pytest.mark.parametrize("which", ["entry", "build"])
def test_stopped_lock_holder_times_out_then_builds_uncached(tmp_path, monkeypatch, caplog, which):
    monkeypatch.setenv("FA4GEN_LOCK_TIMEOUT", "0.5")
    cache = CubinCache(tmp_path, toolchain=TOOLCHAIN)
    lock = cache.lock_path(CFG, build=(which == "build"))
    holder = _hold_lock(lock)
    try:
        b = Counting()
        with caplog.at_level("WARNING", logger="fa4gen.assemble.cache"):
            finished, r = _in_thread(lambda: cache.get_or_build(CFG, b), timeout=20)
        assert finished, "get_or_build hung on a lock whose holder never lets go"
        assert not isinstance(r, Exception), r
        assert r.cubin == build(CFG)[0] and r.stored is False and b.calls == 1
        assert str(lock) in caplog.text and f"pid {holder.pid}" in caplog.text
        assert "without the cache" in caplog.text
    finally:
        holder.kill()
        holder.wait()
    assert cache.get_or_build(CFG, Counting()).stored  # the lock is free again: cached as usual


def test_lock_timeout_env_is_validated(tmp_path, monkeypatch):
    monkeypatch.setenv("FA4GEN_LOCK_TIMEOUT", "forever")
    with pytest.raises(ValueError, match="FA4GEN_LOCK_TIMEOUT"):
        CubinCache(tmp_path, toolchain=TOOLCHAIN).get_or_build(CFG, build)


# ---- item 8: the bytes must be a cubin for the arch; the assembler is part of the key ------------
def _replace_cubin(cache, data):
    """Swap the entry's cubin for data and make the manifest's sha/size agree (a sha-only check passes)."""
    import hashlib

    cache.cubin_path(CFG).write_bytes(data)
    m = json.loads(cache.manifest_path(CFG).read_text())
    m.update(cubin_sha256=hashlib.sha256(data).hexdigest(), cubin_size=len(data))
    cache.manifest_path(CFG).write_text(json.dumps(m))


@pytest.mark.parametrize("data,reason", [
    (b"PK\x03\x04 a zip file, not an ELF" * 4, "no ELF magic"),
    (b"\x7fELF\x02\x01\x01\x00" + bytes(120), "EM_CUDA"),
    (fake_header("sm_100a") + bytes(64), "sm_100"),
])
def test_cached_bytes_must_be_a_cubin_for_the_arch(tmp_path, data, reason):
    cache = CubinCache(tmp_path, toolchain=TOOLCHAIN)
    b = Counting()
    good = cache.get_or_build(CFG, b).cubin
    _replace_cubin(cache, data)
    seen = cache.lookup(CFG)
    assert seen.state is EntryState.CORRUPT and reason in seen.reason
    r = cache.get_or_build(CFG, b)
    assert (r.hit, r.cubin, b.calls) == (False, good, 2)
    assert cache.get_or_build(CFG, b).hit and b.calls == 2


def test_assembler_identity_is_in_the_key(tmp_path):
    b = Counting()
    old = CubinCache(tmp_path, toolchain="ptxas /usr/local/cuda/bin/ptxas 12.9.41")
    new = CubinCache(tmp_path, toolchain="ptxas /usr/local/cuda/bin/ptxas 13.0.88")
    jit = CubinCache(tmp_path, toolchain="nvJitLink 13.0")
    assert len({c.cubin_path(CFG) for c in (old, new, jit)}) == 3
    old.get_or_build(CFG, b)
    assert not new.get_or_build(CFG, b).hit and not jit.get_or_build(CFG, b).hit and b.calls == 3
    assert old.get_or_build(CFG, b).hit and b.calls == 3
    # a manifest naming another toolchain under our file name is not trusted either
    m = json.loads(new.manifest_path(CFG).read_text())
    m["toolchain"] = "nvJitLink 12.4"
    new.manifest_path(CFG).write_text(json.dumps(m))
    seen = new.lookup(CFG)
    assert seen.state is EntryState.CORRUPT and "nvJitLink 12.4" in seen.reason


def test_default_toolchain_names_the_assembler_and_its_version(tmp_path):
    from fa4gen.assemble import assemble

    tc = CubinCache(tmp_path).toolchain
    assert tc == assemble.toolchain_id()
    if assemble.find_ptxas() is not None:
        version = assemble.ptxas_version(assemble.find_ptxas())
        assert tc.startswith("ptxas ") and version and version in tc


# ---- item 9: temporaries of a killed writer are cleaned ----------------------------------------
def test_temporaries_of_a_killed_writer_are_removed(tmp_path):
    cache = CubinCache(tmp_path, toolchain=TOOLCHAIN)
    cache.root.mkdir(exist_ok=True)
    name = cache.cubin_path(CFG).name
    # a writer that dies between creating its temporary and the rename (what kill -9 leaves)
    code = ("import os, tempfile\n"
            f"fd, p = tempfile.mkstemp(dir={str(tmp_path)!r}, prefix='.{name}.' + str(os.getpid()) + '.', suffix='.tmp')\n"
            "os.write(fd, b'half a cubin')\n"
            "os._exit(9)\n")
    subprocess.run([sys.executable, "-c", code], check=False)
    dead = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(dead) == 1
    old = tmp_path / f".{name}.abandoned.tmp"  # no pid in its name, ten minutes old
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    live = tmp_path / f".{name}.1.keepme.tmp"  # pid 1 is alive: a writer still at work
    live.write_bytes(b"x")
    cache.get_or_build(CFG, build)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp"))
    assert left == [live.name]


# ---- item 11: processes missing one key build it once ------------------------------------------
def _slow_build(cfg):
    marker = os.environ["FA4GEN_TEST_MARKERS"]
    with open(os.path.join(marker, f"built-{os.getpid()}"), "w"):
        pass
    time.sleep(1.0)
    return build(cfg)


def _racer(root, markers, start_at, queue):
    os.environ["FA4GEN_TEST_MARKERS"] = markers
    cache = CubinCache(root, toolchain=TOOLCHAIN)
    time.sleep(max(0.0, start_at - time.time()))
    r = cache.get_or_build(CFG, _slow_build)
    queue.put((r.hit, r.cubin == build(CFG)[0]))


def test_concurrent_misses_build_once(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    start_at = time.time() + 4.0  # after every spawned interpreter has imported fa4gen
    procs = [ctx.Process(target=_racer, args=(str(tmp_path / "c"), str(markers), start_at, queue))
             for _ in range(4)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(list(markers.iterdir())) == 1, "more than one process ran the build"
    assert all(ok for _, ok in results)
    assert sorted(hit for hit, _ in results) == [False, True, True, True]
