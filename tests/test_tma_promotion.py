"""The TMA L2 promotion of every tensor map: one rule (plan.tma_l2_promotion) decides it per kernel,
the manifest records it per map, the runtime encodes each map with the manifest's value, and the
emulator validates the same map. (Before 2026-12-04 the runtime encoded every map with 256B
promotion, which cost the KV-cache kernels a tenth of their DRAM rate on the H200.)"""
from __future__ import annotations

import pytest

from fa4gen.codegen import build
from fa4gen.runtime import runtime
from fa4gen.runtime.runtime import Kernel, MapSpec, RuntimeSetupError, map_l2_promotion
from fa4gen.spec.config import KernelConfig
from fa4gen.spec.encodings import EncodingError, TmaL2Promotion
from fa4gen.spec.plan import TMA_L2_PROMOTION_REUSED, TMA_L2_PROMOTION_STREAMED, TMA_L2_PROMOTIONS, tma_l2_promotion

ARCHES = ("sm_90a", "sm_100a")
KINDS = {  # kernel kind -> (config fields, the promotion its maps must carry)
    "dense": (dict(), TMA_L2_PROMOTION_REUSED),
    "dense causal gqa": (dict(causal=True, gqa_ratio=4), TMA_L2_PROMOTION_REUSED),
    "varlen": (dict(varlen=True), TMA_L2_PROMOTION_REUSED),
    "kvcache": (dict(kvcache=True, gqa_ratio=4), TMA_L2_PROMOTION_STREAMED),
    "kvcache paged": (dict(kvcache=True, gqa_ratio=8, page_size=16), TMA_L2_PROMOTION_STREAMED),
}


def test_the_two_promotions_differ_and_are_driver_modes():
    assert TMA_L2_PROMOTION_STREAMED != TMA_L2_PROMOTION_REUSED
    assert {TMA_L2_PROMOTION_STREAMED, TMA_L2_PROMOTION_REUSED} <= set(TMA_L2_PROMOTIONS)
    assert TMA_L2_PROMOTIONS == ("none", "64B", "128B", "256B")


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_map_of_a_manifest_records_its_kernels_promotion(arch, kind):
    fields, want = KINDS[kind]
    cfg = KernelConfig(arch=arch, **fields)
    assert tma_l2_promotion(cfg.kvcache) == want
    maps = build(cfg, emit=(), verify=False).manifest["tensor_maps"]
    assert sorted(maps) == ["k", "o", "q", "v"]
    assert {role: spec["l2_promotion"] for role, spec in maps.items()} == dict.fromkeys(maps, want)


def test_the_labels_round_trip_through_the_encoding_enum():
    for mode in TmaL2Promotion:
        assert TmaL2Promotion.from_label(mode.label) is mode
    assert TmaL2Promotion.L2_128B.label == "128B" and TmaL2Promotion.NONE.label == "none"
    with pytest.raises(EncodingError, match="512B"):
        TmaL2Promotion.from_label("512B")


def test_the_enum_codes_are_cuda_pythons():
    """The runtime's label -> driver value table (what cuTensorMapEncodeTiled gets) is built from the
    encoding enum's names: every manifest label maps to the driver's value of the same code."""
    drv = pytest.importorskip("cuda.bindings.driver")
    table = runtime.driver_l2_promotions(drv)
    assert sorted(table) == sorted(TMA_L2_PROMOTIONS)
    for label, value in table.items():
        assert value == int(TmaL2Promotion.from_label(label))
    assert table["128B"] == int(drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B)


def test_a_manifest_without_the_field_gets_todays_rule():
    """Manifests written before the field existed (every map was encoded at 256B then): a KV-cache
    kernel's maps take 128B now, the others keep 256B; a recorded value is followed as it is."""
    assert map_l2_promotion("k", {"dims": [], "box": []}, kvcache=True) == "128B"
    assert map_l2_promotion("k", {"dims": [], "box": []}, kvcache=False) == "256B"
    assert map_l2_promotion("k", {"l2_promotion": "none"}, kvcache=True) == "none"


def test_a_bad_recorded_promotion_is_refused_in_words():
    with pytest.raises(RuntimeSetupError, match=r"k: the manifest's l2_promotion '96B' is not one of none, 64B, 128B, 256B"):
        map_l2_promotion("k", {"l2_promotion": "96B"}, kvcache=False)


class _RecordingLibcuda:
    def __init__(self):
        self.encoded: list[MapSpec] = []

    def encode_tiled(self, spec, addr):
        self.encoded.append(spec)
        return spec.role.encode().ljust(128, b"\0")

    def zero_words(self, ptr, n, stream):
        pass



@pytest.mark.parametrize("kind", ["dense", "kvcache"])
@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "unrecorded"])
def test_the_runtime_encodes_each_map_with_its_manifests_promotion(monkeypatch, kind, recorded):
    """The launch path on CPU tensors with libcuda faked: every map reaches cuTensorMapEncodeTiled with
    the manifest's promotion (a manifest edited to another mode is followed too); a manifest written
    before the field existed gets the rule's promotion for its kind."""
    torch = pytest.importorskip("torch")
    fields, want = KINDS[kind]
    cfg = KernelConfig(arch="sm_90a", **fields)
    man = build(cfg, emit=(), verify=False).manifest
    if not recorded:
        for spec in man["tensor_maps"].values():
            del spec["l2_promotion"]
    man["tensor_maps"]["v"]["l2_promotion"] = "64B"  # one map edited: followed, not the rule re-derived
    lib = _RecordingLibcuda()
    monkeypatch.setattr(runtime, "_libcuda", lambda: lib)
    monkeypatch.setattr(runtime, "_stream", lambda device: 0)
    kernel = Kernel(None, None, man, sm_count=132, device=None, l2_bytes=50 << 20, combine=None)
    d = cfg.head_dim
    if cfg.kvcache:
        q, kc = torch.zeros(2, 1, 8, d, dtype=torch.bfloat16), torch.zeros(2, 256, 2, d, dtype=torch.bfloat16)
        bound, _ = kernel.bind_kvcache(q, kc, kc, q, None, num_splits=1, softmax_scale=0.125)
    else:
        q = torch.zeros(1, 256, 2, d, dtype=torch.bfloat16)
        bound = kernel.bind(q, q, q, q, softmax_scale=0.125)
    ptrs = {"tmap_q": 16, "tmap_k": 32, "tmap_v": 48, "tmap_o": 64}
    for i, name, spec in bound._slots:
        if spec is not None:
            bound._map(name, spec, ptrs[name])
    got = {s.role: s.l2_promotion for s in lib.encoded}
    assert got == {"q": want, "k": want, "v": "64B", "o": want}
