"""Pictures of a generated kernel (`fa4gen draw`): its memory map and the timeline of an emulated run.

Two steps each: the geometry, computed here from what the kernel publishes (plain data, what the tests
check), then the rendering with matplotlib (the optional `draw` extra, imported only to render).

- memory_map(manifest): the TMEM map (columns x lanes; S, O and the P regions aliased inside S) from
  the manifest's tmem_map, and the SMEM map (every slot of every region, the mbarriers, the TMEM
  address slot, the alignment slack) from its SMEM layout (ptxemu.cases.manifest_smem_layout: the
  manifest's smem_layout section, or for a manifest without one the section of its config's
  pipeline, ir/layout.py).
- trace_run(ptx, manifest): one CTA of the kernel in the emulator with its trace recorder
  (ptxemu/trace.py) on, on the smallest inputs that show two K/V blocks and an O rescale;
  timeline(manifest, events): one band per warp role of the manifest (a row per warp) with what it
  issued and what it waited on (barriers by name), and one band per asynchronous unit (TMA, the
  tensor core, TMEM loads and stores) with each operation from issue to landing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..spec.encodings import TMEM_LANES, tmem_lane_base_for_warp
from .ptxemu import harness
from .ptxemu.cases import manifest_smem_layout
from .ptxemu.trace import EXIT, ISSUE, WAIT, Recorder

__all__ = ["DrawError", "check_out", "require_matplotlib", "MemoryMap", "Rect", "Timeline", "TimelineBar", "default_trace_shape", "memory_map",
           "named_barrier_names", "render", "timeline", "trace_run"]

FORMATS = (".svg", ".png")
EXTRA_HINT = "pip install 'fa4gen[draw]' (matplotlib)"


class DrawError(Exception):
    """A picture that cannot be made (no matplotlib, an unknown file type, a run that failed)."""


# ---- the memory map -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rect:
    """One rectangle of a map. TMEM: x = 32-bit columns [x0, x1), y = lanes [y0, y1). SMEM: x = byte
    offsets from the aligned dynamic SMEM base [x0, x1), y = [0, 1)."""

    space: str  # "TMEM" | "SMEM"
    name: str  # the region ("KV"), barrier ("kv_full") or "tmem_addr" / "slack"
    x0: int
    x1: int
    y0: int = 0
    y1: int = 1
    slot: int | None = None  # the slot of a multi-slot region or barrier
    kind: str = "region"  # region | alias | barrier | tmem_addr | slack
    alias_of: str | None = None
    dtype: str = ""

    @property
    def label(self) -> str:
        return self.name if self.slot is None else f"{self.name}[{self.slot}]"


@dataclass
class MemoryMap:
    name: str
    arch: str
    tmem_cols: int  # columns allocated (0: no Tensor Memory, sm_90a)
    tmem_lanes: int
    smem_bytes: int  # dynamic SMEM requested at launch (used + alignment slack)
    smem_used: int
    rects: list = field(default_factory=list)
    lane_owners: dict = field(default_factory=dict)  # first lane of a 32-lane quarter -> "role wN" of its warps

    def of(self, space: str, kind: str | None = None) -> list:
        return [r for r in self.rects if r.space == space and (kind is None or r.kind == kind)]


def memory_map(man: dict) -> MemoryMap:
    """The TMEM and SMEM rectangles of the manifest's kernel (numbers only from the manifest / the layout)."""
    lay = manifest_smem_layout(man)
    tmem_cols = int(man.get("tmem_alloc_cols", 0))
    rects = []
    for t in man.get("tmem_map", []):
        c0, c1 = t["cols"]
        rects.append(Rect("TMEM", t["region"], c0, c1, 0, TMEM_LANES, kind="alias" if t["alias_of"] else "region",
                          alias_of=t["alias_of"], dtype=t["dtype"]))
    for name, reg in lay["regions"].items():
        off, size, slots = reg["offset"], reg["bytes_per_slot"], reg["slots"]
        for s in range(slots):
            rects.append(Rect("SMEM", name, off + s * size, off + (s + 1) * size, slot=s if slots > 1 else None))
    slots_of = {b["name"]: int(b.get("slots", 1)) for b in man.get("barriers", [])}
    for name, off in lay["barriers"].items():
        n = slots_of.get(name, 1)
        for s in range(n):
            rects.append(Rect("SMEM", name, off + 8 * s, off + 8 * (s + 1), slot=s if n > 1 else None, kind="barrier"))
    tslot = lay["tmem_addr_slot"]
    used = tslot + 8
    rects.append(Rect("SMEM", "tmem_addr", tslot, used, kind="tmem_addr"))
    total = int(man.get("dynamic_smem_bytes", used + lay["align"]))
    if total > used:
        rects.append(Rect("SMEM", "slack", used, total, kind="slack"))
    owners: dict = {}
    if tmem_cols:  # the warpgroup roles' warps, by the lanes each may tcgen05.ld / st
        for r in man.get("roles", []):
            if len(r["warps"]) == 4:
                for w in r["warps"]:
                    owners.setdefault(tmem_lane_base_for_warp(w), []).append(f"{r['role']} w{w}")
    return MemoryMap(man.get("name", "?"), man.get("arch", "?"), tmem_cols, TMEM_LANES, total, used, rects,
                     dict(sorted(owners.items())))


# ---- the timeline ---------------------------------------------------------------------------------
# an asynchronous operation's kind (the emulator's name for it) -> the unit band it is drawn in
UNITS = {"TMA load": "TMA", "TMA store": "TMA", "tcgen05.mma": "tensor core", "wgmma.mma_async": "tensor core",
         "tcgen05.commit arrive": "tensor core", "tcgen05.ld": "TMEM ld/st", "tcgen05.st": "TMEM ld/st"}
MMA_KINDS = ("tcgen05.mma", "wgmma.mma_async")


@dataclass(frozen=True)
class TimelineBar:
    band: str  # a role's name, or an async unit's
    row: int  # the warp's row inside its role (warps in order), or the row inside an async unit's band
    t0: int
    t1: int
    kind: str  # issue | wait | exit | an async kind
    label: str = ""  # wait: the barrier (slot); async: what it moves -> where it arrives
    warp: int = -1


@dataclass
class Timeline:
    name: str
    arch: str
    bands: list  # (band name, rows, its rows' warps (a role) or names (a unit)), top to bottom
    bars: list
    t_end: int
    note: str = ""


def named_barrier_names(man: dict) -> dict:
    """Named barrier id -> "name[slot]" from the manifest's barrier table (id 0: the CTA-wide barrier)."""
    out = {0: "CTA barrier 0"}
    for b in man.get("barriers", []):
        ids = b.get("named_ids")
        if ids:
            for i in range(ids[0], ids[1] + 1):
                out[i] = f"{b['name']}[{i - ids[0]}]"
    return out


def timeline(man: dict, events: list, *, cta: int = 0, merge: int | None = None, note: str = "") -> Timeline:
    """The bars of one CTA's trace: per manifest role a row per warp (issue bursts merged when closer
    than `merge` time units, default 1/800 of the run; waits with the barrier's name), then one band
    per asynchronous unit, its overlapping operations stacked in rows."""
    evs = [e for e in events if e.cta == cta]
    t_end = max((e.end for e in evs), default=1)
    merge = max(1, t_end // 800) if merge is None else merge
    row_of = {}
    bands = []
    for r in man.get("roles", []):
        warps = list(r["warps"])
        bands.append((r["role"], len(warps), warps))
        for i, w in enumerate(warps):
            row_of[w] = (r["role"], i)
    named = named_barrier_names(man)
    bars = []
    open_issue: dict = {}  # warp -> [t0, t1]
    for e in sorted((e for e in evs if e.kind == ISSUE), key=lambda e: (e.warp, e.time)):
        cur = open_issue.get(e.warp)
        if cur is not None and e.time - cur[1] <= merge:
            cur[1] = e.end
            continue
        if cur is not None:
            bars.append(_warp_bar(row_of, e.warp, cur[0], cur[1], ISSUE))
        open_issue[e.warp] = [e.time, e.end]
    for w, (t0, t1) in open_issue.items():
        bars.append(_warp_bar(row_of, w, t0, t1, ISSUE))
    for e in evs:
        if e.kind == WAIT:
            label = e.detail
            if label.startswith("bar.sync "):
                label = named.get(int(label.split()[1]), label)
            bars.append(_warp_bar(row_of, e.warp, e.time, e.end, WAIT, label))
        elif e.kind == EXIT:
            bars.append(_warp_bar(row_of, e.warp, e.time, e.time, EXIT))
    # the asynchronous units: a TMA load per row (stacked where they overlap: what they move and the
    # barrier they complete); a tensor-core pipe per issuing warp, each operation from when the pipe
    # reaches it (its issue or the previous one's landing) to its landing; commit arrivals as marks at
    # their landing; TMA stores and TMEM loads / stores as the spans with any in flight
    units: dict = {}  # band -> rows
    spans: list = []
    for e in sorted((e for e in evs if e.kind not in (ISSUE, WAIT, EXIT)), key=lambda e: (e.time, e.end)):
        unit = UNITS.get(e.kind, e.kind)
        rows = units.setdefault(unit, {})
        if e.kind == "TMA load":  # a row per barrier slot the loads complete (a ring slot, reused)
            key = ("loads", e.detail.split(" -> ")[-1])
            rows.setdefault(key, 0)
            bars.append(TimelineBar(unit, key, e.time, e.end, e.kind, e.detail, e.warp))
        elif e.kind in MMA_KINDS:  # a pipe per issuing role (a warpgroup's wgmma: whichever warp issues it)
            key = (e.kind, row_of.get(e.warp, (f"warp {e.warp}",))[0])
            last = rows.get(key, 0)
            rows[key] = max(last, e.end)
            bars.append(TimelineBar(unit, key, max(e.time, last), e.end, e.kind, e.detail, e.warp))
        elif e.kind == "tcgen05.commit arrive":
            key = (e.kind, row_of.get(e.warp, (f"warp {e.warp}",))[0])
            rows.setdefault(key, 0)
            bars.append(TimelineBar(unit, key, e.end, e.end, e.kind, e.detail, e.warp))
        else:  # spans with any in flight: an operation issued before the open span ends extends it
            span = rows.get(e.kind)
            if span and e.time <= span[1] + merge:
                span[1] = max(span[1], e.end)
                span[2] += 1
            else:
                if span:
                    spans.append((unit, e.kind, *span))
                rows[e.kind] = [e.time, e.end, 1]
    for unit, rows in units.items():
        for k, span in rows.items():
            if isinstance(k, str) and k != "loads":
                spans.append((unit, k, *span))
    for unit, kind, t0, t1, n in spans:
        bars.append(TimelineBar(unit, kind, t0, t1, kind, f"{n} in flight" if n > 1 else "", -1))
    order = list(dict.fromkeys(UNITS.values()))
    role_rank = {r["role"]: f"{i:03d}" for i, r in enumerate(man.get("roles", []))}
    row_index = {}
    for unit in sorted(units, key=lambda u: order.index(u) if u in order else len(order)):
        keys = sorted(units[unit], key=lambda k: (k[0] != "loads", k[0], role_rank.get(k[1], k[1]))
                      if isinstance(k, tuple) else (True, k, ""))
        row_index.update({(unit, k): i for i, k in enumerate(keys)})
        bands.append((unit, len(keys), [_row_name(k) for k in keys]))
    bars = [TimelineBar(b.band, row_index[(b.band, b.row)], b.t0, b.t1, b.kind, b.label, b.warp)
            if (b.band, b.row) in row_index else b for b in bars]
    return Timeline(man.get("name", "?"), man.get("arch", "?"), bands, bars, t_end, note)


def _row_name(key) -> str:
    """A unit row's name: "load -> kv_full[0]", "tcgen05.mma (mma)" (the issuing role's pipe)."""
    if isinstance(key, tuple):
        return f"load -> {key[1]}" if key[0] == "loads" else f"{key[0].replace(' arrive', '')} ({key[1]})"
    return key


def _warp_bar(row_of: dict, warp: int, t0: int, t1: int, kind: str, label: str = "") -> TimelineBar:
    band, row = row_of.get(warp, (f"warp {warp}", 0))
    return TimelineBar(band, row, t0, t1, kind, label, warp)


def default_trace_shape(man: dict) -> "harness.Shape":
    """The smallest dense launch that shows two K/V blocks and an O rescale in one CTA: one batch, one
    KV head (its GQA ratio of query heads), one task's Q rows (tiles_per_task tiles of the manifest's
    rows) and two K/V blocks (make_inputs' larger block-0 keys, visited last, force the rescale)."""
    cfg = man["config"]
    rows = int(cfg["block_m"]) * int(man.get("grid", {}).get("tiles_per_task", 1))
    g = int(cfg["gqa_ratio"])
    pack = int(man.get("gqa", {}).get("pack", 1))
    sq = max(rows // pack, 1)
    return harness.Shape(1, sq, 2 * int(cfg["block_n"]), g, 1)


def trace_run(ptx_text: str, man: dict, shape=None, seed: int = 0):
    """(RunResult, Recorder) of one emulated launch on one CTA (shape: default_trace_shape). A varlen or
    KV-cache kernel is a harness.UsageError; a run that does not pass, a DrawError with its report."""
    cfg = man["config"]
    if cfg.get("varlen") or cfg.get("kvcache"):
        raise harness.UsageError("the timeline draws dense kernels (build one without --varlen / --kvcache)")
    shape = shape or default_trace_shape(man)
    rec = Recorder()
    res = harness.run_once(ptx_text, man, shape, seed, ctas=1, trace=rec)
    if not res.ok:
        raise DrawError(f"the emulated run failed ({res.kind}): {res.report}")
    return res, rec


# ---- rendering ------------------------------------------------------------------------------------
def require_matplotlib():
    """The matplotlib module; DrawError naming the extra when it is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise DrawError(f"drawing needs matplotlib, the 'draw' extra: {EXTRA_HINT}") from None
    return matplotlib


def _pyplot():
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "fa4gen", "font.size": 8})
    return plt


def _save(fig, out: Path) -> None:
    suffix = out.suffix.lower()
    if suffix == ".svg":
        fig.savefig(out, format="svg", metadata={"Date": None}, bbox_inches="tight")
    else:
        fig.savefig(out, format="png", dpi=130, bbox_inches="tight")


def check_out(out) -> Path:
    out = Path(out)
    if out.suffix.lower() not in FORMATS:
        raise DrawError(f"--out {out}: the file type comes from its suffix, one of {', '.join(FORMATS)}")
    return out


_REGION_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"]


def _kib(n: int) -> str:
    return f"{n / 1024:g} KiB" if n >= 1024 else f"{n} B"


def render_memory_map(mm: MemoryMap, out) -> Path:
    out = check_out(out)
    plt = _pyplot()
    from matplotlib.patches import Rectangle

    ratios = [3.2, 1.2, 1.8] if mm.tmem_cols else [0.5, 1.2, 1.8]
    fig, (ax_t, ax_s, ax_b) = plt.subplots(3, 1, figsize=(11, 8 if mm.tmem_cols else 5.5),
                                           gridspec_kw={"height_ratios": ratios})
    fig.suptitle(f"{mm.name}: memory map ({mm.arch})", fontsize=11)
    names = list(dict.fromkeys(r.name for r in mm.rects if r.kind in ("region", "alias")))
    color = {n: _REGION_COLORS[i % len(_REGION_COLORS)] for i, n in enumerate(names)}
    # TMEM: columns across, lanes down; an aliased (P) region hatched over its S region's columns
    if mm.tmem_cols:
        ax_t.set_xlim(0, mm.tmem_cols)
        ax_t.set_ylim(mm.tmem_lanes, 0)
        aliases = mm.of("TMEM", "alias")
        for r in mm.of("TMEM", "region"):
            ax_t.add_patch(Rectangle((r.x0, r.y0), r.x1 - r.x0, r.y1 - r.y0, facecolor=color[r.name], alpha=0.55,
                                     edgecolor="black"))
            own = [a for a in aliases if a.alias_of == r.name]
            x1 = min([a.x0 for a in own], default=r.x1)  # its label on the columns no alias covers
            ax_t.text((r.x0 + x1) / 2, (r.y0 + r.y1) / 2, f"{r.name} ({r.dtype})\n[{r.x0}, {r.x1})",
                      ha="center", va="center", fontsize=9)
        for r in aliases:
            ax_t.add_patch(Rectangle((r.x0, r.y0), r.x1 - r.x0, r.y1 - r.y0, facecolor="white", alpha=0.75,
                                     hatch="//", edgecolor=color[r.alias_of]))
            ax_t.text((r.x0 + r.x1) / 2, (r.y0 + r.y1) / 2, f"{r.name} ({r.dtype})\naliases {r.alias_of}\n"
                      f"[{r.x0}, {r.x1})", ha="center", va="center", fontsize=8,
                      bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
        ax_t.set_xticks(sorted({r.x0 for r in mm.of("TMEM")} | {mm.tmem_cols}))
        ax_t.set_yticks(range(0, mm.tmem_lanes + 1, 32))
        ax_t.set_xlabel("TMEM column (32-bit)")
        ax_t.set_ylabel("lane (tile row)")
        if mm.lane_owners:
            ax_o = ax_t.twinx()
            ax_o.set_ylim(mm.tmem_lanes, 0)
            ax_o.set_yticks([lane + 16 for lane in mm.lane_owners])
            ax_o.set_yticklabels(["\n".join(ws) for ws in mm.lane_owners.values()], fontsize=6.5)
            ax_o.set_ylabel("warps that may tcgen05.ld/st these 32 lanes", fontsize=7)
        ax_t.set_title(f"Tensor Memory: {mm.tmem_cols} columns x {mm.tmem_lanes} lanes allocated; hatched: a "
                       "16-bit P region written over the S columns it aliases", fontsize=9)
    else:
        ax_t.axis("off")
        ax_t.text(0.5, 0.5, f"{mm.arch} has no Tensor Memory: the S and O accumulators live in the consumer "
                            "warpgroups' registers (wgmma)", ha="center", va="center", fontsize=10)
    # SMEM at scale: the large regions' slots; the small ones, the mbarriers and the TMEM address slot
    # enlarged below, one box each (not to scale)
    big = [r for r in mm.of("SMEM", "region") if (r.x1 - r.x0) / mm.smem_bytes >= 0.02]
    small = [r for r in mm.of("SMEM") if r not in big and r.kind != "slack"]
    ax_s.set_xlim(0, mm.smem_bytes)
    ax_s.set_ylim(0, 1)
    ax_s.set_yticks([])
    for r in big:
        ax_s.add_patch(Rectangle((r.x0, 0), r.x1 - r.x0, 1, facecolor=color[r.name], alpha=0.55, edgecolor="black"))
        ax_s.text((r.x0 + r.x1) / 2, 0.5, f"{r.label}\n{_kib(r.x1 - r.x0)}\n@{r.x0}", ha="center", va="center",
                  fontsize=7)
    if small:
        t0 = min(r.x0 for r in small)
        ax_s.add_patch(Rectangle((t0, 0), mm.smem_used - t0, 1, facecolor="#999999", edgecolor="black"))
    for r in mm.of("SMEM", "slack"):
        ax_s.add_patch(Rectangle((r.x0, 0), r.x1 - r.x0, 1, facecolor="#eeeeee", edgecolor="black", hatch=".."))
    ax_s.set_xlabel("byte offset from the aligned dynamic SMEM base")
    ax_s.set_title(f"Shared memory: {mm.smem_bytes} bytes requested ({mm.smem_used} used + alignment slack, dotted); "
                   "a ring region has one box per slot; grey: enlarged below", fontsize=9)
    ax_b.set_xlim(0, max(len(small), 1))
    ax_b.set_ylim(0, 1)
    ax_b.set_yticks([])
    ax_b.set_xticks([])
    fam = list(dict.fromkeys(r.name for r in small))
    for i, r in enumerate(small):
        c = color.get(r.name) if r.kind == "region" else "#bbbbbb" if r.kind == "tmem_addr" else \
            _REGION_COLORS[fam.index(r.name) % len(_REGION_COLORS)]
        ax_b.add_patch(Rectangle((i, 0), 1, 1, facecolor=c, alpha=0.55, edgecolor="black", lw=0.5))
        name = ("TMEM address" + ("" if mm.tmem_cols else " (unused)")) if r.kind == "tmem_addr" else r.label
        size = f" ({r.x1 - r.x0} B)" if r.x1 - r.x0 != 8 else ""
        ax_b.text(i + 0.5, 0.5, f"{name}{size} @{r.x0}", rotation=90, ha="center", va="center", fontsize=6)
    ax_b.set_title("Shared memory, the small regions and the tail enlarged (one box each, not to scale): "
                   "8-byte mbarriers, then the 8-byte TMEM address slot", fontsize=9)
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return out


MMA_COLORS = ("#f28e2b",)
_ASYNC_COLORS = {"TMA load": "#4e79a7", "TMA store": "#76b7b2", "tcgen05.mma": "#f28e2b", "wgmma.mma_async": "#f28e2b",
                 "tcgen05.commit arrive": "#e15759", "tcgen05.ld": "#b07aa1", "tcgen05.st": "#ff9da7"}


def render_timeline(tl: Timeline, out) -> Path:
    out = check_out(out)
    plt = _pyplot()
    from matplotlib.patches import Patch

    nrows = sum(n for _, n, _ in tl.bands)
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.28 * nrows))
    y0 = {}
    y = 0
    ticks, labels = [], []
    for band, n, warps in tl.bands:
        y0[band] = y
        for i in range(n):
            ticks.append(y + i + 0.5)
            labels.append(f"{band} w{warps[i]}" if isinstance(warps[i], int) else f"{band}: {warps[i]}")
        ax.axhline(y, color="#999999", lw=0.4)
        y += n
    waits = list(dict.fromkeys(b.label.split("[")[0] for b in tl.bars if b.kind == WAIT))
    cmap = plt.get_cmap("tab20")
    wait_color = {w: cmap(i % 20) for i, w in enumerate(waits)}
    min_w = tl.t_end / 2000
    groups: dict = {}
    marks: dict = {}
    for b in tl.bars:
        if b.band not in y0:
            continue
        yy = y0[b.band] + b.row
        if b.kind == ISSUE:
            c, h = "#333333", 0.35
        elif b.kind == WAIT:
            c, h = wait_color[b.label.split("[")[0]], 0.8
        elif b.kind == EXIT or b.t0 == b.t1:
            marks.setdefault(_ASYNC_COLORS.get(b.kind, "black"), []).append((b.t0, yy + 0.5))
            continue
        else:
            c, h = _ASYNC_COLORS.get(b.kind, "#999999"), 0.8
        groups.setdefault((c, h), []).append((yy + (1 - h) / 2, b.t0, max(b.t1 - b.t0, min_w)))
    for (c, h), segs in groups.items():  # one compound path per colour: a small SVG
        ax.add_patch(_boxes(segs, h, c, edge="white" if c in MMA_COLORS else "none"))
    for c, pts in marks.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ls="none", marker="|", color=c, ms=7)
    # labels on the longest waits and the TMA loads (where there is room)
    labelled: dict = {}  # row -> where its last label's bar ends (overlapping bars: the first labelled)
    # a label where its bar is wide enough for it (5.5 pt characters on the 14-inch figure's axis)
    for b in sorted(tl.bars, key=lambda b: b.t0):
        if b.band in y0 and b.label and b.kind in (WAIT, "TMA load") and b.t1 - b.t0 > tl.t_end * 0.0042 * len(b.label) \
                and labelled.get((b.band, b.row), -1) <= b.t0:
            labelled[(b.band, b.row)] = b.t1
            ax.text((b.t0 + b.t1) / 2, y0[b.band] + b.row + 0.5, b.label, ha="center", va="center", fontsize=5.5,
                    clip_on=True)
    ax.set_ylim(y, 0)
    ax.set_xlim(0, tl.t_end)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=6.5)
    ax.set_xlabel("emulator time (warp-instructions issued in the CTA)")
    ax.set_title(f"{tl.name}: one CTA in the emulator ({tl.arch})" + (f"; {tl.note}" if tl.note else ""), fontsize=10)
    handles = [Patch(color="#333333", label="issuing instructions")]
    handles += [Patch(color=wait_color[w], label=f"waits on {w}") for w in waits]
    kinds = list(dict.fromkeys(b.kind for b in tl.bars if b.kind not in (ISSUE, WAIT, EXIT)))
    handles += [Patch(color=_ASYNC_COLORS.get(k, "#999999"), label=f"{k} (issue -> landing)") for k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=6.5, frameon=False)
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
    return out


def _boxes(segs: list, h: float, color, edge="none"):
    """One PathPatch of the rectangles (y, x, width) of height h."""
    import numpy as np
    from matplotlib.patches import PathPatch
    from matplotlib.path import Path as MPath

    verts = np.array([[(x, y), (x, y + h), (x + w, y + h), (x + w, y), (x, y)] for y, x, w in segs], float)
    codes = np.tile([MPath.MOVETO, MPath.LINETO, MPath.LINETO, MPath.LINETO, MPath.CLOSEPOLY], len(segs))
    return PathPatch(MPath(verts.reshape(-1, 2), codes), facecolor=color, edgecolor=edge, linewidth=0.3)


def render(obj, out) -> Path:
    """Draw a MemoryMap or a Timeline to out (.svg or .png)."""
    if isinstance(obj, MemoryMap):
        return render_memory_map(obj, out)
    if isinstance(obj, Timeline):
        return render_timeline(obj, out)
    raise TypeError(type(obj).__name__)

