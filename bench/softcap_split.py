"""Softcap kernels with part of exp2 on the FMA pipe (emu_pairs): time against the plain causal kernel."""
import sys, torch, json
from bench.attention import interleaved_ms
from fa4gen.runtime import api
from fa4gen.runtime.validate import ScoreMods
from fa4gen.spec.config import KernelConfig
torch.manual_seed(0)
b, s, hq, hkv, d = 2, 8192, 32, 8, 128
q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
mods = ScoreMods(window_right=0, causal=True, softcap=50.0)
fns, outs = {}, {}
plain, _ = api.get_kernel(KernelConfig(arch="sm_90a", causal=True, gqa_ratio=4))
op = torch.empty_like(q); fns["plain"] = lambda: plain(q, k, v, op)
for e, st in [(0, None), (1, 0), (2, 0), (2, 1), (3, 0), (4, 0), (4, 1)]:
    kern, _ = api.get_kernel(KernelConfig(arch="sm_90a", causal=True, gqa_ratio=4, softcap=True, emu_pairs=e, emu_start=st))
    o = torch.empty_like(q); outs[(e, st)] = o
    fns[f"cap_e{e}_s{st}"] = (lambda kern=kern, o=o: kern(q, k, v, o, mods=mods))
for f in fns.values(): f()
torch.cuda.synchronize()
ref = outs[(0, None)].float()
for key, o in outs.items(): print(key, "maxdiff vs e0", (o.float() - ref).abs().max().item())
t = interleaved_ms(fns, 5, 25, 100)
base = t["plain"][0]
for n, (ms, sp) in t.items(): print(f"{n:14s} {ms:.4f} ms  x{ms / base:.3f} of plain  spread {sp}")
json.dump({n: [ms, sp] for n, (ms, sp) in t.items()}, open(sys.argv[1], "w"), indent=1)
