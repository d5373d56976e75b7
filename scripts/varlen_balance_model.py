#!/usr/bin/env python3
"""How balanced is the varlen kernels' static persistent deal? A block-count model, no GPU.

    PYTHONPATH=. python3 scripts/varlen_balance_model.py

For bench/varlen.py's mixes (H 16, D 128): each task costs its K/V blocks + 0.5 (the per-task
overhead, a guess), tasks are dealt as the sm_90a kernel deals them (schedule.persistent_task over
schedule.varlen_tasks, 132 CTAs); printed: the most loaded CTA over the ideal (total / 132) for the
kernels' order, a greedy dynamic deal (what an atomic tile counter would give), and the same two for
the tasks sorted heaviest first (a global LPT the host cannot know without a sync). Measured gaps
to the dense kernel (bench/README.md "Varlen") are of the same size as the static deal's excess.
"""
import itertools, math
from bench.varlen import mix_lengths, equal_work_dense
from fa4gen.schedule import varlen_tasks, varlen_l2_rows, persistent_task
NCTA=132
def model(lens, causal, d=128, order="kernel"):
    cu=[0,*itertools.accumulate(lens)]
    l2=varlen_l2_rows(60*2**20, d, 2)
    tasks=varlen_tasks(cu,cu,cu[-1],cu[-1],16,128,causal,None,l2)
    def cost(t):
        b,hg,m,q0,ql,k0,kl=t
        if causal:
            hi=min((m+1)*128+kl-ql, kl); n=max(-(-hi//128),0)
        else: n=-(-kl//128)
        return n+0.5  # +overhead per task
    costs=[cost(t) for t in tasks]
    if order=="lpt": costs=sorted(costs, reverse=True)
    loads=[0.0]*NCTA
    nt=len(costs); rounds=-(-nt//NCTA)
    for r in range(rounds):
        for c in range(NCTA):
            t=persistent_task(r,c,NCTA,causal)
            if t<nt: loads[c]+=costs[t]
    ideal=sum(costs)/NCTA
    # dynamic greedy
    import heapq
    h=[(0.0,c) for c in range(NCTA)]
    for x in costs:
        l,c=heapq.heappop(h); heapq.heappush(h,(l+x,c))
    dyn=max(l for l,_ in h)
    return max(loads)/ideal, dyn/ideal, nt
for kind in ("uniform","heavy"):
    lens=mix_lengths(kind)
    for causal in (False,True):
        s=model(lens,causal); s2=model(lens,causal,order="lpt")
        b,S=equal_work_dense(lens)
        print(kind, causal, "static %.3f dynamic %.3f tasks %d | global-LPT static %.3f dyn %.3f"%(s[0],s[1],s[2],s2[0],s2[1]))
print("non-causal tasks dealt in the causal snake:")
def model2(lens, d=128):
    cu=[0,*itertools.accumulate(lens)]
    tasks=varlen_tasks(cu,cu,cu[-1],cu[-1],16,128,False,None,1)
    costs=[-(-t[6]//128)+0.5 for t in tasks]
    loads=[0.0]*NCTA; nt=len(costs)
    for r in range(-(-nt//NCTA)):
        for c in range(NCTA):
            t=persistent_task(r,c,NCTA,True)
            if t<nt: loads[c]+=costs[t]
    return max(loads)/(sum(costs)/NCTA)
for kind in ("uniform","heavy"):
    print(kind, "%.3f"%model2(mix_lengths(kind)))
