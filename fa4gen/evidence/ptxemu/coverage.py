"""Which paths of a PTX entry an emulation took: its basic blocks and the directions of its branches,
by warp role.

A pass of `fa4gen emulate` proves the paths it ran and nothing else, so every run records, per warp,
each instruction it executed and, per branch, whether lanes took it, fell through, or both. This
module cuts an entry into basic blocks (a leader is the first instruction, a branch target, or the
instruction after a branch or an exit), folds the per-warp records into roles (the manifest's warp
roles; one role "all" for entries without a role table, like the KV-cache combine kernel), merges runs,
and says what was not reached.

A data-dependent branch is a guarded `bra` (`@%p bra L`): both of its directions are paths. An
unguarded `bra` has one direction, and its block's coverage says whether it ran.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TAKEN, FALLTHROUGH = 1, 2  # per-branch direction bits
BOUNDARY = 4  # per ordered integer comparison (setp lt/le/gt/ge/lo/ls/hi/hs): met with a == b
ENABLED = 8  # per guarded instruction other than a branch: its guard let some lane through
ORDERED = ("lt", "le", "gt", "ge", "lo", "ls", "hi", "hs")  # the setp comparisons a bound off by one changes


@dataclass(frozen=True)
class BasicBlock:
    index: int
    start: int  # first instruction index
    end: int  # one past the last
    first_line: int  # PTX source lines
    last_line: int
    label: str  # the label at its start, or "" (a fall-through block)

    def describe(self) -> str:
        where = f"PTX lines {self.first_line}-{self.last_line}" if self.last_line != self.first_line else \
            f"PTX line {self.first_line}"
        return f"{self.label or '(after line ' + str(self.first_line - 1) + ')'} ({where})"


def basic_blocks(mod) -> list[BasicBlock]:
    """The basic blocks of a parsed entry (parse.Module), in program order."""
    instrs = mod.instrs
    n = len(instrs)
    if n == 0:
        return []
    leaders = {0}
    leaders.update(i for i in mod.labels.values() if i < n)
    for i, ins in enumerate(instrs):
        head = ins.opcode.split(".")[0]
        if head in ("bra", "ret", "exit") and i + 1 < n:
            leaders.add(i + 1)
    by_pc = {}
    for name, i in sorted(mod.labels.items(), key=lambda kv: kv[0]):
        by_pc.setdefault(i, name)
    starts = sorted(leaders)
    out = []
    for k, s in enumerate(starts):
        e = starts[k + 1] if k + 1 < len(starts) else n
        out.append(BasicBlock(k, s, e, instrs[s].line, instrs[e - 1].line, by_pc.get(s, "")))
    return out


def guarded_branches(mod) -> list[int]:
    """Instruction indices of the data-dependent branches (guarded bra)."""
    return [i for i, ins in enumerate(mod.instrs) if ins.opcode.split(".")[0] == "bra" and ins.guard is not None]


def ordered_comparisons(mod) -> list[int]:
    """Instruction indices of the ordered integer comparisons (setp lt/le/gt/ge/lo/ls/hi/hs on an
    integer type): a bound off by one changes them only where a == b."""
    out = []
    for i, ins in enumerate(mod.instrs):
        p = ins.opcode.split(".")
        if p[0] == "setp" and len(p) > 2 and p[1] in ORDERED and p[-1] not in ("f32", "f64", "f16"):
            out.append(i)
    return out


def guarded_instructions(mod) -> list[int]:
    """Instruction indices of the guarded instructions other than branches (`@%p st.global ...`): one
    whose guard is never true ran nowhere, though its block did."""
    return [i for i, ins in enumerate(mod.instrs) if ins.guard is not None and ins.opcode.split(".")[0] != "bra"]


@dataclass
class EntryCoverage:
    """One entry's coverage over one or more runs: per role, the instructions executed (bool per
    instruction) and the branch directions seen (TAKEN | FALLTHROUGH bits per instruction)."""

    entry: str
    blocks: list
    branches: list
    lines: list  # PTX line of each instruction
    hits: dict = field(default_factory=dict)  # role -> np.bool_ array
    dirs: dict = field(default_factory=dict)  # role -> np.uint8 array (TAKEN | FALLTHROUGH | BOUNDARY bits)
    comparisons: list = field(default_factory=list)  # ordered_comparisons(mod)
    guarded: list = field(default_factory=list)  # guarded_instructions(mod)

    @classmethod
    def of_run(cls, mod, warp_hits, warp_dirs, role_of) -> "EntryCoverage":
        """From an emulator's per-warp records; role_of(warp) names each warp's role."""
        cov = cls(mod.entry, basic_blocks(mod), guarded_branches(mod), [ins.line for ins in mod.instrs],
                  comparisons=ordered_comparisons(mod), guarded=guarded_instructions(mod))
        n = len(mod.instrs)
        for w, (h, d) in enumerate(zip(warp_hits, warp_dirs)):
            role = role_of(w)
            hv = np.frombuffer(bytes(h), np.uint8)[:n].astype(bool)
            dv = np.frombuffer(bytes(d), np.uint8)[:n]
            if role in cov.hits:
                cov.hits[role] |= hv
                cov.dirs[role] |= dv
            else:
                cov.hits[role], cov.dirs[role] = hv.copy(), dv.copy()
        return cov

    def merge(self, other: "EntryCoverage") -> None:
        if other.entry != self.entry or len(other.lines) != len(self.lines):
            raise ValueError(f"coverage of {other.entry} ({len(other.lines)} instructions) cannot merge into "
                             f"{self.entry} ({len(self.lines)})")
        for role, h in other.hits.items():
            if role in self.hits:
                self.hits[role] = self.hits[role] | h
                self.dirs[role] = self.dirs[role] | other.dirs[role]
            else:
                self.hits[role], self.dirs[role] = h.copy(), other.dirs[role].copy()

    # ---- what was reached -------------------------------------------------------------------------
    def _any(self, table, dtype) -> np.ndarray:
        out = np.zeros(len(self.lines), dtype)
        for v in table.values():
            out |= v
        return out

    def reached_blocks(self, role: str | None = None) -> list:
        h = self._any(self.hits, bool) if role is None else self.hits.get(role, np.zeros(len(self.lines), bool))
        return [b for b in self.blocks if h[b.start]]

    def unreached_blocks(self) -> list:
        h = self._any(self.hits, bool)
        return [b for b in self.blocks if not h[b.start]]

    def branch_directions(self) -> dict:
        """pc -> the direction bits seen, over every role, for each guarded branch."""
        d = self._any(self.dirs, np.uint8)
        return {pc: int(d[pc]) & (TAKEN | FALLTHROUGH) for pc in self.branches}

    def one_way_branches(self) -> list:
        """(pc, bits) of the guarded branches that ran in one direction only (bits 0: never ran)."""
        return [(pc, bits) for pc, bits in self.branch_directions().items() if bits != TAKEN | FALLTHROUGH]

    def boundary_misses(self) -> list[int]:
        """pcs of the ordered integer comparisons never met at a == b (by any role)."""
        d = self._any(self.dirs, np.uint8)
        return [pc for pc in self.comparisons if not d[pc] & BOUNDARY]

    def boundary_fraction(self) -> tuple[int, int]:
        n = len(self.comparisons)
        return n - len(self.boundary_misses()), n

    def never_enabled(self) -> list[int]:
        """pcs of the guarded instructions (not branches) whose guard no lane ever passed."""
        d = self._any(self.dirs, np.uint8)
        return [pc for pc in self.guarded if not d[pc] & ENABLED]

    def enabled_fraction(self) -> tuple[int, int]:
        return len(self.guarded) - len(self.never_enabled()), len(self.guarded)

    def block_fraction(self) -> tuple[int, int]:
        return len(self.blocks) - len(self.unreached_blocks()), len(self.blocks)

    def branch_fraction(self) -> tuple[int, int]:
        return len(self.branches) - len(self.one_way_branches()), len(self.branches)

    def summary(self, limit: int = 12) -> list[str]:
        hb, nb = self.block_fraction()
        hd, nd = self.branch_fraction()
        he, ne = self.boundary_fraction()
        hg, ng = self.enabled_fraction()
        out = [f"{self.entry}: {hb}/{nb} basic blocks, {hd}/{nd} data-dependent branches both ways, "
               f"{he}/{ne} ordered comparisons met at their boundary, {hg}/{ng} guarded instructions enabled"]
        for role in sorted(self.hits):
            out.append(f"  {role}: {len(self.reached_blocks(role))} blocks")
        word = {0: "never ran", TAKEN: "always taken", FALLTHROUGH: "never taken"}

        def listed(title, rows):  # a titled list of at most `limit` rows
            if rows:
                out.append(f"  {title}")
                out.extend(f"    {r}" for r in rows[:limit])
                if len(rows) > limit:
                    out.append(f"    ... and {len(rows) - limit} more")
        un = self.unreached_blocks()
        listed(f"not reached ({len(un)}):", [b.describe() for b in un])
        one = self.one_way_branches()
        listed(f"branches not seen both ways ({len(one)}):", [f"PTX line {self.lines[pc]}: {word[bits]}" for pc, bits in one])
        miss = self.boundary_misses()
        listed(f"comparisons never met at a == b ({len(miss)}; an off-by-one there would not show):",
               [f"PTX line {self.lines[pc]}" for pc in miss])
        off = self.never_enabled()
        listed(f"guarded instructions never enabled ({len(off)}; they ran nowhere):",
               [f"PTX line {self.lines[pc]}" for pc in off])
        return out

    def as_dict(self) -> dict:
        hb, nb = self.block_fraction()
        hd, nd = self.branch_fraction()
        return {"entry": self.entry, "blocks": [hb, nb], "branches_both_ways": [hd, nd],
                "roles": {r: len(self.reached_blocks(r)) for r in sorted(self.hits)},
                "unreached": [{"label": b.label, "lines": [b.first_line, b.last_line]} for b in self.unreached_blocks()],
                "one_way": [{"line": self.lines[pc], "bits": bits} for pc, bits in self.one_way_branches()],
                "boundaries": list(self.boundary_fraction()),
                "boundary_misses": [self.lines[pc] for pc in self.boundary_misses()],
                "guards_enabled": list(self.enabled_fraction()),
                "never_enabled": [self.lines[pc] for pc in self.never_enabled()]}


class Coverage:
    """Coverage of a module's entries over the runs merged into it."""

    def __init__(self):
        self.entries: dict = {}

    def add(self, cov: EntryCoverage) -> None:
        if cov.entry in self.entries:
            self.entries[cov.entry].merge(cov)
        else:
            self.entries[cov.entry] = EntryCoverage(cov.entry, cov.blocks, cov.branches, cov.lines,
                                                    {r: h.copy() for r, h in cov.hits.items()},
                                                    {r: d.copy() for r, d in cov.dirs.items()}, cov.comparisons,
                                                    cov.guarded)

    def merge(self, other: "Coverage") -> None:
        for cov in other.entries.values():
            self.add(cov)

    @property
    def complete(self) -> bool:
        return all(not c.unreached_blocks() and not c.one_way_branches() for c in self.entries.values())

    def summary(self, limit: int = 12) -> str:
        return "\n".join(line for c in self.entries.values() for line in c.summary(limit))

    def as_dict(self) -> dict:
        return {name: c.as_dict() for name, c in self.entries.items()}
