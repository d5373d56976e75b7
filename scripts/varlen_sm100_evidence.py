"""Evidence for the sm_100a varlen kernels (CPU only; no Blackwell GPU exists here):
for D 64/128 x bf16/fp16 x causal x GQA 1/4/8/3, one JSON line each: IR verified (codegen.build),
`fa4gen check` ok, `fa4gen emulate` on the default ragged shapes with 2 seeds, ptxas -v registers and
spills, simulate_varlen against the reference on the same shapes.

    PYTHONPATH=. python scripts/varlen_sm100_evidence.py PART NPARTS   (e.g. 0 1; ~8 min on 2 cores in 2 parts)
"""
import sys, time, json, itertools, subprocess, re, tempfile
from pathlib import Path
import numpy as np
from fa4gen.config import KernelConfig
from fa4gen import codegen
from fa4gen.ptxemu import harness
from fa4gen.check import check_ptx
from fa4gen.simulate import simulate_varlen
from fa4gen.ptxemu.harness import VarShape, make_varlen_inputs, judge_varlen, default_shapes
part = int(sys.argv[1]); nparts = int(sys.argv[2])
variants = list(itertools.product((64, 128), ("bf16", "fp16"), (False, True), (1, 4, 8, 3)))
for i, (d, dt, c, g) in enumerate(variants):
    if i % nparts != part: continue
    cfg = KernelConfig(arch="sm_100a", varlen=True, causal=c, gqa_ratio=g, head_dim=d, dtype=dt)
    r = codegen.build(cfg, emit=("ptx",))  # verifies the IR (raises otherwise)
    ck = check_ptx(r.ptx, r.manifest).ok
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "k.ptx"; p.write_text(r.ptx)
        out = subprocess.run(["ptxas", "-arch=sm_100a", "-v", str(p), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True)
        log = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", log).group(1)
    sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups()
    warn = "warning" in log.lower()
    t = time.time()
    rep = harness.emulate_file("k.ptx", ptx_text=r.ptx, manifest=r.manifest, seeds=2)
    te = time.time() - t
    sims = []
    for sh in default_shapes(r.manifest):
        q, k, v = make_varlen_inputs(sh, dt, d, 0)
        cu = lambda L: np.concatenate([[0], np.cumsum(L)])
        s = simulate_varlen(cfg, q, k, v, cu(sh.lens_q), cu(sh.lens_k), sh.seqused_k, num_ctas=2)
        ok, _, _ = judge_varlen(s.o, s.lse, q, k, v, cfg.to_dict(), 1 / np.sqrt(d), sh)
        sims.append(ok and not s.findings)
    print(json.dumps(dict(name=cfg.name, verify=True, check=ck, emulate=rep.ok, runs=len(rep.runs), emu_s=round(te, 1),
                          ptxas_rc=out.returncode, regs=int(regs), spill_st=int(sp[0]), spill_ld=int(sp[1]), ptxas_warning=warn,
                          simulate=all(sims))), flush=True)
