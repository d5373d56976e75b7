"""The host side of sliding windows, softcap and sinks (docs/ABI.md "Windows, softcap, sinks"), on the
CPU: validation of window_size / softcap / learnable_sink, the kernel variant a call picks, the
run-time parameters the runtime packs (against plan.abi_params), prebuilt-kernel checks, the manifest
record and the CLI flags. The kernels themselves: tests/test_gpu_scoremods.py."""

import ctypes
import json
import math
import struct

import pytest

from fa4gen.runtime import api, launch
from fa4gen.spec.config import KernelConfig
from fa4gen.lower.manifest import score_mods_record
from fa4gen.spec.plan import (ALL_ABI_DECLS, COMBINE_ABI_DECLS, WINDOW_UNBOUNDED, abi_params, kvcache_manifest,
                              varlen_manifest)
from fa4gen.runtime.runtime import Kernel, MapSpec, RuntimeSetupError, score_mod_scalars
from fa4gen.runtime.validate import (DeviceError, InputErrors, InputTypeError, InputValueError, ScoreMods, TensorMeta,
                                     check_kvcache_problem, check_problem, check_varlen_problem)

from test_api_validation import meta, qkv


def sink(n=8, dtype="float32", device="cuda:0", shape=None):
    return TensorMeta("learnable_sink", shape or (n,), (1,), dtype, device, 1 << 20, 4 if dtype == "float32" else 2)


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


# ---- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,exc,match", [
    ({"window_size": 5}, InputTypeError, r"window_size must be a pair \(left, right\)"),
    ({"window_size": (1, 2, 3)}, InputTypeError, "window_size must be a pair"),
    ({"window_size": "ab"}, InputTypeError, "window_size must be a pair"),
    ({"window_size": (1.0, 0)}, InputTypeError, "window_size's left side must be an int >= -1, got float"),
    ({"window_size": (4, True)}, InputTypeError, "window_size's right side must be an int"),
    ({"window_size": (-2, 0)}, InputValueError, r"window_size's left side must be -1 \(unbounded\) or >= 0, got -2"),
    ({"softcap": -1.0}, InputValueError, "softcap must be finite and >= 0"),
    ({"softcap": float("nan")}, InputValueError, "softcap must be finite and >= 0"),
    ({"softcap": float("inf")}, InputValueError, "softcap must be finite and >= 0"),
    ({"softcap": "30"}, InputTypeError, "softcap must be a real number"),
    ({"softcap": True}, InputTypeError, "softcap must be a real number"),
    ({"softcap": 1e-45}, InputValueError, "softmax_scale / softcap .* not a finite normal float32"),
    ({"softcap": 3e38}, InputValueError, r"softcap 3e\+38: .* is not a finite normal float32"),
    ({"learnable_sink": sink(dtype="float64")}, InputTypeError, "learnable_sink must be float32 .*got float64"),
    ({"learnable_sink": sink(dtype="int32")}, InputTypeError, "learnable_sink must be float32"),
    ({"learnable_sink": sink(n=4)}, InputValueError, r"learnable_sink must have shape \(8,\), one logit per query "),
    ({"learnable_sink": sink(shape=(2, 4))}, InputValueError, r"learnable_sink must have shape \(8,\)"),
    ({"learnable_sink": sink(device="cuda:1")}, DeviceError, "learnable_sink must be on cuda:0 with q, got cuda:1"),
    ({"learnable_sink": sink(device="cpu")}, DeviceError, "learnable_sink must be on cuda:0"),
])
def test_bad_score_mod_arguments_are_named(kw, exc, match):
    for check in (lambda: check_problem(*qkv(), **kw),
                  lambda: check_kvcache_problem(*qkv(b=2), meta("cache_seqlens", (2,), "int32"), **kw)):
        with pytest.raises(exc, match=match):
            check()


def test_several_problems_are_reported_at_once():
    with pytest.raises(InputErrors) as info:
        check_problem(*qkv(), window_size=(-3, 0), softcap=-1.0, learnable_sink=sink(dtype="float64"))
    assert len(info.value.errors) == 3


def test_windows_need_lengths_below_2_30_minus_two_tiles():
    """Skv + a unit's rows + 2^30 (an unbounded side) must stay in s32: the limit is 2^30 - 256."""
    from fa4gen.spec.plan import WINDOW_SEQ_LIMIT
    assert WINDOW_SEQ_LIMIT == (1 << 30) - 256
    for skv in (WINDOW_SEQ_LIMIT, 1 << 30):
        with pytest.raises(InputValueError, match=f"sliding window needs lengths below 2\\^30 - 256 .*seqlen_k = {skv}"):
            check_problem(*qkv(b=1, sq=4, skv=skv), window_size=(128, 0))
    assert check_problem(*qkv(b=1, sq=4, skv=WINDOW_SEQ_LIMIT - 1), window_size=(128, 0)).mods.window
    big = 1 << 30
    assert not check_problem(*qkv(b=1, sq=4, skv=big), causal=True).mods.window  # no window, no limit
    # a side of 2^30 or more reaches every key: unbounded, so no window either
    assert check_problem(*qkv(b=1, sq=4, skv=big), window_size=(big, big)).mods == ScoreMods()
    q, k, v = (meta("q", (big, 8, 128)), meta("k", (10, 2, 128)), meta("v", (10, 2, 128)))
    cu = meta("cu_seqlens_q", (2,), "int32"), meta("cu_seqlens_k", (2,), "int32")
    with pytest.raises(InputValueError, match=f"total_q = {big}"):
        check_varlen_problem(q, k, v, *cu, big, 10, window_size=(0, 0))


def test_sink_dtypes_accepted():
    for dt in ("float32", "bfloat16", "float16"):
        assert check_problem(*qkv(), learnable_sink=sink(dtype=dt)).mods.sinks


# ---- the kernel variant -------------------------------------------------------------------------
@pytest.mark.parametrize("causal,window,want", [
    (False, (-1, -1), (None, None, False)),
    (True, (-1, -1), (None, 0, False)),  # causal alone: the causal kernel
    (True, (-1, 7), (None, 0, False)),  # causal makes right 0 whatever is passed
    (True, (127, 0), (127, 0, True)),
    (True, (127, 5), (127, 0, True)),
    (False, (127, 0), (127, 0, True)),
    (False, (-1, 0), (None, 0, True)),
    (False, (16, -1), (16, None, True)),
    (False, (0, 0), (0, 0, True)),
])
def test_variant_choice(causal, window, want):
    mods = check_problem(*qkv(), causal=causal, window_size=window).mods
    assert (mods.window_left, mods.window_right, mods.window) == want


def test_config_flags_follow_the_call():
    plain = check_problem(*qkv(), causal=True)
    assert launch.config_for(plain) == KernelConfig(arch="sm_90a", head_dim=128, causal=True, gqa_ratio=4)
    p = check_problem(*qkv(), causal=True, window_size=(127, 0), softcap=30.0, learnable_sink=sink())
    cfg = launch.config_for(p)
    assert (cfg.window, cfg.softcap, cfg.sinks) == (True, True, True) and cfg.name.endswith("_win_cap_sink")
    assert launch.config_for(check_problem(*qkv(), softcap=50)).replace(softcap=False) == launch.config_for(
        check_problem(*qkv()))
    kv = check_kvcache_problem(*qkv(b=2), meta("cache_seqlens", (2,), "int32"), learnable_sink=sink(),
                               window_size=(4095, 0))
    assert launch.config_for(kv).name.endswith("_kvcache_win_sink")


def test_window_keys_bounds_the_split_choice():
    mods = ScoreMods(window_left=127, window_right=0, causal=True)
    assert launch.window_keys(mods, 1, 100_000) == 128
    assert launch.window_keys(mods, 1, 50) == 50
    assert launch.window_keys(ScoreMods(), 1, 100_000) == 100_000


# ---- run-time parameters ------------------------------------------------------------------------
def _manifest(cfg):
    m = {"name": cfg.name, "config": cfg.to_dict(), "params": [n for n, _ in abi_params(cfg)],
         "grid": {"policy": "persistent", "tiles_per_task": 1}, "threads_per_cta": 384, "dynamic_smem_bytes": 0,
         "tensor_maps": {}}
    if cfg.varlen:
        m["varlen"] = varlen_manifest(cfg)
    if cfg.kvcache:
        m["kvcache"] = kvcache_manifest(cfg)
    return m


class _FakeSink:
    def data_ptr(self):
        return 0xABC0


class _FakeLibcuda:
    """Stands in for libcuda: records each launch's packed parameter buffer."""

    def __init__(self):
        self.launches = []
        self.zeroed = []  # (pointer, words, launches before it): the dynamic deal's counter
        self.programmatic = []  # per launch: launched with programmatic stream serialisation

    def zero_words(self, ptr, n, stream):
        self.zeroed.append((ptr, n, len(self.launches)))

    def launch(self, call, function, grid, threads, smem, stream, argv, programmatic=False):
        self.launches.append((call, argv.value))
        self.programmatic.append(programmatic)

    def encode_tiled(self, spec, addr):
        return spec.role.encode().ljust(128, b"\0")


_CODE = {n: {".u64": "Q", ".u32": "I", ".s32": "i", ".f32": "f"}.get(d.split()[-2], "")
         for n, d in {**ALL_ABI_DECLS, **COMBINE_ABI_DECLS}.items()}  # the scalars' struct codes


def _launched(monkeypatch, cfg, mods, sink=None, scale=0.125):
    """Run the runtime's launch path for cfg on CPU tensors (libcuda faked): the parameters it packs
    into each entry's buffer, decoded by name: {"scalars": the kernel's, "combine": fa4_combine's}."""
    torch = pytest.importorskip("torch")
    from fa4gen.runtime import runtime

    man = _manifest(cfg)
    kernel = Kernel(None, None, man, sm_count=132, device=None, l2_bytes=50 << 20, combine=None)
    lib = _FakeLibcuda()
    monkeypatch.setattr(runtime, "_libcuda", lambda: lib)
    monkeypatch.setattr(runtime, "_stream", lambda device: 0)
    # the fake manifest has no tensor maps: each map's spec is its role alone (the fake encodes that)
    monkeypatch.setattr(Kernel, "_map_spec", lambda self, role, shape, strides, elem: MapSpec(role, None, None, None, None))
    d, g = cfg.head_dim, cfg.gqa_ratio
    if cfg.varlen:
        q, k = torch.zeros(10, 2 * g, d), torch.zeros(12, 2, d)
        cu = torch.tensor([0, 10], dtype=torch.int32)
        kernel.varlen(q, k, k, q, cu, cu, 10, 12, softmax_scale=scale, mods=mods, sink=sink)
    elif cfg.kvcache:
        q, kc = torch.zeros(2, 1, 2 * g, d), torch.zeros(8, cfg.page_size or 64, 2, d)
        table = torch.zeros(2, 4, dtype=torch.int32) if cfg.page_size else None
        lens = torch.tensor([5, 9], dtype=torch.int32)
        part = torch.zeros(2, 2 * 2 * g, d)
        kernel.kvcache(q, kc, kc, q, lens, table, num_splits=2, softmax_scale=scale, o_partial=part,
                       lse_partial=part[..., 0], mods=mods, sink=sink)
    else:
        q, k = torch.zeros(1, 10, 2 * g, d), torch.zeros(1, 12, 2, d)
        kernel(q, k, k, q, softmax_scale=scale, l2_group=1, mods=mods, sink=sink)
    got = {}
    for call, argv in lib.launches:
        entry = kernel._combine_entry if "fa4_combine" in call else kernel._entry
        ptrs = (ctypes.c_void_p * len(entry.params)).from_address(argv)
        base = ptrs[0]
        assert base % 64 == 0, "the parameter buffer starts 64-byte aligned, as .param space does"
        buf = ctypes.string_at(base, entry.struct.size)
        named = dict(zip(entry.params, entry.struct.unpack(buf)))
        # each pointer addresses its own parameter's bytes
        for p, ptr in zip(entry.params, ptrs):
            size = 128 if p.startswith("tmap_") else struct.calcsize("<" + _CODE[p])
            assert ctypes.string_at(ptr, size) == (named[p] if p.startswith("tmap_")
                                                   else struct.pack("<" + _CODE[p], named[p])), p
        got["combine" if entry is kernel._combine_entry else "scalars"] = named
    assert [got["scalars"][f"tmap_{r}"].rstrip(b"\0") for r in "qkvo"] == [b"q", b"k", b"v", b"o"]
    assert list(got["scalars"]) == man["params"]
    # the dynamic deal (varlen): one word zeroed in the stream before the kernel's launch, and passed
    if "task_counter" in man["params"]:
        assert lib.zeroed == [(got["scalars"]["task_counter"], 1, 0)]
    else:
        assert lib.zeroed == []
    return got


@pytest.mark.parametrize("mode", [{}, {"varlen": True}, {"kvcache": True, "page_size": 64}])
@pytest.mark.parametrize("causal", [False, True])
def test_params_packed_per_abi(monkeypatch, mode, causal):
    cfg = KernelConfig(arch="sm_90a", causal=causal, gqa_ratio=2, window=True, softcap=True, sinks=True, **mode)
    mods = ScoreMods(window_left=100, window_right=None if not causal else 0, causal=causal, softcap=30.0, sinks=True)
    s = _launched(monkeypatch, cfg, mods, _FakeSink())["scalars"]
    assert s["window_left"] == 100
    assert s["window_right"] == (0 if causal else WINDOW_UNBOUNDED)
    assert s["softcap_in"] == f32(0.125 / 30.0)
    assert s["scale_log2"] == f32(30.0 * math.log2(math.e))
    assert s["sink_ptr"] == 0xABC0


def test_plain_kernels_keep_their_scale_and_take_no_new_param(monkeypatch):
    cfg = KernelConfig(arch="sm_90a", causal=True)
    s = _launched(monkeypatch, cfg, ScoreMods(window_right=0, causal=True))["scalars"]
    assert s["scale_log2"] == f32(0.125 * math.log2(math.e))
    assert not {"window_left", "window_right", "softcap_in"} & set(s)


def test_window_kernel_runs_unbounded_and_right_sided_windows():
    cfg = KernelConfig(arch="sm_90a", window=True).to_dict()
    s = score_mod_scalars(cfg, 0.1, None)
    assert (s["window_left"], s["window_right"]) == (WINDOW_UNBOUNDED, WINDOW_UNBOUNDED)
    s = score_mod_scalars(cfg, 0.1, ScoreMods(window_left=None, window_right=3))
    assert (s["window_left"], s["window_right"]) == (WINDOW_UNBOUNDED, 3)


@pytest.mark.parametrize("flags,mods,sink,match", [
    ({}, ScoreMods(window_left=5), None, "needs a kernel with window; this kernel has no score modifier"),
    ({"window": True}, ScoreMods(softcap=2.0), None, "needs a kernel with softcap; this kernel has window"),
    ({}, ScoreMods(sinks=True), _FakeSink(), "needs a kernel with sinks"),
    ({"softcap": True}, ScoreMods(), None, "a softcap kernel always caps"),
    ({"sinks": True}, ScoreMods(), None, "a sinks kernel reads a learnable_sink"),
    ({}, None, _FakeSink(), "a learnable_sink was given to a kernel without sinks"),
])
def test_runtime_refuses_a_kernel_without_the_calls_modifier(flags, mods, sink, match):
    with pytest.raises(RuntimeSetupError, match=match):
        score_mod_scalars(KernelConfig(arch="sm_90a", **flags).to_dict(), 0.1, mods, sink)


def test_combine_takes_the_sink_when_it_declares_it(monkeypatch):
    """fa4_combine counts a split cache's sink once: the runtime passes it the sink_ptr its manifest names."""
    cfg = KernelConfig(arch="sm_90a", causal=True, kvcache=True, sinks=True)
    params = kvcache_manifest(cfg)["combine"]["params"]
    assert params[-1] == "sink_ptr"
    got = _launched(monkeypatch, cfg, ScoreMods(window_right=0, causal=True, sinks=True), _FakeSink())
    assert list(got["combine"]) == params
    assert got["combine"]["sink_ptr"] == 0xABC0


def test_manifest_params_must_agree_with_the_flags():
    cfg = KernelConfig(arch="sm_90a", window=True)
    man = _manifest(cfg)
    Kernel(None, None, man, 132, None)
    for params in (man["params"][:-1], _manifest(KernelConfig(arch="sm_90a"))["params"]):
        with pytest.raises(RuntimeSetupError, match="config says window=True"):
            Kernel(None, None, dict(man, params=params), 132, None)
    with pytest.raises(RuntimeSetupError, match="config says sinks=False but its parameters have"):
        plain = _manifest(KernelConfig(arch="sm_90a"))
        Kernel(None, None, dict(plain, params=plain["params"] + ["sink_ptr"]), 132, None)


# ---- prebuilt kernels and the manifest record ---------------------------------------------------
def test_prebuilt_kernel_refusals():
    win = KernelConfig(arch="sm_90a", causal=True, window=True)
    assert api.score_mods_refusal(win, ScoreMods(window_right=0, causal=True)) is None  # unbounded on a window kernel
    assert "built without a sliding window" in api.score_mods_refusal(win.replace(window=False),
                                                                      ScoreMods(window_left=3, causal=True))
    cap = KernelConfig(arch="sm_90a", softcap=True)
    assert "built with --softcap: call it with softcap > 0" in api.score_mods_refusal(cap, ScoreMods())
    assert "built without --sinks" in api.score_mods_refusal(cap.replace(softcap=False), ScoreMods(sinks=True))


def test_score_mods_record():
    assert score_mods_record(KernelConfig()) is None
    rec = score_mods_record(KernelConfig(window=True, sinks=True))
    assert rec == {"window": True, "softcap": False, "sinks": True, "params": ["window_left", "window_right",
                                                                             "sink_ptr"]}
    cfg = KernelConfig(softcap=True, sinks=True)
    assert score_mods_record(cfg)["params"] == [n for n, _ in abi_params(cfg)][-2:]


def test_read_prebuilt_checks_the_score_mods_record(tmp_path):
    cfg = KernelConfig(arch="sm_90a", window=True)
    man = {"name": cfg.name, "config": cfg.to_dict(), "arch": "sm_90a", "entry": "fa4_fwd", "params": [],
           "dynamic_smem_bytes": 0, "grid": {}, "tensor_maps": {}, "threads_per_cta": 384}
    (tmp_path / "k.cubin").write_bytes(b"x")
    for record in (None, dict(score_mods_record(cfg), window=False)):
        (tmp_path / "k.json").write_text(json.dumps(dict(man, score_mods=record) if record else man))
        with pytest.raises(api.KernelLoadError, match="its score_mods record .* is not its config's"):
            api.read_prebuilt(tmp_path / "k.cubin")
    (tmp_path / "k.json").write_text(json.dumps(dict(man, score_mods=score_mods_record(cfg))))
    with pytest.raises(api.KernelLoadError, match="not a cubin"):  # past the record: the next check
        api.read_prebuilt(tmp_path / "k.cubin")


# ---- CLI ----------------------------------------------------------------------------------------
def test_cli_build_flags_make_the_variant(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from fa4gen import codegen
    from fa4gen.cli import main

    def fake_build(cfg, **kw):
        raise RuntimeError(f"built {cfg.name}")

    monkeypatch.setattr(codegen, "build", fake_build)
    r = CliRunner().invoke(main, ["build", "--arch", "sm_90a", "--causal", "--window", "--softcap", "--sinks",
                                  "--out", str(tmp_path)])
    assert "built fa4_sm90a_d128_bf16_causal_gqa1_win_cap_sink" in r.output, r.output
    r = CliRunner().invoke(main, ["build", "--arch", "sm_90a", "--sinks", "--out", str(tmp_path)])
    assert "built fa4_sm90a_d128_bf16_noncausal_gqa1_sink\n" in r.output, r.output
    helptext = " ".join(CliRunner().invoke(main, ["build", "--help"]).output.split())
    assert "--window" in helptext and "run-time arguments" in helptext and "learnable_sink" in helptext


def test_a_bound_launch_takes_each_calls_pointers(monkeypatch):
    """Kernel.bind_kvcache packs what the call shape decides once; each run places that call's
    pointers (a tensor map encoded from its tensor's pointer, once per pointer) and leaves the rest."""
    torch = pytest.importorskip("torch")
    from fa4gen.runtime import runtime

    cfg = KernelConfig(arch="sm_90a", causal=True, gqa_ratio=2, kvcache=True, page_size=64)
    man = _manifest(cfg)
    kernel = Kernel(None, None, man, sm_count=132, device=None, l2_bytes=50 << 20, combine=None)
    lib = _FakeLibcuda()
    encoded = []

    def encode(spec, addr):
        encoded.append((spec.role, addr))
        return f"{spec.role}@{addr}".encode().ljust(128, b"\0")

    lib.encode_tiled = encode
    monkeypatch.setattr(runtime, "_libcuda", lambda: lib)
    monkeypatch.setattr(runtime, "_stream", lambda device: 0)
    monkeypatch.setattr(Kernel, "_map_spec", lambda self, role, shape, strides, elem: MapSpec(role, None, None, None, None))
    q, kc = torch.zeros(2, 1, 4, 128), torch.zeros(8, 64, 2, 128)
    table = torch.zeros(2, 4, dtype=torch.int32)
    main, combine = kernel.bind_kvcache(q, kc, kc, q, table, num_splits=3, softmax_scale=0.125)
    assert kernel.bind_kvcache(q, kc, kc, q, table, num_splits=3, softmax_scale=0.125)[0] is main  # made once

    def params(i):
        call, argv = lib.launches[i]
        entry = kernel._combine_entry if "fa4_combine" in call else kernel._entry
        ptrs = (ctypes.c_void_p * len(entry.params)).from_address(argv)
        return dict(zip(entry.params, entry.struct.unpack(ctypes.string_at(ptrs[0], entry.struct.size))))

    got = []
    for n, base in enumerate((0x10000, 0x20000, 0x10000)):
        ptrs = {"tmap_q": base, "tmap_k": base + 0x100, "tmap_v": base + 0x200, "tmap_o": base + 0x300,
                "o_ptr": base + 0x300, "lse_ptr": 0, "sink_ptr": 0, "cache_seqlens": base + 0x400,
                "page_table": base + 0x500, "o_partial": base + 0x600, "lse_partial": base + 0x700}
        runtime.run_kvcache((main, combine), ptrs)
        m, c = params(2 * n), params(2 * n + 1)
        assert m["tmap_q"].rstrip(b"\0") == f"q@{base}".encode() and m["tmap_o"].rstrip(b"\0") == f"o@{base + 0x300}".encode()
        assert (m["cache_seqlens"], m["page_table"], m["o_partial"], m["lse_partial"]) == tuple(
            base + x for x in (0x400, 0x500, 0x600, 0x700))
        assert (c["o_partial"], c["lse_partial"], c["o_ptr"]) == (base + 0x600, base + 0x700, base + 0x300)
        assert (m["num_splits"], m["batch"], m["max_pages"], m["num_pages"], c["rows"], c["num_splits"]) == \
            (3, 2, 4, 8, 8, 3)
        got.append(m)
    assert got[0] == got[2] and got[0] != got[1]
    # fa4_combine starts programmatically (plan.COMBINE_PROGRAMMATIC, the manifest's record), fa4_fwd not
    assert lib.programmatic == [False, True] * 3
    # each (map, pointer) encoded once: the third run's pointers are the first's
    assert sorted(encoded) == sorted({(r, b + off) for b in (0x10000, 0x20000)
                                      for r, off in (("q", 0), ("k", 0x100), ("v", 0x200), ("o", 0x300))})
