"""The ABI manifests of both targets (fa4gen/lower/manifest.py) against a recorded set.

tests/data/manifests.json holds the manifests of CASES as the two per-target builders wrote them
before they became one (captured at commit aeef7cf with `python tests/test_manifest.py --write`):
every field, in order, must come out the same. Three facts that follow from the config and the
generator's sources (which any edit changes) are recorded as what they must equal instead of their
value: "config" (cfg.to_dict()), "content_hash" (cfg.content_hash) and "generator_version"; the
name is recorded relative to cfg.name (a tuned config's name carries the content hash).

After a deliberate manifest change, rewrite the record with `--write` and review its diff.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fa4gen.spec.config import GENERATOR_VERSION, KernelConfig  # noqa: E402

RECORD = Path(__file__).resolve().parent / "data" / "manifests.json"

MODES = {"dense": {}, "varlen": {"varlen": True}, "kv0": {"kvcache": True, "page_size": 0},
         "kv64": {"kvcache": True, "page_size": 64}, "kv256": {"kvcache": True, "page_size": 256}}


def cases() -> dict:
    """label -> (KernelConfig, Sm90Options keyword arguments or None): both targets, D 64/128, causal,
    GQA 1/4/6, dense / varlen / KV cache with pages of 0, 64, 256 keys, fp16 beside bf16, the 192-row
    sm_90a tile, a tuned (emu_pairs) config and the sm_90a lowering options."""
    out = {}

    def add(label, opts=None, **kw):
        try:
            cfg = KernelConfig(**kw)
        except ValueError:  # a combination the config refuses (e.g. varlen with a 192-row tile)
            return
        out[label] = (cfg, opts)

    for arch, d, dt, c, g, mode in itertools.product(("sm_100a", "sm_90a"), (64, 128), ("bf16", "fp16"),
                                                     (False, True), (1, 4, 6), MODES):
        if dt == "fp16" and mode != "dense" and g != 4:
            continue  # fp16 changes only the dtype fields: a few modes are enough
        label = f"{arch} d{d} {dt} {'causal' if c else 'noncausal'} gqa{g} {mode}"
        add(label, arch=arch, head_dim=d, dtype=dt, causal=c, gqa_ratio=g, **MODES[mode])
        if arch == "sm_90a" and d == 64:
            add(label + " m192", arch=arch, head_dim=d, dtype=dt, causal=c, gqa_ratio=g, block_m=192, **MODES[mode])
    for arch in ("sm_100a", "sm_90a"):
        add(f"{arch} d128 bf16 causal gqa4 dense emu_pairs=2", arch=arch, head_dim=128, causal=True, gqa_ratio=4,
            emu_pairs=2)
    for tag, opts in (("onepertask", {"persistent": False}),
                      ("regs", {"producer_regs": 32, "consumer_regs": 232}),
                      ("onepertask regs", {"persistent": False, "producer_regs": 32, "consumer_regs": 232})):
        for c in (False, True):
            add(f"sm_90a d128 bf16 {'causal' if c else 'noncausal'} gqa4 dense {tag}", opts, arch="sm_90a",
                head_dim=128, causal=c, gqa_ratio=4)
    add("sm_90a d64 bf16 causal gqa4 dense m192 onepertask", {"persistent": False}, arch="sm_90a", head_dim=64,
        causal=True, gqa_ratio=4, block_m=192)
    add("sm_90a d128 bf16 causal gqa4 varlen onepertask", {"persistent": False}, arch="sm_90a", head_dim=128,
        causal=True, gqa_ratio=4, varlen=True)
    for arch in ("sm_100a", "sm_90a"):  # score modifiers: their params and the score_mods record
        add(f"{arch} d128 bf16 causal gqa4 dense win cap sink", arch=arch, head_dim=128, causal=True, gqa_ratio=4,
            window=True, softcap=True, sinks=True)
        add(f"{arch} d64 bf16 noncausal gqa8 dense cap", arch=arch, head_dim=64, gqa_ratio=8, softcap=True)
        add(f"{arch} d64 bf16 noncausal gqa1 varlen win", arch=arch, head_dim=64, varlen=True, window=True)
        add(f"{arch} d128 bf16 causal gqa8 kv64 win sink", arch=arch, head_dim=128, causal=True, gqa_ratio=8,
            kvcache=True, page_size=64, window=True, sinks=True)
    return out


def manifest_of(cfg: KernelConfig, opts: dict | None) -> dict:
    """The ABI manifest of the kernel for cfg (and sm_90a options), as the lowering's build returns it."""
    if cfg.arch == "sm_100a":
        from fa4gen.ir import build_pipeline
        from fa4gen.lower.sm100 import manifest_sm100

        return manifest_sm100(build_pipeline(cfg))
    from fa4gen.lower.sm90 import Sm90Options, manifest_sm90

    return manifest_sm90(cfg, Sm90Options(**opts) if opts is not None else None)


def normalized(man: dict, cfg: KernelConfig) -> dict:
    """man with the config-derived facts replaced by what they must equal (when they do)."""
    out = dict(man)
    for key, want, mark in (("config", cfg.to_dict(), "<cfg.to_dict()>"),
                            ("content_hash", cfg.content_hash, "<cfg.content_hash>"),
                            ("generator_version", GENERATOR_VERSION, "<GENERATOR_VERSION>")):
        if out.get(key) == want:
            out[key] = mark
    name = out.get("name")
    if isinstance(name, str) and name.startswith(cfg.name):
        out["name"] = "<cfg.name>" + name[len(cfg.name):]
    return out


def capture() -> dict:
    return {label: normalized(manifest_of(cfg, opts), cfg) for label, (cfg, opts) in cases().items()}


def _items(x):
    """x with every dict as its list of (key, value) pairs: == then also compares the key order."""
    if isinstance(x, dict):
        return [(k, _items(v)) for k, v in x.items()]
    if isinstance(x, list):
        return [_items(v) for v in x]
    return x


def _diff(old, new, path="") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = [f"{path}.{k}: dropped" for k in old if k not in new]
        out += [f"{path}.{k}: added" for k in new if k not in old]
        for k in old:
            if k in new:
                out += _diff(old[k], new[k], f"{path}.{k}")
        if not out and list(old) != list(new):
            out.append(f"{path}: key order {list(old)} -> {list(new)}")
        return out
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads(RECORD.read_text())


def test_cases_match_the_record(record):
    """The record covers exactly these cases, and they span what the brief of the record says."""
    labels = set(cases())
    assert labels == set(record)
    assert len(labels) > 150
    for needle in ("sm_100a d64 fp16", "sm_90a d128 bf16 causal gqa6 varlen", "kv256", "kv64", "kv0", "m192",
                   "emu_pairs=2", "regs", "onepertask", "win cap sink", "varlen win", "kv64 win sink"):
        assert any(needle in lab for lab in labels), needle


@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
def test_manifests_equal_the_record(record, arch):
    bad = {}
    for label, (cfg, opts) in cases().items():
        if cfg.arch != arch:
            continue
        new = normalized(manifest_of(cfg, opts), cfg)
        old = record[label]
        if _items(json.loads(json.dumps(new))) != _items(old):
            bad[label] = _diff(old, json.loads(json.dumps(new)))[:6]
    assert not bad, "\n".join(f"{lab}: {d}" for lab, d in list(bad.items())[:10]) + f"\n({len(bad)} differ)"


def test_normalized_keeps_a_wrong_fact():
    """The normalization only hides a fact that equals what it must: a wrong one stays visible."""
    cfg = KernelConfig(head_dim=128, causal=True)
    good = {"name": cfg.name, "config": cfg.to_dict(), "content_hash": cfg.content_hash,
            "generator_version": GENERATOR_VERSION}
    assert normalized(good, cfg) == {"name": "<cfg.name>", "config": "<cfg.to_dict()>",
                                     "content_hash": "<cfg.content_hash>", "generator_version": "<GENERATOR_VERSION>"}
    other = KernelConfig(head_dim=64, causal=True)
    bad = {"name": other.name, "config": other.to_dict(), "content_hash": other.content_hash,
           "generator_version": GENERATOR_VERSION + "x"}
    assert normalized(bad, cfg) == bad
    assert _diff({"a": 1, "b": 2}, {"b": 2, "a": 1}) == [": key order ['a', 'b'] -> ['b', 'a']"]
    assert _items({"a": 1, "b": 2}) != _items({"b": 2, "a": 1})


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_manifest.py --write  (rewrites tests/data/manifests.json)")
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(capture(), indent=1) + "\n")
    print(f"wrote {len(json.loads(RECORD.read_text()))} manifests to {RECORD}")
