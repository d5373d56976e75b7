"""verify(pipeline) -> Report: resource budgets, declarations, and the barrier protocol.

Static checks: TMEM columns and aliasing, SMEM bytes, registers per CTA and setmaxnreg rules, named
barrier ids and thread counts, barrier kinds versus the ops that arrive on them, TMA byte counts.

Dynamic checks run the role programs in the engine (engine.py) over several scenarios (1, 2 and 3
K/V blocks per task, several tasks with different block counts) and several schedules per scenario:
every "this role runs first" priority order, the reverse order, and seeded random interleavings,
with asynchronous completions (TMA, MMA, tcgen05.ld/st, commits) fired at random points. Deadlock,
arrival counts and data hazards are detected on each run; phase correctness is checked in the run
and, through happens-before, for every order of the same program (see Engine._phase_hb_checks).
Bounds: the exploration is exhaustive over neither schedules nor block counts; the happens-before
checks make a passing run's phase argument hold for all interleavings of that scenario.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir.core import (Arrive, BarrierKind, Commit, Cond, ExpectTx, Mma, NamedArrive, NamedSync, Pipeline,
                       Space, TmaLoad, TmemLd, TmemSt, Wait, uses_cond, walk_ops)
from ..spec.encodings import TMEM_ALLOC_MIN_COLUMNS, TMEM_LANES
from ..ir.layout import layout_of
from ..spec.plan import ARCH_LIMITS, q_tile_bytes, tile_bytes, v_tile_bytes
from ..spec.tiles import PlanError
from .engine import Engine, Finding, Scenario

DEFAULT_SCENARIOS = ((1,), (2,), (3,), (2, 1, 3))


@dataclass(frozen=True)
class Report:
    pipeline_name: str
    findings: tuple[Finding, ...]
    runs: int
    scenarios: tuple[tuple[int, ...], ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.findings

    def codes(self) -> set[str]:
        return {f.code for f in self.findings}

    def text(self) -> str:
        head = (f"verify {self.pipeline_name}: {'OK' if self.ok else f'{len(self.findings)} finding(s)'}"
                f" ({self.runs} runs over K/V blocks per task {list(self.scenarios)})")
        return "\n".join([head] + [f"  {f}" for f in self.findings])


class VerificationError(Exception):
    def __init__(self, report: Report):
        self.report = report
        super().__init__(report.text())


def check_or_raise(pipe: Pipeline, **kw) -> Report:
    rep = verify(pipe, **kw)
    if not rep.ok:
        raise VerificationError(rep)
    return rep


def static_findings(pipe: Pipeline) -> list[Finding]:
    out: list[Finding] = []
    add = lambda code, subj, msg: out.append(Finding(code, subj, msg))  # noqa: E731

    # ---- TMEM ----
    limits = ARCH_LIMITS[pipe.arch]
    tm = [r for r in pipe.regions if r.space is Space.TMEM]
    if tm or pipe.tmem_alloc_cols:
        a, cols = pipe.tmem_alloc_cols, limits.tmem_cols
        if a > cols or a < TMEM_ALLOC_MIN_COLUMNS or a & (a - 1):
            add("TMEM_BUDGET", "tcgen05.alloc", f"allocation of {a} columns: must be a power of two in "
                                                f"[{TMEM_ALLOC_MIN_COLUMNS}, {cols}]" if cols else
                                                f"allocation of {a} columns: {pipe.arch} has no Tensor Memory")
        for r in tm:
            if r.col < 0 or r.col_end > min(a, cols):
                add("TMEM_BUDGET", r.name, f"columns [{r.col}, {r.col_end}) lie outside the {a}-column allocation"
                                           f" (TMEM has {cols} columns of {TMEM_LANES} lanes)")
        names = {r.name: r for r in tm}
        for r in tm:
            if r.alias_of is not None:
                base = names.get(r.alias_of)
                if base is None:
                    add("TMEM_ALIAS", r.name, f"alias_of {r.alias_of!r} is not a TMEM region")
                elif not (base.col <= r.col and r.col_end <= base.col_end):
                    add("TMEM_ALIAS", r.name, f"declared inside {base.name} [{base.col}, {base.col_end}) but "
                                              f"occupies [{r.col}, {r.col_end})")
        for i, r in enumerate(tm):
            for s in tm[i + 1:]:
                if r.col < s.col_end and s.col < r.col_end and r.alias_of != s.name and s.alias_of != r.name:
                    add("TMEM_OVERLAP", f"{r.name}/{s.name}",
                        f"{r.name} [{r.col}, {r.col_end}) and {s.name} [{s.col}, {s.col_end}) overlap without"
                        " a declared alias_of")
    # ---- SMEM ----
    try:
        lay = layout_of(pipe)  # the kernel's own layout: regions, barriers, TMEM slot, alignment slack
    except PlanError as e:
        add("SMEM_LAYOUT", "smem", str(e))
    else:
        if lay.total > pipe.smem_limit:
            add("SMEM_BUDGET", "smem", f"{lay.used} bytes of shared memory + {lay.align} alignment slack exceed "
                                       f"the {pipe.arch} limit of {pipe.smem_limit}")
    # ---- registers and warps ----
    warp_owner: dict[int, str] = {}
    regs_total = 0
    for role in pipe.roles:
        if role.regs % 8 or not 24 <= role.regs <= 256:
            add("REG_SETMAXNREG", role.name, f"setmaxnreg {role.regs}: must be a multiple of 8 in [24, 256]")
        for w in role.warps:
            if w in warp_owner:
                add("WARP_ROLES", role.name, f"warp {w} already belongs to {warp_owner[w]}")
            warp_owner[w] = role.name
            regs_total += 32 * role.regs
    missing = sorted(set(range(pipe.warps_per_cta)) - set(warp_owner))
    if missing:
        add("WARP_ROLES", "cta", f"warps {missing} have no role (setmaxnreg must cover whole warpgroups)")
    for wg in range(pipe.warps_per_cta // 4):
        budgets = {pipe.role(warp_owner[w]).regs for w in range(4 * wg, 4 * wg + 4) if w in warp_owner}
        if len(budgets) > 1:
            add("REG_WARPGROUP", f"warpgroup {wg}", f"roles of one warpgroup ask different setmaxnreg {sorted(budgets)}")
    if regs_total > limits.regs_per_sm:
        add("REG_BUDGET", "cta", f"{regs_total} registers per CTA (sum of setmaxnreg x threads) exceed "
                                 f"{limits.regs_per_sm}")
    # ---- declarations, kinds, counts ----
    bars = {b.name: b for b in pipe.barriers}
    regions = {r.name: r for r in pipe.regions}
    used = set()
    named_part: dict[str, dict[str, int]] = {}
    # each tensor's own tile (a K/V ring slot holds the larger of K's and V's: dv != d)
    tile_of = {"q": q_tile_bytes(pipe.config), "k": tile_bytes(pipe.config), "v": v_tile_bytes(pipe.config)}
    for role in pipe.roles:
        states = {s.name for s in role.states}
        announced: dict[tuple, int] = {}  # (barrier, slot operand) -> the last expect_tx's bytes
        for op in walk_ops(role.program):
            bname = getattr(op, "barrier", None)
            if bname is not None:
                used.add(bname)
                b = bars.get(bname)
                if b is None:
                    add("IR_REF", role.name, f"{type(op).__name__} names undeclared barrier {bname!r}")
                    continue
                want = {Commit: {BarrierKind.TCGEN05}, ExpectTx: {BarrierKind.TMA}, Arrive: {BarrierKind.MBAR},
                        TmaLoad: {BarrierKind.TMA}, NamedArrive: {BarrierKind.NAMED}, NamedSync: {BarrierKind.NAMED},
                        Wait: {BarrierKind.MBAR, BarrierKind.TMA, BarrierKind.TCGEN05}}.get(type(op))
                if want and b.kind not in want:
                    add("BARRIER_KIND", bname, f"{role.name}: {type(op).__name__} on a {b.kind.value} barrier")
                if isinstance(op, (NamedArrive, NamedSync)):
                    share = 32 if b.count == 64 and b.slots > 2 else role.threads
                    named_part.setdefault((bname, op.slot), {})[role.name] = share
            if hasattr(op, "state") and op.state not in states:
                add("IR_REF", role.name, f"{type(op).__name__} names undeclared state {op.state!r}")
            # region operands: `region` on TMEM/SMEM moves; a, b, d on MMAs; dst on TMA loads
            names = [getattr(op, "region", None)] + ([op.a, op.b, op.d] if isinstance(op, Mma) else []) + \
                ([op.dst] if isinstance(op, TmaLoad) else [])
            for v in names:
                if v is not None and v not in regions:
                    add("IR_REF", role.name, f"{type(op).__name__} names undeclared region {v!r}")
            if isinstance(op, TmaLoad):
                r = regions.get(op.dst)
                if r is not None and op.bytes > r.bytes_per_slot:
                    add("TX_COUNT", op.barrier, f"{role.name}: TMA load of {op.bytes} bytes into a "
                                                f"{r.bytes_per_slot}-byte {op.dst} slot")
                own = tile_of.get(op.tensor)
                if own is not None and op.bytes != own:
                    add("TX_COUNT", op.barrier, f"{role.name}: TMA load of {op.tensor} carries {op.bytes} bytes, "
                                                f"its tile is {own}")
                said = announced.pop((op.barrier, op.bar_slot), None)
                if said is not None and said != op.bytes:
                    add("TX_COUNT", op.barrier, f"{role.name}: expect_tx of {said} bytes announces a TMA load of "
                                                f"{op.tensor} of {op.bytes} bytes")
                b = bars.get(op.barrier)
                if b is not None and b.tx_bytes and op.bytes != b.tx_bytes:
                    add("TX_COUNT", op.barrier, f"{role.name}: TMA load of {op.bytes} bytes, barrier expects {b.tx_bytes}")
            if isinstance(op, ExpectTx):
                announced[(op.barrier, op.slot)] = op.bytes
                b = bars.get(op.barrier)
                if b is not None and b.tx_bytes and op.bytes != b.tx_bytes:
                    add("TX_COUNT", op.barrier, f"{role.name}: expect_tx of {op.bytes} bytes, barrier expects {b.tx_bytes}")
            if isinstance(op, (TmemLd, TmemSt)):
                r = regions.get(op.region)
                width = (2 * r.cols if r.dtype == "f16" else r.cols) if r else 0
                if r is not None and not 0 <= op.col_lo < op.col_hi <= width:
                    add("TMEM_BUDGET", op.region, f"{role.name}: access to columns [{op.col_lo}, {op.col_hi}) "
                                                  f"of a {width}-column region")
    for b in pipe.barriers:
        if b.name not in used:
            add("IR_REF", b.name, "declared but never used")
        if b.kind is BarrierKind.NAMED:
            last = b.named_id + b.slots - 1
            if b.named_id < 1 or last > 15:
                add("NAMED_ID", b.name, f"hardware ids {b.named_id}..{last}: named barriers are 1..15 (0 is "
                                        "the CTA-wide __syncthreads barrier)")
            if b.count % 32:
                add("NAMED_COUNT", b.name, f"thread count {b.count} is not a multiple of 32 (warp granularity)")
            if b.per_warp and (b.slots % 4 or b.count != 64):
                add("NAMED_COUNT", b.name, f"per_warp pairs warp k of two warpgroups: needs slots in fours and "
                                           f"64 threads per instance, got {b.slots} slots of {b.count}")
        elif b.per_warp:
            add("BARRIER_KIND", b.name, f"per_warp applies to named barriers only, not {b.kind.value}")
            for (bname, slot), part in sorted(named_part.items(), key=str):
                if bname == b.name and sum(part.values()) != b.count:
                    add("NAMED_COUNT", b.name, f"slot {slot}: declared {b.count} threads per instance, but its "
                                               f"participants {part} bring {sum(part.values())}")
    return out


def _roles_using(pipe: Pipeline, cond: Cond) -> set:
    """Names of the roles whose program has an If on `cond`."""
    return {r.name for r in pipe.roles if uses_cond(r.program, cond)}


def verify(pipe: Pipeline, scenarios=DEFAULT_SCENARIOS, random_schedules: int = 6) -> Report:
    findings = static_findings(pipe)
    runs = 0
    # a launch-uniform branch (KV cache: num_splits > 1 or not) is explored both ways
    split_kv = (False, True) if _roles_using(pipe, Cond.SPLIT_KV) else (False,)
    if not any(f.code in ("IR_REF", "BARRIER_KIND") for f in findings):
        names = [r.name for r in pipe.roles]
        orders = [tuple([n] + [m for m in names if m != n]) for n in names] + [tuple(reversed(names))]
        seen = {(f.code, f.subject) for f in findings}
        runs_of = [Scenario(tuple(sc), split_kv=sp) for sc in scenarios for sp in split_kv]
        # a consumer whose rows are all past Sq (If ROWS_IN_SQ) runs its barrier-only path: the
        # protocol must hold with either consumer on it
        for name in sorted(_roles_using(pipe, Cond.ROWS_IN_SQ)):
            runs_of += [Scenario(tuple(sc), idle_roles=(name,), split_kv=sp) for sc in scenarios for sp in split_kv]
        for sc in runs_of:
            plans = [(o, 1000 + i) for i, o in enumerate(orders)] + [(None, s) for s in range(random_schedules)]
            for prio, seed in plans:
                runs += 1
                for f in Engine(pipe, sc, seed=seed, priority=prio).run():
                    key = (f.code, "" if f.code == "DEADLOCK" else f.subject)  # one deadlock report is enough
                    if key not in seen:
                        seen.add(key)
                        findings.append(f)
            if len(findings) > 12:
                break
    return Report(pipe.config.name, tuple(findings), runs, tuple(tuple(s) for s in scenarios))
