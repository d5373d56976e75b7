"""Kernel bundles (fa4gen/spec/models.py, fa4gen/runtime/bundle.py, `fa4gen bundle`): a model's config
read into its attention's shape and score modifiers, the kernel variants that serve it, a bundle written,
checked when loaded (version, arch, driver, files), found before any build, installed as a wheel.

CPU: everything but loading a cubin into a GPU context. GPU (marker `gpu`): a process that has only the
bundle (FA4GEN_BUNDLE_ONLY, no assembler reachable) serves its first decode call from it, within 50 ms.
"""
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from fa4gen.cli import main as cli
from fa4gen.runtime import bundle
from fa4gen.spec import models
from fa4gen.spec.config import GENERATOR_VERSION, HEAD_DIM_PAIRS

LLAMA = {"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
         "torch_dtype": "bfloat16", "_name_or_path": "org/Llama-like-8B"}
QWEN2 = {"model_type": "qwen2", "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
         "sliding_window": 131072, "use_sliding_window": False, "torch_dtype": "bfloat16"}
MISTRAL = {"model_type": "mistral", "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
           "head_dim": 128, "sliding_window": 4096, "torch_dtype": "float16"}
GPT_OSS = {"model_type": "gpt_oss", "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
           "hidden_size": 2880, "sliding_window": 128, "torch_dtype": "bfloat16",
           "layer_types": ["sliding_attention", "full_attention"] * 12}
GEMMA2 = {"model_type": "gemma2", "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
          "hidden_size": 3584, "sliding_window": 4096, "attn_logit_softcapping": 50.0, "torch_dtype": "bfloat16",
          "layer_types": ["sliding_attention", "full_attention"] * 21}
DEEPSEEK = {"model_type": "deepseek_v3", "num_attention_heads": 128, "num_key_value_heads": 128,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "hidden_size": 7168,
            "torch_dtype": "bfloat16"}


@pytest.fixture(autouse=True)
def clean_table(monkeypatch):
    monkeypatch.delenv("FA4GEN_BUNDLE", raising=False)
    monkeypatch.delenv("FA4GEN_BUNDLE_ONLY", raising=False)
    bundle.TABLE.clear()
    bundle.TABLE._auto_done = True  # no automatic loading unless a test asks for it
    yield
    bundle.TABLE.clear()


# ---- reading a model's config ----------------------------------------------------------------------
def test_model_attention_of_real_config_shapes():
    m = models.ModelAttention.from_hf_config(LLAMA)
    assert (m.heads_q, m.heads_kv, m.head_dim, m.head_dim_v, m.dtype, m.layer_kinds, m.window, m.softcap,
            m.sinks) == (32, 8, 128, 128, "bf16", (False,), None, 0.0, False)
    q = models.ModelAttention.from_hf_config(QWEN2)  # use_sliding_window false: no window
    assert (q.gqa_ratio, q.head_dim, q.layer_kinds, q.window) == (7, 128, (False,), None)
    mi = models.ModelAttention.from_hf_config(MISTRAL)  # no layer_types: every layer slides
    assert (mi.layer_kinds, mi.window, mi.dtype) == ((True,), 4096, "fp16")
    g = models.ModelAttention.from_hf_config(GPT_OSS)
    assert (g.layer_kinds, g.window, g.sinks, g.gqa_ratio) == ((False, True), 128, True, 8)
    gm = models.ModelAttention.from_hf_config({"model_type": "gemma3", "text_config": GEMMA2})
    assert (gm.head_dim, gm.softcap, gm.layer_kinds, gm.model_type) == (256, 50.0, (False, True), "gemma2")
    ds = models.ModelAttention.from_hf_config(DEEPSEEK)  # MLA prefill: (192, 128), one KV head per query head
    assert (ds.head_dim, ds.head_dim_v, ds.heads_kv) == (192, 128, 128)
    assert "full + window 128, sinks" in g.describe() and "DV 128" in ds.describe()


@pytest.mark.parametrize("cfg,message", [
    ({**LLAMA, "torch_dtype": "float32"}, "fa4gen's kernels take bfloat16 or float16"),
    ({**LLAMA, "num_key_value_heads": 5}, "not a multiple of num_key_value_heads 5"),
    ({k: v for k, v in LLAMA.items() if k != "num_attention_heads"}, "num_attention_heads must be a positive int"),
    ({**LLAMA, "sliding_window": -3}, "sliding_window must be a positive int"),
    ({**GPT_OSS, "layer_types": ["chunked_attention"]}, "fa4gen knows sliding_attention and full_attention"),
    ({**LLAMA, "hidden_size": 4001, "head_dim": None}, "no head_dim"),
    ([1, 2], "a model config is a JSON object"),
])
def test_model_config_errors_name_the_field(cfg, message):
    with pytest.raises(models.ModelConfigError, match=message):
        models.ModelAttention.from_hf_config(cfg)
    assert models.ModelAttention.from_hf_config({**LLAMA, "torch_dtype": "float32"}, dtype="fp16").dtype == "fp16"


def test_variants_cover_every_entry_layer_kind_page_size_and_tile():
    g = models.ModelAttention.from_hf_config(GPT_OSS)
    names = [c.name for c in models.variants(g, page_sizes=(0, 16))]
    assert names == sorted(names) and len(set(names)) == len(names)
    # dense and varlen: both layer kinds, each with the 128- and 192-row tiles (short and long causal calls)
    for kind in ("sink", "win_sink"):
        assert f"fa4_sm90a_d64_bf16_causal_gqa8_{kind}" in names and f"fa4_sm90a_d64_bf16_causal_gqa8_{kind}_m192" in names
        assert {f"fa4_sm90a_d64_bf16_causal_gqa8_varlen_{kind}", f"fa4_sm90a_d64_bf16_causal_gqa8_varlen_{kind}_m192"} <= set(names)
        assert {f"fa4_sm90a_d64_bf16_causal_gqa8_kvcache_{kind}", f"fa4_sm90a_d64_bf16_causal_gqa8_kvcache_p16_{kind}"} <= set(names)
    assert len(names) == 12
    for c in models.variants(g, page_sizes=(0, 16)):  # what the API asks for is what the bundle holds
        assert c.causal and c.sinks and not c.softcap and c.gqa_ratio == 8
    two = models.variants(models.ModelAttention.from_hf_config(LLAMA), archs=("sm_90a", "sm_100a"),
                          entry_points=("dense",))
    assert [c.arch for c in two] == ["sm_100a", "sm_90a"]


def test_variants_refuse_what_a_target_does_not_generate():
    wide = models.ModelAttention.from_hf_config({**GEMMA2, "head_dim": 512})  # Gemma-4-like global layers
    assert (512, 512) not in HEAD_DIM_PAIRS["sm_100a"]
    with pytest.raises(models.ModelConfigError, match=r"head dims \(512, 512\) are not generated for sm_100a"):
        models.variants(wide, archs=("sm_100a",))
    llama = models.ModelAttention.from_hf_config(LLAMA)
    for kw, message in ((dict(archs=("sm_80",)), "choose from sm_100a, sm_90a"),
                        (dict(entry_points=("prefill",)), "choose from dense, varlen, kvcache"),
                        (dict(page_sizes=(48,)), "0 \\(a contiguous cache\\) or one of 16, 32")):
        with pytest.raises(models.ModelConfigError, match=message):
            models.variants(llama, **kw)


def test_the_variants_are_the_kernels_the_api_asks_for():
    """The bundle's configs equal what launch.config_fields makes of the calls a model makes."""
    from fa4gen.runtime import launch, validate

    g = models.ModelAttention.from_hf_config(GPT_OSS)
    want = {c.name for c in models.variants(g, page_sizes=(0,))}

    def meta(name, shape, dtype="bfloat16"):
        strides = tuple(int(x) for x in __import__("numpy").cumprod((1,) + shape[::-1][:-1])[::-1])
        return validate.TensorMeta(name=name, shape=shape, strides=strides, dtype=dtype, device="cuda:0",
                                   data_ptr=1 << 20, element_size=2 if dtype != "int32" else 4)
    got = set()
    for windowed in (False, True):
        kw = dict(causal=True, window_size=(127, 0) if windowed else (-1, -1),
                  learnable_sink=meta("learnable_sink", (64,), "float32"))
        for s in (100, 8192):
            p = validate.check_problem(meta("q", (1, s, 64, 64)), meta("k", (1, s, 8, 64)), meta("v", (1, s, 8, 64)),
                                       **kw)
            got.add(launch.config_for(p).name)
        p = validate.check_kvcache_problem(meta("q", (2, 1, 64, 64)), meta("k", (2, 4096, 8, 64)),
                                           meta("v", (2, 4096, 8, 64)), meta("cache_seqlens", (2,), "int32"), **kw)
        got.add(launch.config_for(p).name)
    assert got <= want and len(got) == 6, (got, want)


# ---- writing, checking and finding a bundle ------------------------------------------------------------
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One small bundle (Llama-like, KV-cache decode only), assembled once for the module."""
    out = tmp_path_factory.mktemp("bundle")
    model = models.ModelAttention.from_hf_config(LLAMA)
    cfgs = models.variants(model, entry_points=("kvcache",))
    seen = []
    index = bundle.write_bundle(cfgs, out, model=model.describe(), progress=lambda i, n, name: seen.append((i, n)))
    assert seen == [(0, 1)] and index == out / bundle.INDEX
    return out, cfgs[0]


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bundle_index_and_find(built):
    out, cfg = built
    index = json.loads((out / bundle.INDEX).read_text())
    assert index["generator_version"] == GENERATOR_VERSION and index["archs"] == ["sm_90a"]
    assert [k["name"] for k in index["kernels"]] == [cfg.name] and cfg.name == "fa4_sm90a_d128_bf16_causal_gqa4_kvcache"
    assert hashlib.sha256((out / f"{cfg.name}.cubin").read_bytes()).hexdigest() == index["kernels"][0]["cubin_sha256"]
    assert bundle.find(cfg) is None  # nothing loaded yet: the caller builds
    assert bundle.load_bundle(out) == 1 and bundle.load_bundle(out) == 0  # a second load adds nothing
    hit = bundle.find(cfg)
    assert hit.cubin_path == out / f"{cfg.name}.cubin" and hit.content_hash == index["kernels"][0]["content_hash"]
    other = cfg.replace(page_size=64)
    assert bundle.find(other) is None
    bundle.TABLE.only = True
    with pytest.raises(bundle.BundleMissError, match="fa4_sm90a_d128_bf16_causal_gqa4_kvcache_p64 is in no loaded bundle"):
        bundle.find(other)


@pytest.mark.parametrize("edit,message", [
    ("version", "built by fa4gen 0.0.1 .*rebuild it"),
    ("cubin", "sha256 (differs|is not the one)"),
    ("missing", "is missing"),
    ("index", "no bundle.json"),
    ("format", "bundle format 99"),
    ("config", "its manifest's config is not the index's"),
])
def test_a_bundle_that_does_not_fit_is_refused(built, tmp_path, edit, message):
    out, cfg = built
    d = _copy(out, tmp_path / "b")
    index = json.loads((d / bundle.INDEX).read_text())
    cubin = d / f"{cfg.name}.cubin"
    if edit == "version":
        index["fa4gen"] = "0.0.1"
    elif edit == "cubin":
        data = bytearray(cubin.read_bytes())
        data[-1] ^= 1
        cubin.write_bytes(bytes(data))
    elif edit == "missing":
        cubin.unlink()
    elif edit == "index":
        (d / bundle.INDEX).unlink()
    elif edit == "format":
        index["format"] = 99
    elif edit == "config":
        index["kernels"][0]["config"]["gqa_ratio"] = 8
    if (d / bundle.INDEX).exists():
        (d / bundle.INDEX).write_text(json.dumps(index))
    with pytest.raises(bundle.BundleError, match=message):
        bundle.load_bundle(d)
    assert bundle.TABLE.kernels == {}


def test_arch_and_driver_are_checked(built):
    out, _ = built
    with pytest.raises(bundle.BundleError, match="holds sm_90a kernels, none for sm_100a"):
        bundle.read_bundle(out, arch="sm_100a")
    need = json.loads((out / bundle.INDEX).read_text())["cuda_release"]
    older = (need[0], need[1] - 1) if need[1] else (need[0] - 1, 9)
    with pytest.raises(bundle.BundleError, match=f"driver of CUDA {need[0]}.{need[1]} or newer; this driver supports"):
        bundle.read_bundle(out, driver_release=older)
    assert len(bundle.read_bundle(out, driver_release=(need[0], need[1]))) == 1


def test_environment_and_only_mode(built, monkeypatch):
    out, cfg = built
    bundle.TABLE.clear()  # automatic loading on
    monkeypatch.setenv("FA4GEN_BUNDLE", str(out))
    monkeypatch.setenv("FA4GEN_BUNDLE_ONLY", "1")
    assert bundle.find(cfg).name == cfg.name and bundle.TABLE.only
    bundle.TABLE.clear()
    monkeypatch.setenv("FA4GEN_BUNDLE", "")
    with pytest.raises(bundle.BundleError, match="FA4GEN_BUNDLE_ONLY is set but no bundle is loaded"):
        bundle.find(cfg)


def test_wheel_installs_and_is_found_by_itself(built, tmp_path, monkeypatch):
    out, cfg = built
    whl = bundle.write_wheel(out, tmp_path, "org/Llama-like-8B".split("/")[-1])
    assert whl.name.startswith("fa4gen_bundle_llama_like_8b-") and whl.name.endswith("-py3-none-any.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        record = z.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode().splitlines()
        for line in record:  # every file's RECORD hash is the file's
            n, h, _ = line.rsplit(",", 2)
            if h:
                import base64
                digest = base64.urlsafe_b64encode(hashlib.sha256(z.read(n)).digest()).rstrip(b"=").decode()
                assert h == f"sha256={digest}", n
        z.extractall(site)
    assert f"fa4gen_bundle_llama_like_8b/bundle/{cfg.name}.cubin" in names
    monkeypatch.syspath_prepend(str(site))
    import importlib

    importlib.invalidate_caches()
    bundle.TABLE.clear()  # automatic loading on: the installed wheel's entry point
    hit = bundle.find(cfg)
    assert hit is not None and hit.bundle == site / "fa4gen_bundle_llama_like_8b" / "bundle"


# ---- the CLI -------------------------------------------------------------------------------------------
def test_cli_lists_builds_and_explains_errors(tmp_path):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(GPT_OSS))
    r = CliRunner().invoke(cli, ["bundle", "--model", str(model), "--out", str(tmp_path / "o"), "--list",
                                 "--page-size", "0,16"])
    assert r.exit_code == 0, r.output
    assert "gpt_oss: 64/8 heads, D 64, bf16, layers full + window 128, sinks: 12 kernel variants" in r.output
    assert "fa4_sm90a_d64_bf16_causal_gqa8_kvcache_p16_win_sink" in r.output and not (tmp_path / "o").exists()
    for args, message in ((["--page-size", "x"], "comma-separated ints"), (["--arch", "sm_80"], "choose from"),
                          (["--model", str(tmp_path / "nope.json")], "No such file")):
        base = ["bundle", "--model", str(model), "--out", str(tmp_path / "o")]
        r = CliRunner().invoke(cli, base + args)
        assert r.exit_code == 2 and message in r.output, r.output
    model.write_text("{not json")
    r = CliRunner().invoke(cli, ["bundle", "--model", str(model), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "not JSON" in r.output
    assert "FA4GEN_BUNDLE_ONLY" in " ".join(CliRunner().invoke(cli, ["bundle", "--help"]).output.split())


# ---- GPU: a process with only the bundle ------------------------------------------------------------------
@pytest.mark.gpu
def test_first_decode_call_served_from_the_bundle_without_an_assembler(built, tmp_path):
    out, cfg = built
    code = (
        "import sys, time, torch\n"
        "import fa4gen.codegen as cg\n"
        "cg.build = lambda *a, **k: sys.exit('the generator ran')\n"
        "import fa4gen\n"
        "from fa4gen.runtime import api\n"
        "q = torch.randn(2, 1, 32, 128, device='cuda', dtype=torch.bfloat16)\n"
        "kc = torch.randn(2, 4096, 8, 128, device='cuda', dtype=torch.bfloat16); vc = torch.randn_like(kc)\n"
        "lens = torch.tensor([4096, 1000], device='cuda', dtype=torch.int32)\n"
        "fa4gen.load_bundle(sys.argv[1], only=True); torch.cuda.synchronize()\n"
        "t = time.perf_counter(); o = fa4gen.attention_with_kvcache(q, kc, vc, lens); torch.cuda.synchronize()\n"
        "dt = time.perf_counter() - t\n"
        "info = api.last_call_info()\n"
        "print(info.kernel.source, round(dt * 1e3, 2), bool(torch.isfinite(o).all()))\n"
    )
    env = {**os.environ, "FA4GEN_PTXAS": str(tmp_path / "no-ptxas"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    source, ms, finite = r.stdout.split()
    assert source == "bundle" and finite == "True"
    assert float(ms) <= 50.0, f"first call {ms} ms"
