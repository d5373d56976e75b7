"""Mutation testing of the evidence itself: generic one-line edits of a kernel's PTX, each judged the way
a reviewer would judge an edited file, by `fa4gen check` (the read-back against the verified IR) and
`fa4gen emulate` (its default cases and seeds). An edit either tool rejects is *killed*; one both pass
and ptxas assembles *survives*, and is either equivalent (the kernel computes the same thing: swapping
two independent lines, a constant nobody reads) or a hole in the evidence: a class of broken kernel
that would pass. The named corpus (ptxemu/mutations.py) holds the bug classes someone thought of; this
sweep looks for the ones nobody did.

The edits (OPS), on the instruction lines of every entry, found by the emulator's own parser:
  drop  delete the line
  dup   repeat a line whose repetition matters: an arrive, expect_tx, atom, TMA copy, MMA or commit, a
        self-update like a ring-state advance (not a store of the same value, a fence, max/min)
  swap  exchange it with the next line when their order matters (a register one writes and the other
        reads or writes; a sync or fence next to a memory access)
  imm   an integer immediate +-1 (+-8 for multiples of 8: a neighbouring barrier slot or word)
  cmp   setp's comparison to its neighbour (lt<->le, gt<->ge, eq<->ne, lo<->ls, hi<->hs)
  neg   the guard predicate negated        opc   add<->sub, min<->max, and<->or, shl<->shr, selp's arms
  reg   one source register replaced by another of the same declared type

python3 scripts/mutation_sweep.py PTX [--ops ...] [--per-op N] [--jobs J] [--json F] [--write-survivors DIR]
"""
from __future__ import annotations

import json
import random
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

OPS = ("drop", "dup", "swap", "imm", "cmp", "neg", "opc", "reg")

_LINE = re.compile(r"^(?P<ind>\s*)(?P<guard>@!?%\w+\s+)?(?P<opc>[a-z][\w.:]*)(?P<rest>(?:\s[^;]*)?);(?P<tail>\s*(?://.*)?)$")
_REG = re.compile(r"%[A-Za-z_]\w*(?![\w.])")
_INT = re.compile(r"(?<![\w%.$])(-?)(0x[0-9a-fA-F]+|\d+)(?![\w.])")
_SIDE = ("st.", "red.", "atom.", "mbarrier.", "bar.", "barrier.", "fence.", "cp.", "wgmma.", "tcgen05.",
         "setmaxnreg", "prefetch", "stmatrix", "elect", "griddepcontrol", "multimem.")
_MEM = _SIDE + ("ld.", "ldmatrix", "bra", "ret", "exit")
# repeating these changes nothing (a store of the same value, a fence, a sync all threads repeat)
_IDEMPOTENT = ("st.", "fence.", "bar.sync", "barrier.sync", "prefetch", "setmaxnreg", "wgmma.fence",
               "wgmma.wait", "tcgen05.wait", "tcgen05.fence", "stmatrix", "elect", "griddepcontrol")
_IDEMPOTENT_SELF = ("max", "min", "and", "or", "mov", "selp", "setp")
# ops that order memory or synchronise: swapping one with a memory access (or another) changes what
# is visible when; two plain loads, two mbarrier.inits or two stores to distinct slots do not
_SYNC = ("bar.", "barrier.", "fence.", "mbarrier.try_wait", "mbarrier.arrive", "mbarrier.expect_tx",
         "wgmma.", "tcgen05.", "cp.async.bulk.commit", "cp.async.bulk.wait", "atom.", "red.")
_CMP = {"lt": "le", "le": "lt", "gt": "ge", "ge": "gt", "eq": "ne", "ne": "eq", "lo": "ls", "ls": "lo",
        "hi": "hs", "hs": "hi"}
_OPC = {"add": "sub", "sub": "add", "min": "max", "max": "min", "and": "or", "or": "and", "shl": "shr",
        "shr": "shl"}


@dataclass(frozen=True)
class Mutant:
    op: str
    line: int  # 1-based PTX line edited (swap: the first of the two)
    before: str  # the line(s) as they were
    after: str  # what replaces them ("" for drop)

    def apply(self, lines: list[str]) -> str:
        n = 2 if self.op == "swap" else 1
        new = lines[:self.line - 1] + ([self.after] if self.op != "drop" else []) + lines[self.line - 1 + n:]
        return "\n".join(new)

    def label(self) -> str:
        return f"{self.op} @{self.line}"


def _split(line: str):
    m = _LINE.match(line)
    return m.groupdict() if m else None


def _operands(rest: str) -> list[str]:
    return [o.strip() for o in rest.split(",")] if rest.strip() else []


def _has_dest(opc: str) -> bool:
    return not opc.startswith(("st.", "red.", "bar.", "barrier.", "fence.", "bra", "ret", "exit", "cp.",
                               "prefetch", "setmaxnreg", "tcgen05.commit", "tcgen05.wait", "wgmma.fence",
                               "wgmma.commit", "wgmma.wait", "mbarrier.init", "mbarrier.expect_tx",
                               "stmatrix"))


def _side(opc: str) -> bool:
    return opc.startswith(_SIDE)


def _touches(opc: str) -> bool:
    return opc.startswith(_MEM)


def _dependent(opc_a, guard_a, rest_a, opc_b, guard_b, rest_b) -> bool:
    """Does the order of two adjacent instructions matter: one writes a register the other reads or
    writes, or one synchronises / orders memory and the other touches memory (or is a branch)?"""
    ra, rb = _operands(rest_a), _operands(rest_b)
    da = set(_REG.findall(ra[0])) if ra and _has_dest(opc_a) else set()
    db = set(_REG.findall(rb[0])) if rb and _has_dest(opc_b) else set()
    ua, ub = set(_REG.findall(guard_a + rest_a)), set(_REG.findall(guard_b + rest_b))
    if da & ub or db & ua:
        return True
    return (opc_a.startswith(_SYNC) and _touches(opc_b)) or (opc_b.startswith(_SYNC) and _touches(opc_a))


def mutants(text: str, mods: dict, rng: random.Random) -> dict[str, list[Mutant]]:
    """Every mutant of every op over the entries' instruction lines (one parse of the file: `mods` is
    parse_for_manifest's result)."""
    lines = text.split("\n")
    out = {op: [] for op in OPS}
    for mod in mods.values():
        inst_lines = sorted({i.line for i in mod.instrs})
        is_inst = set(inst_lines)
        regs_by_type: dict[str, list[str]] = {}
        for name, rtype in mod.regs.items():
            regs_by_type.setdefault(rtype, []).append(name)
        for ln in inst_lines:
            s = lines[ln - 1]
            p = _split(s)
            if p is None:
                continue
            ind, guard, opc, rest, tail = p["ind"], p["guard"] or "", p["opc"], p["rest"], p["tail"]
            ops = _operands(rest)
            out["drop"].append(Mutant("drop", ln, s, ""))
            parts = opc.split(".")
            srcs = ops[1:] if _has_dest(opc) and ops else ops
            self_update = bool(ops) and _has_dest(opc) and any(
                ops[0].strip("{}") in _REG.findall(o) for o in srcs)
            if (_side(opc) and not opc.startswith(_IDEMPOTENT)) or (self_update and parts[0] not in _IDEMPOTENT_SELF):
                out["dup"].append(Mutant("dup", ln, s, s + "\n" + s))
            nxt = ln + 1
            if nxt in is_inst:
                q = _split(lines[nxt - 1])
                if q is not None and _dependent(opc, guard, rest, q["opc"], q["guard"] or "", q["rest"]):
                    out["swap"].append(Mutant("swap", ln, s + "\n" + lines[nxt - 1], lines[nxt - 1] + "\n" + s))
            for m in _INT.finditer(rest):
                sign, digits = m.group(1), m.group(2)
                v = int(digits, 16) if digits.startswith("0x") else int(digits)
                v = -v if sign else v
                news = {v + 1, v - 1} if v != 0 else {1}
                if v >= 8 and v % 8 == 0:
                    news |= {v + 8, v - 8}
                for nv in sorted(news):
                    spelled = str(nv) if not digits.startswith("0x") else (hex(nv) if nv >= 0 else str(nv))
                    r2 = rest[:m.start()] + spelled + rest[m.end():]
                    out["imm"].append(Mutant("imm", ln, s, f"{ind}{guard}{opc}{r2};{tail}"))
            if parts[0] == "setp" and len(parts) > 1 and parts[1] in _CMP:
                o2 = ".".join([parts[0], _CMP[parts[1]]] + parts[2:])
                out["cmp"].append(Mutant("cmp", ln, s, f"{ind}{guard}{o2}{rest};{tail}"))
            if guard:
                g2 = guard.replace("@!", "@") if guard.startswith("@!") else guard.replace("@", "@!", 1)
                out["neg"].append(Mutant("neg", ln, s, f"{ind}{g2}{opc}{rest};{tail}"))
            if parts[0] in _OPC and len(parts) > 1:
                o2 = ".".join([_OPC[parts[0]]] + parts[1:])
                out["opc"].append(Mutant("opc", ln, s, f"{ind}{guard}{o2}{rest};{tail}"))
            if parts[0] == "selp" and len(ops) == 4 and ops[1] != ops[2]:
                r2 = " " + ", ".join([ops[0], ops[2], ops[1], ops[3]])
                out["opc"].append(Mutant("opc", ln, s, f"{ind}{guard}{opc}{r2};{tail}"))
            # one source register swapped for another of its declared type
            for k, o in enumerate(ops):
                if k == 0 and _has_dest(opc):
                    continue
                for rm in _REG.finditer(o):
                    name = rm.group(0)
                    pool = [r for r in regs_by_type.get(mod.regs.get(name, ""), []) if r != name]
                    if not pool:
                        continue
                    other = rng.choice(pool)
                    o2 = o[:rm.start()] + other + o[rm.end():]
                    r2 = " " + ", ".join(ops[:k] + [o2] + ops[k + 1:])
                    out["reg"].append(Mutant("reg", ln, s, f"{ind}{guard}{opc}{r2};{tail}"))
    return out


@dataclass
class Verdict:
    op: str
    line: int
    before: str
    after: str
    result: str  # "check", "emulate:<finding>", "unparsed", "crash", "invalid" (ptxas), "survived"
    detail: str = ""
    seconds: float = 0.0


_STATE: dict = {}


def _init(text, man, seeds, ctas, step_limit, both):
    _STATE.update(lines=text.split("\n"), man=man, seeds=seeds, ctas=ctas, step_limit=step_limit, both=both)


def judge(m: Mutant) -> Verdict:
    """check, then (if it passes, or with both=True always) emulate on the default cases."""
    from .check import CheckUsageError, check_ptx
    from .ptxemu import harness
    from .ptxemu.parse import PtxSyntaxError

    st = _STATE
    t0 = time.perf_counter()
    text = m.apply(st["lines"])
    v = Verdict(m.op, m.line, m.before, m.after, "survived")
    killed = []
    try:
        rep = check_ptx(text, st["man"])
        if not rep.ok:
            said = rep.summary().splitlines()
            killed.append(("check", next((x.strip() for x in said if x.lstrip().startswith("[")), said[0])[:200]))
    except CheckUsageError as e:
        killed.append(("check", f"unreadable: {e}"))
    except Exception as e:  # a crash of the checker on an edited file is itself a finding
        killed.append(("crash", f"check: {type(e).__name__}: {e}"))
    if not killed or st["both"]:
        try:
            rep = harness.emulate_file("mutant.ptx", ptx_text=text, manifest=st["man"], seeds=st["seeds"],
                                       ctas=st["ctas"], step_limit=st["step_limit"], stop_on_failure=True)
            if not rep.ok:
                bad = next(r for r in rep.runs if not r.ok)
                killed.append((f"emulate:{bad.finding or bad.kind}", (bad.report or "").splitlines()[0][:200]
                               if bad.report else ""))
        except PtxSyntaxError as e:
            killed.append(("unparsed", str(e)[:200]))
        except Exception as e:
            killed.append(("crash", f"emulate: {type(e).__name__}: {e}"[:300]))
    if killed:
        v.result, v.detail = killed[0]
        if len(killed) > 1:
            v.detail += " | also " + ", ".join(k for k, _ in killed[1:])
    v.seconds = time.perf_counter() - t0
    return v


def ptxas_accepts(text: str, arch: str) -> tuple[bool, str]:
    """(does ptxas assemble `text` for `arch`, its first error line): the project's own ptxas run
    (assemble._run_ptxas: its flags, its time limit, the process group killed on a timeout)."""
    from ..assemble.assemble import _run_ptxas, ptxas_timeout_s

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.ptx"
        p.write_text(text)
        cubin, log, timed_out = _run_ptxas(p, Path(d) / "m.cubin", arch, (), ptxas_timeout_s())
        if cubin is not None:
            return True, ""
        errors = [ln for ln in log.splitlines() if "error" in ln.lower()] or log.strip().splitlines() or ["failed"]
        return False, errors[-1 if timed_out else 0].strip()


def _unedited(ptx_path: Path, seeds: int, ctas: int) -> tuple[str, dict, int]:
    """(PTX text, manifest, step limit) of the file a sweep edits: it must pass `fa4gen check` and
    `fa4gen emulate` as it is; the step limit is 8x its longest default run (at least 200k), where an
    edit that loops forever stops."""
    from .check import check_ptx
    from .ptxemu import harness

    man = harness.load_manifest(ptx_path, None)
    text = ptx_path.read_text()
    if not check_ptx(text, man).ok:
        raise RuntimeError(f"{ptx_path} does not pass fa4gen check as it is: sweep a file that does")
    rep = harness.emulate_file(ptx_path, ptx_text=text, manifest=man, seeds=seeds, ctas=ctas)
    if not rep.ok:
        raise RuntimeError(f"{ptx_path} does not pass fa4gen emulate as it is: sweep a file that does")
    return text, man, max(200_000, 8 * max(r.warp_instructions for r in rep.runs))


def run_sweep(ptx_path: Path, *, ops=OPS, per_op: int | None = 60, seed: int = 0, jobs: int = 2, seeds: int = 2,
              ctas: int = 2, both: bool = False, assemble: bool = True, lines: tuple | None = None,
              progress=None) -> dict:
    """Sweep `ptx_path` (its manifest beside it): per op a seeded sample of `per_op` edits (None: all),
    restricted to PTX `lines` (first, last) if given, each judged by `judge` in `jobs` processes;
    survivors (and edits the emulator cannot parse) that ptxas rejects become "invalid". The emulator
    runs `seeds` seeds on the default shapes with `ctas` CTAs and a step limit of 8x the unedited
    file's longest run (an edit that loops forever stops there)."""
    from ..assemble.assemble import find_ptxas
    from .ptxemu.parse import parse_for_manifest

    text, man, step_limit = _unedited(ptx_path, seeds, ctas)
    rng = random.Random(seed)
    every = mutants(text, parse_for_manifest(text, man), rng)
    chosen: list[Mutant] = []
    totals = {}
    for op in ops:
        ms = [m for m in every[op] if lines is None or lines[0] <= m.line <= lines[1]]
        totals[op] = len(ms)
        chosen += ms if per_op is None or len(ms) <= per_op else rng.sample(ms, per_op)
    verdicts = _judge_all(chosen, (text, man, seeds, ctas, step_limit, both), jobs, progress)
    ptxas = assemble and find_ptxas() is not None
    src = text.split("\n")
    for v in verdicts:  # a survivor, or an edit the emulator cannot read: is it PTX at all?
        if v.result in ("survived", "unparsed") and ptxas:
            ok, why = ptxas_accepts(Mutant(v.op, v.line, v.before, v.after).apply(src), man["config"]["arch"])
            if not ok:
                v.result, v.detail = "invalid", f"ptxas: {why}"
    verdicts.sort(key=lambda v: (v.op, v.line, v.after))
    return {"file": str(ptx_path), "kernel": man.get("name"), "ops": list(ops), "per_op": per_op, "seed": seed,
            "seeds": seeds, "ctas": ctas, "step_limit": step_limit, "sites": totals,
            "assembled_survivors": ptxas, "verdicts": [asdict(v) for v in verdicts]}


def replay(res: dict, *, jobs: int = 2, progress=None) -> dict:
    """Judge the survivors of an earlier sweep (its JSON) again with the evidence as it is now: the
    same edits of the same file; a result like run_sweep's, of those mutants alone."""
    ptx_path = Path(res["file"])
    src = ptx_path.read_text().split("\n")
    again = [Mutant(v["op"], v["line"], v["before"], v["after"]) for v in res["verdicts"] if v["result"] == "survived"]
    stale = [m for m in again if "\n".join(src[m.line - 1:m.line - 1 + (2 if m.op == "swap" else 1)]) != m.before]
    if stale:
        raise RuntimeError(f"{ptx_path} changed since the sweep: {stale[0].label()} no longer reads {stale[0].before!r}")
    text, man, step_limit = _unedited(ptx_path, res["seeds"], res["ctas"])
    verdicts = _judge_all(again, (text, man, res["seeds"], res["ctas"], step_limit, False), jobs, progress)
    verdicts.sort(key=lambda v: (v.op, v.line, v.after))
    return dict(res, step_limit=step_limit, sites={op: sum(m.op == op for m in again) for op in res["ops"]},
                verdicts=[asdict(v) for v in verdicts])


def _judge_all(chosen: list, args: tuple, jobs: int, progress) -> list:
    import multiprocessing as mp

    verdicts = []
    if jobs > 1 and len(chosen) > 1:
        pool = mp.get_context("fork").Pool(jobs, initializer=_init, initargs=args)
        it = pool.imap_unordered(judge, chosen, chunksize=1)
    else:
        _init(*args)
        pool, it = None, map(judge, chosen)
    try:
        for k, v in enumerate(it, 1):
            verdicts.append(v)
            if progress:
                progress(k, len(chosen), v)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return verdicts


def summary(res: dict) -> str:
    rows = {}
    for v in res["verdicts"]:
        r = rows.setdefault(v["op"], {"n": 0, "check": 0, "emulate": 0, "other": 0, "invalid": 0, "survived": 0})
        r["n"] += 1
        key = v["result"].split(":")[0]
        r[key if key in r else "other"] += 1
    out = [f"{res['kernel']}: {sum(r['n'] for r in rows.values())} mutants "
           f"(seeds {res['seeds']}, ctas {res['ctas']}, step limit {res['step_limit']:,})",
           f"{'op':6s} {'sites':>6s} {'run':>5s} {'check':>6s} {'emulate':>8s} {'other':>6s} {'invalid':>8s} {'survived':>9s}"]
    for op in res["ops"]:
        r = rows.get(op)
        if r:
            out.append(f"{op:6s} {res['sites'][op]:6d} {r['n']:5d} {r['check']:6d} {r['emulate']:8d} {r['other']:6d} "
                       f"{r['invalid']:8d} {r['survived']:9d}")
    surv = [v for v in res["verdicts"] if v["result"] == "survived"]
    odd = [v for v in res["verdicts"] if v["result"] in ("crash", "unparsed")]
    if surv:
        out.append("survivors (equivalent edits, or holes in the evidence):")
        for v in surv:
            out.append(f"  {v['op']} line {v['line']}:")
            out += [f"    - {x.strip()}" for x in v["before"].split("\n")]
            out += [f"    + {x.strip()}" for x in v["after"].split("\n") if v["after"]]
    if odd:
        out.append("killed only by a parse error or a crash (not by a judgement):")
        out += [f"  {v['op']} line {v['line']}: {v['result']}: {v['detail']}" for v in odd]
    return "\n".join(out)


def write_survivors(res: dict, ptx_path: Path, out_dir: Path) -> list[Path]:
    """Each surviving mutant as its own PTX file with the manifest beside it (fa4gen emulate / check run
    on it as on any file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    src = ptx_path.read_text().split("\n")
    written = []
    for v in res["verdicts"]:
        if v["result"] != "survived":
            continue
        stem = f"{ptx_path.stem}__{v['op']}_{v['line']}_{len(written)}"
        (out_dir / f"{stem}.ptx").write_text(Mutant(v["op"], v["line"], v["before"], v["after"]).apply(src))
        shutil.copyfile(ptx_path.with_suffix(".json"), out_dir / f"{stem}.json")
        written.append(out_dir / f"{stem}.ptx")
    return written


def dump(res: dict, path: Path) -> None:
    path.write_text(json.dumps(res, indent=1) + "\n")
