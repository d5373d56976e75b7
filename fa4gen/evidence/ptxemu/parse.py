"""Parse the PTX subset fa4gen emits into a flat instruction list (no regeneration, no templates).

The emulator executes exactly what the file on disk says, so the parser keeps every instruction
with its source line. Anything outside the subset fails here or when the executor compiles the
instruction: "unsupported instruction X at line N" (PtxSyntaxError / UnsupportedInstruction).
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field


class PtxSyntaxError(Exception):
    """The text is not PTX the emulator can read (with the line)."""


class UnsupportedInstruction(PtxSyntaxError):
    """A well-formed instruction the emulator does not model."""


# ---- operands ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reg:
    name: str


@dataclass(frozen=True)
class SReg:
    name: str  # %tid.x, %ctaid.x, ...


@dataclass(frozen=True)
class Imm:
    value: int  # integer immediate (may be negative)


@dataclass(frozen=True)
class FImm:
    bits: int  # 0fXXXXXXXX: f32 bit pattern
    double: bool = False


@dataclass(frozen=True)
class Sym:
    name: str  # a label, a param, or the shared symbol


@dataclass(frozen=True)
class Sink:
    pass


@dataclass(frozen=True)
class Vec:
    items: tuple


@dataclass(frozen=True)
class Addr:
    base: object  # Reg or Sym
    offset: int


@dataclass(frozen=True)
class TmaAddr:
    tmap: object  # Reg
    coords: tuple


@dataclass(frozen=True)
class PredPair:
    first: object  # Sink or Reg
    pred: Reg


@dataclass
class Instr:
    line: int
    opcode: str  # e.g. "mbarrier.try_wait.parity.shared::cta.b64"
    operands: tuple
    guard: str | None = None  # predicate register name
    guard_neg: bool = False
    text: str = ""

    @property
    def parts(self) -> list[str]:
        return self.opcode.split(".")


@dataclass
class Param:
    name: str
    type: str  # ".u32", ".u64", ".f32", ".b8"
    size: int
    align: int


@dataclass
class Module:
    version: str
    target: str
    entry: str
    params: list[Param]
    regs: dict  # name -> type (".b32", ".f32", ".b64", ".pred", ...)
    instrs: list[Instr]
    labels: dict  # label -> instruction index
    shared_symbols: dict  # name -> alignment
    maxntid: int | None = None
    maxnreg: int | None = None
    directives: dict = field(default_factory=dict)
    lines: tuple | None = None  # (first, last) source line of the entry: its .entry line to its closing brace
    # compiled programs of this entry by (parameter layout, delays, options): emulator.Emulator fills it
    programs: dict = field(default_factory=dict, repr=False, compare=False)


_REG_TYPES = {".pred", ".b8", ".b16", ".b32", ".b64", ".u8", ".u16", ".u32", ".u64", ".s8", ".s16",
              ".s32", ".s64", ".f16", ".f16x2", ".bf16", ".bf16x2", ".f32", ".f64"}
_TYPE_BYTES = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
               "b32": 4, "u32": 4, "s32": 4, "f32": 4, "f16x2": 4, "bf16x2": 4, "b64": 8, "u64": 8,
               "s64": 8, "f64": 8}

_SPECIAL = {"%tid.x", "%tid.y", "%tid.z", "%ntid.x", "%ntid.y", "%ntid.z", "%ctaid.x", "%ctaid.y",
            "%ctaid.z", "%nctaid.x", "%nctaid.y", "%nctaid.z", "%laneid", "%warpid", "%nwarpid"}


def _strip_comments(text: str) -> list[str]:
    # keep line numbers: replace block comments by as many newlines as they span
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return [_LINE_COMMENT_RE.sub("", ln) if "//" in ln else ln for ln in text.split("\n")]


# the per-statement patterns, compiled once (a kernel is thousands of statements)
_LINE_COMMENT_RE = re.compile(r"//.*")
_GUARD_RE = re.compile(r"^@(!?)(%[A-Za-z0-9_$]+)\s+(.*)$", re.S)
_OPCODE_RE = re.compile(r"^([a-z][a-z0-9_.:]*)\s*(.*)$", re.S)
_LABEL_RE = re.compile(r"^([$A-Za-z_][\w$]*):\s*(.*)$")


def _split_top(s: str) -> list[str]:
    """Split on commas outside {} and []."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    tail = "".join(cur).strip()
    if tail:
        out.append(tail)
    return out


_INT_RE = re.compile(r"^[+-]?(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)U?$")
_NAME_RE = re.compile(r"^[A-Za-z_$%][A-Za-z0-9_$.]*$")


def _parse_int(tok: str) -> int:
    t = tok.rstrip("U")
    neg = t.startswith("-")
    t = t.lstrip("+-")
    if t.lower().startswith("0x"):
        v = int(t, 16)
    elif len(t) > 1 and t.startswith("0"):
        v = int(t, 8)
    else:
        v = int(t)
    return -v if neg else v


def parse_operand(tok: str, line: int):
    tok = tok.strip()
    if tok == "_":
        return Sink()
    if tok.startswith("{") and tok.endswith("}"):
        inner = tok[1:-1].strip()
        return Vec(tuple(parse_operand(t, line) for t in _split_top(inner)))
    if tok.startswith("[") and tok.endswith("]"):
        inner = tok[1:-1].strip()
        parts = _split_top(inner)
        if len(parts) == 2:  # [tmap, {coords}]
            base = parse_operand(parts[0], line)
            coords = parse_operand(parts[1], line)
            if not isinstance(coords, Vec):
                raise PtxSyntaxError(f"line {line}: expected {{coords}} in {tok!r}")
            return TmaAddr(base, coords.items)
        m = re.match(r"^([%A-Za-z_$][A-Za-z0-9_$.]*)\s*(?:([+-])\s*(\S+))?$", inner)
        if m:
            base = parse_operand(m.group(1), line)
            off = 0
            if m.group(2):
                off = _parse_int(m.group(3))
                if m.group(2) == "-":
                    off = -off
            return Addr(base, off)
        if _INT_RE.match(inner):
            return Addr(None, _parse_int(inner))
        raise PtxSyntaxError(f"line {line}: cannot read address {tok!r}")
    if "|" in tok:
        a, b = tok.split("|", 1)
        return PredPair(parse_operand(a, line), parse_operand(b, line))
    m = re.match(r"^0([fF])([0-9a-fA-F]{8})$", tok)
    if m:
        return FImm(int(m.group(2), 16))
    m = re.match(r"^0([dD])([0-9a-fA-F]{16})$", tok)
    if m:
        bits = int(m.group(2), 16)
        f = struct.unpack("<d", struct.pack("<Q", bits))[0]
        return FImm(struct.unpack("<I", struct.pack("<f", f))[0], double=True)
    if _INT_RE.match(tok):
        return Imm(_parse_int(tok))
    if re.match(r"^[+-]?\d+\.\d*([eE][+-]?\d+)?$", tok):
        return FImm(struct.unpack("<I", struct.pack("<f", float(tok)))[0])
    if tok in _SPECIAL:
        return SReg(tok)
    if tok.startswith("%"):
        return Reg(tok)
    if _NAME_RE.match(tok):
        return Sym(tok)
    raise PtxSyntaxError(f"line {line}: cannot read operand {tok!r}")


_OPERANDS: dict = {}  # operand list text -> parsed operands (immutable): shared by every parse


def _operands(rest: str, line: int) -> tuple:
    """The operands of one statement. Memoised on the text: the same operand lists recur within a
    kernel and across the kernels a session parses (a mutated kernel is its original but a line).
    Only a successful parse is stored (an error names its line); the operand objects are frozen."""
    ops = _OPERANDS.get(rest)
    if ops is None:
        ops = tuple(parse_operand(t, line) for t in _split_top(rest))
        if len(_OPERANDS) >= 1 << 18:
            _OPERANDS.clear()
        _OPERANDS[rest] = ops
    return ops


def _expand_reg_decl(decl: str, line: int) -> list[tuple[str, str]]:
    m = re.match(r"^\.reg\s+(\.\w+)\s+(.*)$", decl.strip())
    if not m:
        raise PtxSyntaxError(f"line {line}: bad .reg declaration {decl!r}")
    rtype, names = m.group(1), m.group(2)
    if rtype not in _REG_TYPES:
        raise UnsupportedInstruction(f"unsupported register type {rtype} at line {line}")
    out = []
    for n in _split_top(names):
        mm = re.match(r"^(%[A-Za-z_$][A-Za-z0-9_$]*)<(\d+)>$", n)
        if mm:
            out.extend((f"{mm.group(1)}{i}", rtype) for i in range(int(mm.group(2))))
        elif re.match(r"^%[A-Za-z_$][A-Za-z0-9_$]*$", n):
            out.append((n, rtype))
        else:
            raise PtxSyntaxError(f"line {line}: bad register name {n!r}")
    return out


def parse(text: str, entry: str | None = None) -> Module:
    """The Module of one kernel entry of the file. entry=None: the file must hold exactly one
    .entry (a module of several is refused: say which one); a name picks that entry, and the
    file's other entries must still parse. Callers that have the manifest use `parse_for_manifest`,
    which also holds the file to the entries the manifest declares."""
    mods = parse_entries(text)
    if entry is None:
        if len(mods) != 1:
            raise PtxSyntaxError(f"{len(mods)} .entry directives ({', '.join(mods)}): name the kernel to run "
                                 "(parse(text, entry=...)) or pass the manifest that declares them")
        return next(iter(mods.values()))
    if entry not in mods:
        raise PtxSyntaxError(f"no .entry {entry} in the file (entries: {', '.join(mods) or 'none'})")
    return mods[entry]


def manifest_entries(man: dict) -> tuple[str, ...]:
    """The kernel entries a build manifest declares, main kernel first: its "entry" (fa4_fwd when the
    manifest predates the key), plus the combine kernel of a KV-cache module ("kvcache" -> "combine")."""
    main = man.get("entry", "fa4_fwd")
    kv = man.get("kvcache")
    if kv:
        comb = (kv.get("combine") or {}).get("entry")
        if not comb:
            raise PtxSyntaxError("the manifest's \"kvcache\" record names no combine entry")
        return (main, comb)
    return (main,)


def parse_for_manifest(text: str, man: dict) -> dict:
    """{entry name: Module} for every entry of the file, which must be exactly the entries the
    manifest declares (a KV-cache module: fa4_fwd and fa4_combine; any other module: its one
    kernel). A missing or an extra entry is a PtxSyntaxError naming it."""
    mods = parse_entries(text)
    want = manifest_entries(man)
    missing = [e for e in want if e not in mods]
    extra = [e for e in mods if e not in want]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"no .entry {', '.join(missing)}")
        if extra:
            parts.append(f"an .entry the manifest does not declare: {', '.join(extra)}")
        raise PtxSyntaxError("; ".join(parts) + f" (the manifest declares {', '.join(want)})")
    return {e: mods[e] for e in want}


@dataclass
class _Entry:
    name: str
    line: int
    params: list = field(default_factory=list)
    regs: dict = field(default_factory=dict)
    instrs: list = field(default_factory=list)
    labels: dict = field(default_factory=dict)
    directives: dict = field(default_factory=dict)
    maxntid: int | None = None
    maxnreg: int | None = None
    closed: bool = False  # its body's closing brace was read
    end: int = 0  # the line of that brace


def parse_entries(text: str) -> dict:
    """{entry name: Module}, in file order, for every .visible .entry of the text (at least one).
    Module-level directives (.version, .target, .address_size, .extern .shared) belong to every
    entry; registers, labels and instructions to their own."""
    lines = _strip_comments(text)
    # Statements end with ';' (instructions, directives) or are labels 'name:'; '{' '}' structure.
    version = target = None
    shared: dict = {}
    directives: dict = {}
    entries: dict = {}
    cur: _Entry | None = None
    buf, buf_line = "", 0
    in_params = False
    body_depth = 0

    def flush_stmt(stmt: str, ln: int):
        s = stmt.strip()
        if not s:
            return
        if s.startswith(".reg"):
            for name, rtype in _expand_reg_decl(s, ln):
                cur.regs[name] = rtype
            return
        if s.startswith("."):
            raise UnsupportedInstruction(f"unsupported directive {s.split()[0]} at line {ln}")
        guard, neg = None, False
        m = _GUARD_RE.match(s)
        if m:
            neg, guard, s = m.group(1) == "!", m.group(2), m.group(3)
        m = _OPCODE_RE.match(s)
        if not m:
            raise PtxSyntaxError(f"line {ln}: cannot read instruction {stmt.strip()!r}")
        opcode, rest = m.group(1), m.group(2).strip()
        ops = _operands(rest, ln) if rest else ()
        cur.instrs.append(Instr(ln, opcode, ops, guard, neg, " ".join(stmt.split())))

    for i, raw in enumerate(lines, start=1):
        ln = raw.strip()
        if not ln:
            continue
        if body_depth == 0:
            if ln.startswith(".version"):
                version = ln.split()[1]
                continue
            if ln.startswith(".target"):
                target = ln.split()[1].rstrip(",")
                continue
            if ln.startswith(".address_size"):
                directives["address_size"] = int(ln.split()[1])
                continue
            m = re.match(r"^\.extern\s+\.shared\s+\.align\s+(\d+)\s+\.b8\s+([A-Za-z_$][\w$]*)\[\]\s*;$", ln)
            if m:
                shared[m.group(2)] = int(m.group(1))
                continue
            m = re.match(r"^\.visible\s+\.entry\s+([A-Za-z_$][\w$]*)\s*\(\s*$", ln)
            if m:
                if cur is not None and not cur.closed:
                    raise PtxSyntaxError(f"line {i}: .entry {m.group(1)} before the body of .entry {cur.name}")
                if m.group(1) in entries:
                    raise PtxSyntaxError(f"line {i}: a second .entry named {m.group(1)} (first at line "
                                         f"{entries[m.group(1)].line})")
                cur = entries[m.group(1)] = _Entry(m.group(1), i)
                in_params = True
                continue
            if in_params:
                if ln.startswith(")"):
                    in_params = False
                    continue
                m = re.match(r"^\.param\s+(?:\.align\s+(\d+)\s+)?(\.\w+)\s+([A-Za-z_$][\w$]*)(?:\[(\d+)\])?\s*,?$", ln)
                if not m:
                    raise PtxSyntaxError(f"line {i}: cannot read parameter {ln!r}")
                ptype = m.group(2)
                n = int(m.group(4) or 1)
                size = _TYPE_BYTES[ptype[1:]] * n
                cur.params.append(Param(m.group(3), ptype, size, int(m.group(1) or _TYPE_BYTES[ptype[1:]])))
                continue
            if cur is not None and not cur.closed:
                m = re.match(r"^\.maxntid\s+(\d+)", ln)
                if m:
                    cur.maxntid = int(m.group(1))
                    continue
                m = re.match(r"^\.maxnreg\s+(\d+)", ln)
                if m:
                    cur.maxnreg = int(m.group(1))
                    continue
                if ln.startswith(".minnctapersm") or ln.startswith(".reqntid"):
                    cur.directives[ln.split()[0]] = ln.split()[1:]
                    continue
                if ln == "{":
                    body_depth = 1
                    continue
            raise UnsupportedInstruction(f"unsupported directive {ln.split()[0]} at line {i}")
        # inside the body
        while ln:
            if not buf:
                buf_line = i
                m = _LABEL_RE.match(ln)
                if m and not ln.startswith("."):
                    if m.group(1) in cur.labels:
                        raise PtxSyntaxError(f"line {i}: label {m.group(1)} defined twice")
                    cur.labels[m.group(1)] = len(cur.instrs)
                    ln = m.group(2).strip()
                    continue
                if ln == "}":
                    body_depth -= 1
                    cur.closed, cur.end = True, i
                    ln = ""
                    continue
                if ln == "{":
                    raise UnsupportedInstruction(f"unsupported nested scope '{{' at line {i}")
            j = ln.find(";")
            if j < 0:
                buf += " " + ln
                ln = ""
            else:
                flush_stmt(buf + " " + ln[:j], buf_line)
                buf = ""
                ln = ln[j + 1:].strip()
    if not entries:
        raise PtxSyntaxError("no .visible .entry in the file")
    if buf.strip():
        raise PtxSyntaxError(f"line {buf_line}: statement without ';'")
    open_ = [e.name for e in entries.values() if not e.closed]
    if open_:
        raise PtxSyntaxError(f".entry {open_[0]} has no closed body")
    return {e.name: Module(version or "?", target or "?", e.name, e.params, e.regs, e.instrs, e.labels, dict(shared),
                           e.maxntid, e.maxnreg, dict(directives, **e.directives), (e.line, e.end))
            for e in entries.values()}
