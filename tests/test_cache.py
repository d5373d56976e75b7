"""The cubin cache: hits, misses, every kind of damaged entry rebuilt, atomic writes, racing writers."""

import json
import multiprocessing as mp
import os
import threading

import pytest

import fa4gen.spec.config
from fa4gen.assemble.cache import (CacheError, CubinCache, EntryState, KernelRegistry, default_cache_dir,
                                   get_or_build)
from fa4gen.spec.config import KernelConfig
from fa4gen.assemble.cubin import fake_header

CFG = KernelConfig(arch="sm_90a", head_dim=128, causal=True, gqa_ratio=4, dtype="bf16")
HEADER = fake_header("sm_90a")  # what the cache checks: a CUDA ELF for sm_90
OTHER = CFG.replace(causal=False)


class FakeBuild:
    """A build function that counts its calls and returns a cubin unique to the config."""

    def __init__(self, payload: bytes = b""):
        self.calls = 0
        self.payload = payload

    def __call__(self, cfg):
        self.calls += 1
        cubin = HEADER + cfg.content_hash.encode() + self.payload + bytes(range(256)) * 4
        return cubin, {"name": cfg.name, "config": cfg.to_dict(), "entry": "fa4_fwd"}


def test_miss_then_hit(tmp_path):
    build = FakeBuild()
    cache = CubinCache(tmp_path)
    r1 = cache.get_or_build(CFG, build)
    assert (r1.hit, r1.found, r1.stored) == (False, EntryState.MISSING, True)
    r2 = cache.get_or_build(CFG, build)
    assert r2.hit and build.calls == 1
    assert r2.cubin == r1.cubin == build(CFG)[0]
    assert r2.manifest["content_hash"] == CFG.content_hash
    assert r2.manifest["entry"] == "fa4_fwd"
    assert cache.cubin_path(CFG).name.startswith(f"{CFG.name}-{CFG.content_hash}-")
    assert r2.manifest["toolchain"] == cache.toolchain
    assert json.loads(cache.manifest_path(CFG).read_text())["cubin_size"] == len(r1.cubin)


def test_module_function_and_env_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FA4GEN_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    build = FakeBuild()
    cubin, manifest, hit = get_or_build(CFG, build)
    assert not hit and CubinCache(tmp_path / "c").cubin_path(CFG).read_bytes() == cubin
    assert get_or_build(CFG, build)[2] is True and build.calls == 1


def test_default_dir_without_env(monkeypatch, tmp_path):
    monkeypatch.delenv("FA4GEN_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "fa4gen"


def test_configs_do_not_share_entries(tmp_path):
    build = FakeBuild()
    cache = CubinCache(tmp_path)
    a = cache.get_or_build(CFG, build)
    b = cache.get_or_build(OTHER, build)
    assert not b.hit and a.cubin != b.cubin and build.calls == 2
    assert cache.get_or_build(CFG, build).cubin == a.cubin


def test_generator_version_change_misses(tmp_path, monkeypatch):
    build = FakeBuild()
    cache = CubinCache(tmp_path)
    cache.get_or_build(CFG, build)
    monkeypatch.setattr(fa4gen.spec.config, "GENERATOR_VERSION", "999.0.0")
    assert not cache.get_or_build(CFG, build).hit and build.calls == 2


def _truncate(cache):
    p = cache.cubin_path(CFG)
    p.write_bytes(p.read_bytes()[:100])


def _flip_byte(cache):
    p = cache.cubin_path(CFG)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x40
    p.write_bytes(bytes(data))


def _garbage_json(cache):
    cache.manifest_path(CFG).write_text('{"content_hash": ')


def _json_not_object(cache):
    cache.manifest_path(CFG).write_text("[1, 2]")


def _other_configs_manifest(cache):
    # a manifest copied from another config's entry: valid JSON, valid sha, wrong content_hash
    other = CubinCache(cache.root / "o")
    other.get_or_build(OTHER, FakeBuild())
    cache.manifest_path(CFG).write_bytes(other.manifest_path(OTHER).read_bytes())
    cache.cubin_path(CFG).write_bytes(other.cubin_path(OTHER).read_bytes())


def _wrong_config_same_hash(cache):
    m = json.loads(cache.manifest_path(CFG).read_text())
    m["config"]["head_dim"] = 64
    cache.manifest_path(CFG).write_text(json.dumps(m))


def _missing_cubin(cache):
    cache.cubin_path(CFG).unlink()


def _missing_manifest(cache):
    cache.manifest_path(CFG).unlink()


def _no_sha(cache):
    m = json.loads(cache.manifest_path(CFG).read_text())
    del m["cubin_sha256"]
    cache.manifest_path(CFG).write_text(json.dumps(m))


DAMAGE = {
    "truncated cubin": (_truncate, "bytes, the manifest says"),
    "flipped byte": (_flip_byte, "sha256 differs"),
    "garbage json": (_garbage_json, "not valid JSON"),
    "json not an object": (_json_not_object, "not a JSON object"),
    "other config's entry": (_other_configs_manifest, "content_hash"),
    "config field mismatch": (_wrong_config_same_hash, "another config"),
    "cubin missing": (_missing_cubin, "is missing"),
    "manifest missing": (_missing_manifest, "no manifest"),
    "no sha in manifest": (_no_sha, "lacks cubin_sha256"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_entry_is_rebuilt_not_loaded(tmp_path, damage, caplog):
    fn, reason = DAMAGE[damage]
    build = FakeBuild()
    cache = CubinCache(tmp_path)
    good = cache.get_or_build(CFG, build).cubin
    fn(cache)
    seen = cache.lookup(CFG)
    assert seen.state is EntryState.CORRUPT and reason in seen.reason and seen.cubin is None
    with caplog.at_level("WARNING", logger="fa4gen.assemble.cache"):
        r = cache.get_or_build(CFG, build)
    assert (r.hit, r.found, r.cubin) == (False, EntryState.CORRUPT, good)
    assert reason in r.reason and build.calls == 2
    assert "rebuilding" in caplog.text
    # the rebuilt entry is whole again
    assert cache.lookup(CFG).state is EntryState.OK
    assert cache.get_or_build(CFG, build).hit and build.calls == 2


def test_build_failure_writes_nothing(tmp_path):
    def broken(cfg):
        raise RuntimeError("ptxas said no")

    cache = CubinCache(tmp_path)
    with pytest.raises(RuntimeError, match="ptxas said no"):
        cache.get_or_build(CFG, broken)
    assert not any(tmp_path.glob("*.cubin")) and not any(tmp_path.glob("*.json"))
    assert cache.lookup(CFG).state is EntryState.MISSING


@pytest.mark.parametrize("bad", [
    (b"", {}),
    ("text", {}),
    (HEADER, "not a dict"),
    (HEADER, {"content_hash": "0123456789abcdef"}),
    (b"\x7fELF" + bytes(100), {}),  # not a CUDA ELF
    (fake_header("sm_100a") + bytes(100), {}),  # a cubin for another SM
])
def test_bad_build_output_is_refused(tmp_path, bad):
    with pytest.raises(CacheError):
        CubinCache(tmp_path).get_or_build(CFG, lambda cfg: bad)
    assert not any(tmp_path.glob("*.cubin"))


def test_failed_write_keeps_old_entry_and_leaves_no_temp(tmp_path, monkeypatch):
    cache = CubinCache(tmp_path)
    old = cache.get_or_build(CFG, FakeBuild()).cubin

    def fail(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        cache.store(CFG, HEADER + b"new cubin", {})
    monkeypatch.undo()
    assert cache.lookup(CFG).cubin == old
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_unwritable_dir_still_returns_the_build(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = CubinCache(blocker / "cache").get_or_build(CFG, FakeBuild())
    assert r.stored is False and r.hit is False and r.cubin.startswith(HEADER)


def _writer(root, tag, rounds, queue):
    """Store this writer's own cubin `rounds` times, looking the entry up in between."""
    cache = CubinCache(root)
    bad = []
    for i in range(rounds):
        cache.store(CFG, HEADER + tag.encode() * (200 + 37 * i), {"name": CFG.name, "writer": tag})
        seen = cache.lookup(CFG)
        if seen.state is not EntryState.OK:
            bad.append(seen.reason)
        elif seen.manifest["writer"] not in ("a", "b", "c") or seen.cubin[64:65] != seen.manifest["writer"].encode():
            bad.append("cubin of one writer paired with another's manifest")
    queue.put(bad)


def test_racing_processes_never_expose_a_torn_entry(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), tag, 25, queue)) for tag in "abc"]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results == [[], [], []]
    final = CubinCache(tmp_path).lookup(CFG)
    assert final.state is EntryState.OK
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_registry_creates_once_under_concurrency():
    reg = KernelRegistry()
    calls = []

    def factory():
        calls.append(1)
        return object()

    out = []
    threads = [threading.Thread(target=lambda: out.append(reg.get_or_create(("h", 0), factory))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len({id(k) for k, _ in out}) == 1 and sum(created for _, created in out) == 1
    other, created = reg.get_or_create(("h", 1), factory)  # another device loads its own module
    assert created and other is not out[0][0] and len(reg) == 2
    reg.clear()
    assert ("h", 0) not in reg
