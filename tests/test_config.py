"""KernelConfig: validation names the field, names are stable, the hash covers everything."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

import fa4gen.spec.config as config_module
from fa4gen.spec.config import ConfigError, KernelConfig

BAD_VALUES = [
    ("arch", "sm_80"),
    ("arch", "sm_100"),
    ("head_dim", 80),
    ("head_dim", 512),
    ("head_dim", True),
    ("head_dim_v", 64),  # with the default head_dim 128: (128, 64) is no pair fa4gen generates
    ("head_dim_v", 192),
    ("head_dim_v", True),
    ("head_dim_v", 128.0),
    ("causal", 1),
    ("causal", "yes"),
    ("gqa_ratio", 0),
    ("gqa_ratio", -4),
    ("gqa_ratio", (1 << 16) + 1),
    ("gqa_ratio", 3.0),
    ("gqa_ratio", True),
    ("dtype", "fp32"),
    ("dtype", "float16"),
    ("block_m", 64),
    ("block_n", 256),
    ("q_stages", 1),
    ("kv_stages", 1),
    ("kv_stages", 5),
    ("kv_stages", 2.0),
    ("kv_stages", True),
    ("rescale_threshold", -1.0),
    ("rescale_threshold", math.inf),
    ("rescale_threshold", math.nan),
    ("rescale_threshold", True),
    ("rescale_threshold", "8"),
    ("emu_pairs", -1),
    ("emu_pairs", 9),
    ("emu_pairs", True),
    ("emu_pairs", 2.0),
    ("emu_start", -1),
    ("emu_start", 4),
    ("emu_start", False),
    ("k_split", 48),
    ("k_split", 0),
    ("k_split", 128),
    ("k_split", 160),
    ("k_split", True),
    ("varlen", 1),
    ("varlen", "yes"),
    ("kvcache", 1),
    ("kvcache", "yes"),
    ("window", 1),
    ("window", (128, 0)),  # the sides are run-time arguments; the config only says the kernel has them
    ("softcap", 30.0),
    ("sinks", "yes"),
    ("page_size", 48),
    ("page_size", 512),
    ("page_size", 16.0),
    ("page_size", True),
]


@pytest.mark.parametrize("field,value", BAD_VALUES)
def test_invalid_field_raises_config_error_naming_it(field, value):
    with pytest.raises(ConfigError) as info:
        KernelConfig(**{field: value})
    err = info.value
    assert err.field == field
    assert field in str(err) and repr(value) in str(err)
    assert isinstance(err, ValueError)  # callers catching ValueError still see it


def test_every_field_has_a_rejected_value():
    covered = {f for f, _ in BAD_VALUES}
    assert covered == {f.name for f in dataclasses.fields(KernelConfig)}


def test_defaults_are_resolved():
    nc, c = KernelConfig(), KernelConfig(causal=True)
    assert (nc.emu_pairs, nc.emu_start, nc.k_split) == (2, 1, 96)
    assert (c.emu_pairs, c.emu_start, c.k_split) == (2, 0, 64)
    assert nc.p_chunks_first == 3 and c.p_chunks_first == 2
    assert KernelConfig(gqa_ratio=16).seq_q_per_tile == 8
    assert KernelConfig(gqa_ratio=3).seq_q_per_tile == 128  # not a divisor of 128: one head per tile
    # an explicit default is the same config (same name, same hash)
    explicit = KernelConfig(emu_pairs=2, emu_start=1, k_split=96, rescale_threshold=8)
    assert explicit == nc and explicit.content_hash == nc.content_hash and explicit.name == nc.name
    assert isinstance(KernelConfig(rescale_threshold=8).rescale_threshold, float)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelConfig().head_dim = 64


@pytest.mark.parametrize("kwargs,name", [
    ({}, "fa4_sm100a_d128_bf16_noncausal_gqa1"),
    ({"causal": True, "gqa_ratio": 4}, "fa4_sm100a_d128_bf16_causal_gqa4"),
    ({"arch": "sm_90a", "head_dim": 64, "dtype": "fp16"}, "fa4_sm90a_d64_fp16_noncausal_gqa1"),
])
def test_default_names_are_stable(kwargs, name):
    assert KernelConfig(**kwargs).name == name


def test_tuned_variant_names_carry_the_hash():
    tuned = KernelConfig(kv_stages=4)
    assert tuned.name == "fa4_sm100a_d128_bf16_noncausal_gqa1_" + tuned.content_hash[:8]
    assert tuned.name != KernelConfig().name


ALTERNATIVES = {
    "arch": "sm_90a", "head_dim": 64, "causal": True, "gqa_ratio": 2, "dtype": "fp16",
    "kv_stages": 2, "rescale_threshold": 0.0, "emu_pairs": 1, "emu_start": 2, "k_split": 32, "varlen": True,
    "kvcache": True, "window": True, "softcap": True, "sinks": True,
}


@pytest.mark.parametrize("field", sorted(ALTERNATIVES))
def test_hash_and_name_change_with_each_field(field):
    base = KernelConfig()
    other = base.replace(**{field: ALTERNATIVES[field]})
    assert other != base
    assert other.content_hash != base.content_hash
    assert other.name != base.name


def test_fixed_fields_have_no_alternative_but_are_hashed():
    # block_m, block_n, q_stages admit one value today; the hash still reads every field
    # (page_size has alternatives only with kvcache=True: test_kvcache_fields_combine_as_documented;
    # head_dim_v only with a planned pair, and the dict carries it only where it differs from head_dim:
    # test_head_dim_v_is_in_the_dict_name_and_hash_only_where_it_differs)
    fixed = {f.name for f in dataclasses.fields(KernelConfig)} - set(ALTERNATIVES) - {"page_size", "head_dim_v"}
    assert fixed == {"block_m", "block_n", "q_stages"}
    assert set(KernelConfig().to_dict()) >= fixed


def test_hash_changes_with_generator_version(monkeypatch):
    before = KernelConfig().content_hash
    tuned_before = KernelConfig(kv_stages=4).name
    monkeypatch.setattr(config_module, "GENERATOR_VERSION", config_module.GENERATOR_VERSION + ".dev1")
    assert KernelConfig().content_hash != before
    assert KernelConfig(kv_stages=4).name != tuned_before
    assert KernelConfig().name == "fa4_sm100a_d128_bf16_noncausal_gqa1"  # default names stay readable


def test_hash_is_deterministic():
    assert KernelConfig(causal=True).content_hash == KernelConfig(causal=True).content_hash
    assert len(KernelConfig().content_hash) == 16
    int(KernelConfig().content_hash, 16)


@pytest.mark.parametrize("kwargs", [{}, {"causal": True, "gqa_ratio": 8, "dtype": "fp16"},
                                    {"arch": "sm_90a", "head_dim": 64, "emu_pairs": 0, "k_split": 64}])
def test_from_dict_round_trip(kwargs):
    cfg = KernelConfig(**kwargs)
    again = KernelConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.content_hash == cfg.content_hash and again.name == cfg.name


def test_from_dict_unknown_field():
    d = KernelConfig().to_dict()
    d["warp_count"] = 4
    with pytest.raises(ConfigError) as info:
        KernelConfig.from_dict(d)
    assert info.value.field == "warp_count" and "not a KernelConfig field" in str(info.value)


def test_from_dict_validates():
    d = KernelConfig().to_dict()
    d["head_dim"] = 80
    with pytest.raises(ConfigError, match="head_dim"):
        KernelConfig.from_dict(d)


@pytest.mark.parametrize("g", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 40, 64, 96, 128, 256, 1 << 16])
def test_any_integer_gqa_ratio_is_a_config_and_tiles_gqa_pack_decides_the_packing(g):
    from fa4gen.spec.plan import gqa_manifest
    from fa4gen.spec.tiles import gqa_pack, head_groups

    cfg = KernelConfig(arch="sm_90a", causal=True, gqa_ratio=g)
    p = g if 128 % g == 0 else 1
    assert gqa_pack(g) == cfg.gqa_pack == p
    assert head_groups(g) == cfg.head_groups == g // p
    assert cfg.seq_q_per_tile == 128 // p
    if 64 % p == 0:  # a 192-row tile holds 192 / P positions (the plan's 128-row formula was wrong there)
        assert cfg.replace(head_dim=64, causal=False, block_m=192).seq_q_per_tile == 192 // p
    assert cfg.name == f"fa4_sm90a_d128_bf16_causal_gqa{g}"
    assert gqa_manifest(g) | {"rule": ""} == {"ratio": g, "pack": p, "head_groups": g // p, "rule": ""}


def test_kvcache_fields_combine_as_documented():
    assert KernelConfig(kvcache=True).name.endswith("_kvcache")
    assert KernelConfig(kvcache=True, page_size=64).name.endswith("_kvcache_p64")
    with pytest.raises(ConfigError, match="page_size"):
        KernelConfig(page_size=64)  # pages are a KV cache's layout
    with pytest.raises(ConfigError, match="kvcache"):
        KernelConfig(kvcache=True, varlen=True)
    for ps in (16, 32, 64, 128, 256):
        cfg = KernelConfig(kvcache=True, page_size=ps)
        assert cfg.replace(page_size=0).content_hash != cfg.content_hash


# ---- head_dim_v (issue 26 groundwork) --------------------------------------------------------------
def test_head_dim_v_defaults_to_head_dim_and_changes_nothing_for_dv_equal_d():
    for arch, d in itertools.product(("sm_100a", "sm_90a"), (64, 128)):
        cfg = KernelConfig(arch=arch, head_dim=d)
        same = KernelConfig(arch=arch, head_dim=d, head_dim_v=d)
        assert cfg.head_dim_v == d and cfg.head_dims == (d, d)
        assert same == cfg and same.name == cfg.name and same.content_hash == cfg.content_hash
        assert "head_dim_v" not in cfg.to_dict()  # the manifests' config dict is the one before head_dim_v
        assert KernelConfig.from_dict(cfg.to_dict()) == cfg == KernelConfig.from_dict(cfg.to_dict() | {"head_dim_v": d})
    assert KernelConfig(head_dim=64).replace(head_dim=128).head_dims == (128, 128)  # dv follows d


@pytest.mark.parametrize("arch", ["sm_100a", "sm_90a"])
@pytest.mark.parametrize("kwargs,field", [({"head_dim": 192, "head_dim_v": 128}, {}),
                                          ({"head_dim": 192}, "head_dim_v"),
                                          ({"head_dim": 256}, {}), ({"head_dim": 96}, {}),
                                          ({"head_dim": 128, "head_dim_v": 64}, "head_dim_v"),
                                          ({"head_dim": 64, "head_dim_v": 128}, "head_dim_v")])
def test_unsupported_head_dim_pairs_name_the_supported_ones(arch, kwargs, field):
    """The field blamed is head_dim when no generated pair has it ((192, 128) makes 192 a head_dim on
    both targets; both generate 96, 256 and (192, 128)); the message names the arch's pairs, the target
    that generates the pair if another does, and says where a pair is planned."""
    pair = (kwargs["head_dim"], kwargs.get("head_dim_v", kwargs["head_dim"]))
    if isinstance(field, dict) and arch not in field:
        assert KernelConfig(arch=arch, **kwargs).head_dims == pair  # both generate (96, 96), (192, 128), (256, 256)
        return
    with pytest.raises(ConfigError) as info:
        KernelConfig(arch=arch, **kwargs)
    assert info.value.field == (field[arch] if isinstance(field, dict) else field)
    msg = str(info.value)
    pairs = "(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)"
    assert config_module.head_dim_pairs_text(arch) == pairs and pairs in msg
    assert f"= {pair}" in msg and arch in msg
    assert ("sm_90a generates it" in msg) == (pair in config_module.HEAD_DIM_PAIRS["sm_90a"])
    assert ("planned" in msg) == (pair in config_module.HEAD_DIM_PLANNED)


@pytest.fixture
def sm100_plans_d256(monkeypatch):
    """The planning mechanism as it stood before sm_100a generated (256, 256): the pair planned on
    sm_100a (sm_90a generating it), so the mechanism keeps a test while no pair is planned."""
    monkeypatch.setitem(config_module.HEAD_DIM_PAIRS, "sm_100a",
                        tuple(p for p in config_module.HEAD_DIM_PAIRS["sm_100a"] if p != (256, 256)))
    monkeypatch.setattr(config_module, "HEAD_DIM_PLANNED", ((256, 256),))


def test_head_dim_v_is_in_the_dict_name_and_hash_only_where_it_differs():
    deepseek = KernelConfig(head_dim=192, head_dim_v=128)
    d256 = KernelConfig(head_dim=256)
    assert deepseek.head_dims == (192, 128) and deepseek.to_dict()["head_dim_v"] == 128
    assert deepseek.name == "fa4_sm100a_d192v128_bf16_noncausal_gqa1"  # no hash: the pair's default kernel
    assert d256.name == "fa4_sm100a_d256_bf16_noncausal_gqa1" and "head_dim_v" not in d256.to_dict()
    assert KernelConfig.from_dict(deepseek.to_dict()) == deepseek
    assert KernelConfig.from_dict(d256.to_dict()) == d256


def test_a_planned_pair_is_taken_inside_planning_only(sm100_plans_d256):
    with config_module.planning_head_dims():
        d256 = KernelConfig(head_dim=256)
    with pytest.raises(ConfigError, match=r"\(256, 256\) is not generated for sm_100a \(sm_90a generates it; planned"):
        KernelConfig.from_dict(d256.to_dict())  # outside planning_head_dims: refused


def test_a_planned_head_dim_pair_builds_ir_but_no_lowering_emits_it(sm100_plans_d256):
    """A planned pair (here sm_100a's (256, 256) as it was planned): its IR builds, its lowering refuses it."""
    from fa4gen.ir import build_pipeline
    from fa4gen.lower.sm100 import Sm100LoweringError, lower_sm100

    with config_module.planning_head_dims():
        pipe = build_pipeline(KernelConfig(arch="sm_100a", head_dim=256))
    with pytest.raises(Sm100LoweringError, match=r"\(256, 256\) is not generated .* no lowering emits it"):
        lower_sm100(pipe)


def test_block_n_is_the_targets_block_and_follows_replace():
    """block_n (keys per K/V block) is tiles.kv_block_keys of the target and head_dim: 128, and 64 for
    sm_90a D = 256; another value is refused naming it, and replace() of head_dim or arch re-derives it."""
    from fa4gen.spec.config import planning_head_dims

    assert KernelConfig().block_n == 128 and KernelConfig(arch="sm_90a", head_dim=96).block_n == 128
    with planning_head_dims():
        d256 = KernelConfig(arch="sm_90a", head_dim=256)
        assert d256.block_n == 64 and KernelConfig(arch="sm_100a", head_dim=256).block_n == 128
        assert d256.replace(arch="sm_100a").block_n == 128
        assert KernelConfig(arch="sm_90a").replace(head_dim=256).block_n == 64
        with pytest.raises(ConfigError, match="64 on sm_90a at head_dim 256"):
            KernelConfig(arch="sm_90a", head_dim=256, block_n=128)
    with pytest.raises(ConfigError, match="block_n"):
        KernelConfig(block_n=64)
    assert KernelConfig(block_n=128) == KernelConfig()  # the derived value, given or not, is one config
