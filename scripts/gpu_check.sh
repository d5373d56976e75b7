#!/usr/bin/env bash
# The one command to run on a GPU machine (H100/H200): environment, prebuild of the 32 dense and 32
# varlen sm_90a variants into the cubin cache, `pytest -m gpu`, then the benchmark; ends with one summary line.
#   bash scripts/gpu_check.sh            (from anywhere; runs from the checkout, no install)
# Environment: FA4GEN_CACHE_DIR (default: a fresh temporary directory, so every run builds),
# OUT (when set, logs and the benchmark's JSON are copied there), GPU_CHECK_SKIP_BENCH=1.
# The benchmark has an FA4-CuTe peer column when /tmp/fa4/site (or $FA4_PEER_SITE) holds its unpacked
# wheels: run `bash scripts/fa4_peer.sh stage1`, then `stage1b` in two device calls, then
# `bash scripts/fa4_peer.sh stage2 && bash scripts/gpu_check.sh` in the third (carry lists: that
# script's header). Without it the column is empty and says why.
set -uo pipefail
cd "$(dirname "$0")/.."
# From the checkout: the image has no hatchling and needs no install; fa4gen/spec/paths.py (templates_dir) finds ./templates.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FA4GEN_CACHE_DIR="${FA4GEN_CACHE_DIR:-$(mktemp -d /tmp/fa4gen-cache.XXXXXX)}"
PY="${PYTHON:-python3}"
LOGS="$(mktemp -d /tmp/gpu_check.XXXXXX)"
say() { printf '\n== %s\n' "$*"; }

say environment
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader || echo "no nvidia-smi"
"$PY" - <<'EOF'
import importlib.metadata as md, shutil, sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version())
print("gpu:", torch.cuda.get_device_name() if torch.cuda.is_available() else None,
      torch.cuda.get_device_capability() if torch.cuda.is_available() else "")
for pkg in ("cuda-bindings", "nvidia-nvjitlink", "triton"):
    try:
        print(pkg, md.version(pkg))
    except md.PackageNotFoundError:
        print(pkg, "not installed")
print("ptxas:", shutil.which("ptxas") or "none (assemble falls back to nvJitLink)")
EOF
fa4_site="${FA4_PEER_SITE:-/tmp/fa4/site}"
if [ -d "$fa4_site" ]; then
    echo "fa4cute peer: $fa4_site (the benchmark times it)"
else
    echo "fa4cute peer: none ($fa4_site absent; scripts/fa4_peer.sh stage1, stage1b, stage2 bring it)"
fi

say "prebuild: the sm_90a variants the tests launch (32 dense, 32 varlen, the KV-cache ones) -> $FA4GEN_CACHE_DIR"
"$PY" - <<'EOF' 2>&1 | tee "$LOGS/prebuild.txt"
import itertools, os, time
from concurrent.futures import ProcessPoolExecutor

def one(key):
    from fa4gen.runtime import api
    from fa4gen.assemble.cache import CubinCache
    from fa4gen.spec.config import KernelConfig
    from fa4gen.spec.tiles import q_tile_rows
    d, dt, causal, g, varlen, *kv = key
    rows = kv[1] if len(kv) > 1 else q_tile_rows("sm_90a", d, g, varlen, bool(kv) and kv[0] is not None)
    cfg = KernelConfig(arch="sm_90a", head_dim=d, dtype=dt, causal=causal, gqa_ratio=g, varlen=varlen,
                       kvcache=bool(kv) and kv[0] is not None, page_size=kv[0] or 0 if kv else 0, block_m=rows)
    try:
        r = CubinCache().get_or_build(cfg, api.build)
        return cfg.name, "hit" if r.hit else "built", r.build_s, len(r.cubin), ""
    except Exception as e:
        return cfg.name, "FAILED", 0.0, 0, f"{type(e).__name__}: {str(e)[:300]}"

keys = (list(itertools.product((64, 128), ("fp16", "bf16"), (False, True), (1, 2, 4, 8), (False,)))
        + list(itertools.product((64, 128), ("fp16", "bf16"), (False, True), (1, 3, 4, 8), (True,)))
        # D = 64's 128-row kernels too (the default there is 192 rows): tests and the bench run both
        + [(64, dt, c, g, False, None, 128) for dt in ("fp16", "bf16") for c in (False, True) for g in (1, 2, 4, 8)])
# the KV-cache variants tests/test_gpu_kvcache.py and bench/kvcache.py launch
import ast, pathlib
src = pathlib.Path("tests/test_gpu_kvcache.py").read_text()
cases = ast.literal_eval(src[src.index("CASES = [") + len("CASES = "):src.index("]\n\n\n@pytest") + 1])
keys += sorted({(c[6], c[7], c[9], c[5], False, c[8]) for c in cases}
               | {(128, "bf16", True, 4, False, p) for p in (0, 16, 64)} | {(64, "fp16", True, 4, False, 0)})
t0 = time.perf_counter()
with ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as ex:
    rows = list(ex.map(one, keys))
for name, how, s, size, err in rows:
    print(f"  {name:40s} {how:6s} {s:6.2f} s {size:8d} B {err}")
bad = sum(how == "FAILED" for _, how, *_ in rows)
times = [s for _, how, s, *_ in rows if how == "built"]
print(f"prebuild: {len(rows) - bad}/{len(rows)} ok in {time.perf_counter() - t0:.1f} s wall"
      + (f"; build per kernel {min(times):.2f}-{max(times):.2f} s" if times else ""))
EOF

say "pytest -m gpu"
# A deadlocked kernel blocks inside a CUDA call, where no Python signal lands: pytest-timeout's
# thread method dumps the stacks and ends the process, so one hang cannot eat the device lease.
# The outer timeouts keep the whole script under the device tool's 10-minute command limit.
watchdog=()
"$PY" -c "import pytest_timeout" 2>/dev/null && watchdog=(--timeout=120 --timeout-method=thread)
timeout 420 "$PY" -m pytest -m gpu tests -rfEs --durations=10 -p no:cacheprovider "${watchdog[@]}" \
    --junitxml="$LOGS/gpu_tests.xml" 2>&1 | tee "$LOGS/pytest_gpu.txt"
rc_tests=${PIPESTATUS[0]}
tests_line=$(grep -E "[0-9]+ (passed|failed|error|errors|skipped|deselected)" "$LOGS/pytest_gpu.txt" | tail -n 1)
hung=0
{ [ "$rc_tests" = 124 ] || grep -q "+ Timeout +" "$LOGS/pytest_gpu.txt"; } && hung=1

rc_bench=skipped
bench_file=""
if [ "$hung" = 1 ]; then
    tests_line="TIMED OUT (a kernel hang?) ${tests_line}"
    echo "tests hung: benchmark skipped (it would hang the same way)"
elif [ "${GPU_CHECK_SKIP_BENCH:-0}" != 1 ]; then
    say "benchmark"
    timeout 200 "$PY" -m bench.attention 2>&1 | tee "$LOGS/bench.txt"
    rc_bench=${PIPESTATUS[0]}
    bench_file=$(grep -o "wrote .*" "$LOGS/bench.txt" | tail -n 1 | cut -c7-)
fi

if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    cp "$LOGS"/*.txt "$LOGS"/*.xml "$OUT"/ 2>/dev/null || true
fi
echo
echo "gpu_check: pytest -m gpu rc=$rc_tests [${tests_line:-no summary}]; bench rc=$rc_bench ${bench_file:+-> $bench_file}"
[ "$rc_tests" = 0 ] && { [ "$rc_bench" = 0 ] || [ "$rc_bench" = skipped ]; }
