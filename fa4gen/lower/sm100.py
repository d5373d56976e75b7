"""sm_100a (Blackwell) lowering: the verified Pipeline IR -> template context -> PTX + manifest.

Every role's program (fa4gen/ir/sm100.py, proven by fa4gen.verify.verify) is walked statement by
statement; each op becomes one template item (a macro call of templates/sm100/ops.ptx.j2) and each
Loop / If becomes labels and predicated branches. The templates only spell instructions: every
register name, offset, descriptor constant, column and label is computed here.

Kernel shape (the roles of fa4gen/ir/sm100.py): 512 threads = 16 warps; roles own whole warps; one if/else chain on the
warpgroup index sets each warpgroup's setmaxnreg budget, then a branch on the warp index enters the
role. Every role runs warp-converged: single-thread work (expect_tx, TMA, tcgen05.mma, commit) is
issued by the lane elect.sync picked, so addresses and descriptors stay warp-uniform (ptxas keeps
them in uniform registers, which the 48-register TMA/MMA warps need). Each pipeline State lives in
one register q in [0, 2*depth) (slot = q mod depth, wait parity = q >= depth), advanced exactly as
ir.core.State defines.

No Blackwell GPU exists here: this PTX is assembled by ptxas for sm_100a and checked by reading it
back (tests/test_readback.py), never executed.
"""

from __future__ import annotations

import enum
import math
import struct

from ..spec.plan import PTX_VERSION_FOR_ARCH
from ..spec.config import GENERATOR_VERSION, KernelConfig
from ..spec.plan import (ARCH_LIMITS, block_info_ptx, dynamic_tasks, combine_context, kv_box_rows, MASK_AS_WORDS, MASK_WORD_BITS,
                         ROWS, WINDOW_UNBOUNDED, Panels, PlanError, mask_words, key_limits_ptx, qk_panels, vo_panels)
from ..spec.encodings import DescArch, Major, SmemMatrixDesc, TcgenInstrDesc, check_tmem_alloc
from ..spec.exp2 import EXP2_POLY, FRAG_COLS, ROUND_MAGIC, emulated_mask
from ..ir.core import (Advance, Arrive, BarrierKind, BlockRef, Commit, Compute, ExpectTx, FenceProxyAsync,
                       FetchTask, PublishTask, ReadTask, Mma, NamedArrive, NamedSync, Pipeline, Role, PageLookup, Scope, SmemLd, SmemSt, Space,
                       StoreO, StorePartial, StoreRows, TmaLoad, TmaStore, TmaStoreWait, TmemLd, TmemSt, Wait,
                       WaitLd, WaitSt, walk_ops)
from .manifest import DYNAMIC_DEAL, ENTRY, GridFacts, entry_params, manifest, smem_layout_section
from .walk import LoweringError, SmemLayout, WalkCtx, Walker, dispatch, exact_log2, f32, pairwise, refuse_planned, smem_layout

__all__ = ["ENTRY", "OP_PTX", "Ptx", "SPELLING", "Sm100LoweringError", "SmemLayout", "lower_sm100",
           "lowered_sm100", "manifest_sm100", "smem_layout"]

TARGET = "sm_100a"
THREADS_PER_WARP = 32
MMA_K = 16  # tcgen05.mma kind::f16 reduction positions per instruction
NEG_INF = "0fFF800000"
ONE = "0f3F800000"
ZERO = "0f00000000"
LN2 = math.log(2.0)


class Sm100LoweringError(LoweringError):
    """A pipeline or config this lowering cannot emit (says what and why)."""


class Ptx(enum.Enum):
    """Protocol-relevant PTX instruction classes (barrier, tcgen05, TMA), by mnemonic prefix."""

    TRY_WAIT = "mbarrier.try_wait.parity"
    ARRIVE = "mbarrier.arrive"
    EXPECT_TX = "mbarrier.arrive.expect_tx"
    TMA_LOAD = "cp.async.bulk.tensor.g2s"
    TMA_STORE = "cp.async.bulk.tensor.s2g"
    BULK_COMMIT = "cp.async.bulk.commit_group"
    BULK_WAIT_READ = "cp.async.bulk.wait_group.read"
    MMA = "tcgen05.mma"
    COMMIT = "tcgen05.commit"
    TMEM_LD = "tcgen05.ld"
    TMEM_ST = "tcgen05.st"
    WAIT_LD = "tcgen05.wait::ld"
    WAIT_ST = "tcgen05.wait::st"
    BAR_ARRIVE = "bar.arrive"
    BAR_SYNC = "bar.sync"
    FENCE_PROXY_ASYNC = "fence.proxy.async.shared::cta"
    FENCE_BEFORE = "tcgen05.fence::before_thread_sync"
    FENCE_AFTER = "tcgen05.fence::after_thread_sync"


# The op -> PTX table: which protocol instructions each IR op lowers to, in order. `*` marks an
# instruction repeated per unit (64-column TMA box, 16-position MMA step). The tcgen05 fences are
# added around thread-synchronising ops by `fence_policy`. tests/test_readback.py inverts this table.
OP_PTX: dict[type, tuple[str, ...]] = {
    Wait: (Ptx.TRY_WAIT.value,),
    Arrive: (Ptx.ARRIVE.value,),
    ExpectTx: (Ptx.EXPECT_TX.value,),
    TmaLoad: (Ptx.TMA_LOAD.value + "*",),
    TmaStore: (Ptx.TMA_STORE.value + "*", Ptx.BULK_COMMIT.value),
    TmaStoreWait: (Ptx.BULK_WAIT_READ.value,),
    Mma: (Ptx.MMA.value + "*",),
    Commit: (Ptx.COMMIT.value,),
    TmemLd: (Ptx.TMEM_LD.value,),
    TmemSt: (Ptx.TMEM_ST.value,),
    WaitLd: (Ptx.WAIT_LD.value,),
    WaitSt: (Ptx.WAIT_ST.value,),
    NamedArrive: (Ptx.BAR_ARRIVE.value,),
    NamedSync: (Ptx.BAR_SYNC.value,),
    FenceProxyAsync: (Ptx.FENCE_PROXY_ASYNC.value,),
    # register-only or generic-proxy ops: no protocol instruction (StoreRows: ld.shared / st.global
    # by the role's threads, read back by fa4gen.evidence.check as its own event)
    StoreRows: (),
    StorePartial: (),  # KV cache: st.global of the registers (no protocol instruction)
    StoreO: (),  # O from the registers: st.global of the packed row (no protocol instruction)
    PageLookup: (),  # paged KV cache: ld.global of page-table entries into registers
    SmemSt: (),
    SmemLd: (),
    Advance: (),
    # the dynamic deal's task hand-off (plan.dynamic_tasks): its ring's waits and arrives are the
    # protocol; the index itself (atom.global.add and its shuffle, st/ld.shared of one word) is `fa4gen emulate`'s
    FetchTask: (),
    PublishTask: (),
    ReadTask: (),
    Compute: (),
}


# How this target's instructions read back (fa4gen.evidence.check): the tcgen05 classes after the shared ones
# (walk.COMMON_PTX); `%p_el` is the lane elect.sync picked, the one that issues an elected op.
TCGEN05_PTX = tuple((p.value, p.value, "") for p in (Ptx.MMA, Ptx.COMMIT, Ptx.TMEM_LD, Ptx.TMEM_ST, Ptx.WAIT_LD,
                                                     Ptx.WAIT_ST, Ptx.FENCE_BEFORE, Ptx.FENCE_AFTER))


def role_issues_tcgen05(role: Role) -> bool:
    return any(isinstance(op, (Mma, TmemLd, TmemSt)) for op in walk_ops(role.program))


def role_moves_tmem(role: Role) -> bool:
    return any(isinstance(op, (TmemLd, TmemSt)) for op in walk_ops(role.program))


def fence_policy(pipe: Pipeline, role: Role, op) -> tuple[bool, bool]:
    """(tcgen05.fence::before_thread_sync before, tcgen05.fence::after_thread_sync after) the op.

    PTX ISA 9.7.16.6 (tcgen05 memory consistency): tcgen05 operations of two threads are ordered
    through a thread synchronisation only when the producer fences before it and the consumer after
    it. Producers here are roles that move TMEM with tcgen05.ld/st and then arrive (P ready, O
    rescaled, S/O read); consumers are roles issuing tcgen05 ops after a wait. TMA-completed
    barriers (complete_tx) order the async proxy's SMEM writes by themselves.
    """
    if isinstance(op, (Arrive, NamedArrive)):
        return role_moves_tmem(role), False
    if isinstance(op, Wait):
        kind = pipe.barrier(op.barrier).kind
        return False, role_issues_tcgen05(role) and kind is not BarrierKind.TMA
    if isinstance(op, NamedSync):
        return False, role_issues_tcgen05(role)
    return False, False


def _x2(x: float) -> str:
    """A .b64 immediate holding the fp32 x in both halves (an f32x2 operand with both elements x)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return f"0x{bits:08X}{bits:08X}"


ELECTED_OPS = (ExpectTx, TmaLoad, TmaStore, TmaStoreWait, Mma, Commit, FetchTask, PublishTask)  # issued by one elected lane


def _needs_elect(role: Role) -> bool:
    return any(isinstance(op, ELECTED_OPS) or (isinstance(op, Arrive) and op.scope is Scope.ELECTED)
               for op in walk_ops(role.program))


class _RoleEmitter(Walker):
    OP_PTX = OP_PTX
    Error = Sm100LoweringError
    target = TARGET

    def __init__(self, ctx: WalkCtx, role: Role):
        super().__init__(ctx, role)
        # Register bookkeeping of f32 buffers between TMEM round trips: a tcgen05.ld puts columns on
        # `pending`; a Compute consumes them (each loaded value is transformed exactly once) and
        # puts the results on `computed`; a tcgen05.st of that buffer consumes those. Nothing is
        # ever put back on `pending` (that made rescale/normalise apply twice or three times).
        self.pending: dict[str, list[int]] = {}  # register buffer -> columns loaded, not yet consumed
        self.computed: dict[str, list[int]] = {}  # register buffer -> columns computed, not yet stored
        self.packed: list[int] = []  # columns normalised into 16-bit packs, not yet stored
        self.store_ordinal = 0

    # ---- role and task structure ---------------------------------------------------------------
    def run(self) -> dict:
        role = self.role
        ops = list(walk_ops(role.program))
        # a role that fetches task indices keeps the elected lane's index: the fetched one is shuffled from it
        self.emit("role_begin", name=role.name, label=f"$L_role_{role.name}", el="%p_el",
                  elect=_needs_elect(role), lane=self.r("b32", "ellane") if any(isinstance(op, FetchTask)
                                                                              for op in ops) else None)
        self.setup()
        for st in role.states:
            self.init_state(st)
        self.stmts(role.program)
        self.emit("role_end", name=role.name, label=f"$L_{role.name}_end", el="%p_el",
                  stores=any(isinstance(op, TmaStore) for op in ops), tcgen05=role_issues_tcgen05(role),
                  dealloc=self.ctx.tmem_warp in role.warps, tmem_warp=self.ctx.tmem_warp,
                  single_warp=len(role.warps) == 1, tmem_cols=self.pipe.tmem_alloc_cols)
        return {"name": role.name, "warps": list(role.warps), "regs": role.regs, "items": self.items,
                "label": f"$L_role_{role.name}", "tcgen05": role_issues_tcgen05(role)}

    def setup(self) -> None:
        role = self.role
        ops = list(walk_ops(role.program))
        needs_row = any(isinstance(op, (TmemLd, TmemSt, SmemSt, SmemLd, Compute)) for op in ops)
        per_warp_named = [op for op in ops if isinstance(op, (NamedArrive, NamedSync))
                          and self.named(op)[2]]
        self.emit("role_setup", row=needs_row, warp4=needs_row or bool(per_warp_named),
                  tml="%tml" if any(isinstance(op, (TmemLd, TmemSt)) for op in ops) else None,
                  srow=self.r("b32", "srow") if "sScale" in self.ctx.layout.regions and needs_row else None,
                  sscale=self.ctx.layout.region_offset("sScale") if "sScale" in self.ctx.layout.regions else 0,
                  orow=self.r("b32", "orow") if any(isinstance(op, SmemSt) and op.region == "O_smem"
                                                    for op in ops) else None, opn=_panel_swizzle(vo_panels(self.cfg)),
                  osmem=self.ctx.layout.region_offset("O_smem") if "O_smem" in self.ctx.layout.regions else 0)
        seen = set()
        for op in per_warp_named:
            bid, count, _ = self.named(op)
            if bid not in seen:
                seen.add(bid)
                b = self.pipe.barrier(op.barrier)
                kind, v = self.slot(op.slot)
                self.emit("named_id", dst=bid, base=b.named_id + 4 * v)

    def task_begin(self, head: str, done: str) -> None:
        cfg = self.cfg
        if cfg.varlen:
            self.varlen_regs()
        if cfg.kvcache:
            for n in ("nsplit", "split", "nlo"):
                self.r("b32", n)
        unit = cfg.seq_q_per_task  # varlen m unit: the task's Q tiles (plan "Varlen task order")
        # the task's K/V blocks (plan.BlockInfo over the pair of Q tiles): %n >= 1 (KV cache:
        # the split's, from %nlo; a window: from its first block %nlo)
        split = ("%split", "%nsplit", "%nlo", "%tmp1") if cfg.kvcache else None
        if cfg.window:
            load, win = self.window_regs()
            blocks = load + block_info_ptx(causal=cfg.causal, rows=unit, m="%mpair", sq="%sq", skv="%skv",
                                           tmp="%tmp0", n="%n", split=split, window=win, lo=self.r("b32", "nlo"),
                                           block_n=cfg.block_n)
        else:
            blocks = block_info_ptx(causal=cfg.causal, rows=unit, m="%mpair", sq="%sq", skv="%skv", tmp="%tmp0",
                                    n="%n", split=split, block_n=cfg.block_n)
        # %npairs, the task's m units per (batch, head group): ceil(num_m_blocks / tiles_per_task)
        nt = cfg.tiles_per_task
        units = ([("add.u32", "%npairs", "%nmb", str(nt - 1)), ("shr.u32", "%npairs", "%npairs", str(nt.bit_length() - 1))]
                 if nt > 1 else [("mov.u32", "%npairs", "%nmb")])
        self.emit("task_begin", head=head, done=done, causal=cfg.causal, sqt=cfg.seq_q_per_tile, units=units, tiles=nt,
                  unit_name="m block pair" if nt == 2 else "m block", unit_words="a pair of Q tiles" if nt == 2 else "one Q tile",
                  varlen=cfg.varlen, unit_rows=unit, unit_shift=exact_log2(unit), uid=self.p,
                  blocks=blocks, **({"kvcache": True} if cfg.kvcache else {}))
        self.task_prologue()

    def op_FetchTask(self, op: FetchTask) -> None:
        # the elected lane takes the index; the role runs warp-converged, so every lane gets it by shuffle
        self.emit("fetch_task", dst="%task", counter=self.r("b64", "tctr"), param="task_counter",
                  lane=self.r("b32", "ellane"), note="the dynamic deal: the next task index from the launch's task counter")

    def window_regs(self) -> tuple[list[tuple], tuple[str, str]]:
        """(instructions loading the window's sides, clamped to the ABI's [0, WINDOW_UNBOUNDED], the
        (left, right) operands block_info_ptx and key_limits_ptx take): right is the literal 0 in a
        causal kernel (plan.abi_params). Loaded where used (per task): no register kept across loops."""
        win = (self.r("b32", "wl"), "0" if self.cfg.causal else self.r("b32", "wr"))
        ins = []
        for reg, name in zip(win, ("window_left", "window_right")):
            if reg != "0":
                ins += [("ld.param.s32", reg, f"[{name}]"), ("max.s32", reg, reg, "0"),
                        ("min.s32", reg, reg, str(WINDOW_UNBOUNDED))]
        return ins, win

    def if_args(self, st) -> dict:
        return {"acc": self.scalar("acc_scale")}

    def fences(self, op) -> tuple[bool, bool]:
        return fence_policy(self.pipe, self.role, op)

    def task_prologue(self) -> None:
        role, cfg = self.role, self.cfg
        computes = [op for op in walk_ops(role.program) if isinstance(op, Compute)]
        if any(c.fn == "softmax_max" for c in computes):
            lse = any(c.fn == "store_lse" for c in computes)
            # this thread's row limits (plan.key_limits_ptx: keys [%cbegin, %climit) with a
            # window, [0, %climit) without) and the blocks of this role's Q tile that need no mask
            # (plan.BlockInfo over the tile, %tmp1 holding its index): [%unmlo, %nunm) with a
            # window, [0, %nunm) without
            if cfg.window:
                load, win = self.window_regs()
                limits = load + key_limits_ptx(causal=cfg.causal, q="%seq", sq="%sq", skv="%skv", end="%climit",
                                                   begin=self.r("b32", "cbegin"), window=win)
                nunm = block_info_ptx(causal=cfg.causal, rows=cfg.seq_q_per_tile, m="%tmp1", sq="%sq", skv="%skv",
                                      tmp="%tmp0", n_unmasked="%nunm", unmasked_lo=self.r("b32", "unmlo"),
                                      window=win, block_n=cfg.block_n)
            else:
                limits = key_limits_ptx(causal=cfg.causal, q="%seq", sq="%sq", skv="%skv", end="%climit")
                nunm = block_info_ptx(causal=cfg.causal, rows=cfg.seq_q_per_tile, m="%tmp1", sq="%sq", skv="%skv",
                                      tmp="%tmp1", n_unmasked="%nunm", block_n=cfg.block_n)
            self.emit("softmax_task_setup", tile=role.qtile, tiles=cfg.tiles_per_task, limits=limits, sqt=cfg.seq_q_per_tile, nunm=nunm,
                      capin=self.r("f32", "capin") if cfg.softcap else None,
                      log2_p=cfg.gqa_pack.bit_length() - 1, p=cfg.gqa_pack, neg_inf=NEG_INF, zero=ZERO,
                      varlen=cfg.varlen, lrow=self.r("b32", "lrow") if cfg.varlen and lse else None)

    # ---- ops ---------------------------------------------------------------------------------
    def op_TmaLoad(self, op: TmaLoad) -> None:
        cfg = self.cfg
        pre, base, off = self.smem_addr(op.dst, op.dst_slot, "%rdst")
        # one box per panel (plan.Panels): Q and K have head_dim columns, V head_dim_v
        pn = vo_panels(cfg) if op.tensor == "v" else qk_panels(cfg)
        half_bytes = pn.bytes(cfg.block_m if op.tensor == "q" else ROWS)
        if op.tensor == "q":
            pre = pre + [("mad.lo.u32", "%c3", "%mpair", str(cfg.seq_q_per_task),
                          str(op.qtile * cfg.seq_q_per_tile)), ("mov.u32", "%c1", "0")]
            coords = ["%c0", "%c1", "%hkv", "%c3", "%b"]
            if cfg.varlen:  # the packed tensor as a batch of one: row = the sequence's first row + position
                c4 = self.r("b32", "c4")
                pre += [("add.u32", "%c3", "%c3", "%qoff"), ("mov.u32", c4, "0")]
                coords[4] = c4
            tmap, rank = "%tmq", 5
        elif op.tensor in ("k", "v"):
            pre = pre + self.block_reg(op.block, "%c2") + [("shl.b32", "%c2", "%c2", "7")]
            kvh = "%hkv"
            if cfg.head_groups > 1:  # %hkv is the head group: its kv head is %hkv / (G / P)
                pre, kvh = pre + [("div.u32", "%c1", "%hkv", str(cfg.head_groups))], "%c1"
            coords = ["%c0", kvh, "%c2", "%b"]
            if cfg.varlen:  # key row = the sequence's first key row + block * 128, batch 0
                pre += [("add.u32", "%c2", "%c2", "%koff"), ("mov.u32", "%c3", "0")]
                coords[3] = "%c3"
            tmap, rank = f"%tm{op.tensor}", 4
            if cfg.page_size:
                return self.paged_kv_load(op, pre, base, off, kvh, tmap)
        else:
            raise Sm100LoweringError(f"TMA load of unknown tensor {op.tensor!r}")
        what = f"Q tile {op.qtile}" if op.tensor == "q" else f"{op.tensor.upper()} block {self.block_note(op.block)}"
        into, bar = f"{op.dst}[{self.slot_note(op.dst_slot)}]", self.bar_note(op.barrier, op.bar_slot)
        w = pn.panel_cols
        boxes = [{"dst": f"{base}+{off + h * half_bytes}", "c0": h * w,
                  "note": f"load {what} cols {h * w}-{(h + 1) * w - 1} into {into}, complete_tx on {bar}"}
                 for h in range(pn.count)]
        bpre, mbar = self.bar_addr(op.barrier, op.bar_slot)
        self.emit("tma_load", pre=pre + bpre, rank=rank, tmap=tmap, coords=coords, boxes=boxes, mbar=mbar,
                  skip=self.label("noel"))

    def op_PageLookup(self, op: PageLookup) -> None:
        """The page-table entries of a K/V block (fa4gen/spec/plan.py "KV-cache rules"), one per TMA box
        of box_rows = min(page_size, 128) keys: box i starts at key j = block * 128 + i * box_rows,
        its entry is page_table[b * stride + min(j / page_size, max_pages - 1)], then
        min(entry, num_pages - 1) as unsigned. Into %pg<i>, read by the block's K and V TmaLoads."""
        cfg = self.cfg
        if not cfg.page_size:
            raise Sm100LoweringError(f"{self.p}: PageLookup in a kernel without pages")
        rows = kv_box_rows(cfg)
        nbox = ROWS // rows
        self.ctx.family("b32", "%pg", nbox)
        key, pt = self.r("b32", "pkey"), self.r("b64", "ptab")
        ins = self.block_reg(op.block, key) + [("shl.b32", key, key, "7"),
                                               ("ld.param.u64", pt, "[page_table]"),
                                               ("ld.param.u32", "%tmp1", "[page_table_stride]"),
                                               ("mul.lo.u32", "%tmp1", "%b", "%tmp1")]
        for i in range(nbox):
            pg = f"%pg{i}"
            ins += [("add.u32", pg, key, str(i * rows)) if i else ("mov.u32", pg, key),
                    ("shr.u32", pg, pg, str(cfg.page_size.bit_length() - 1)),
                    ("ld.param.u32", "%tmp0", "[max_pages]"), ("sub.u32", "%tmp0", "%tmp0", "1"),
                    ("min.u32", pg, pg, "%tmp0"), ("add.u32", pg, pg, "%tmp1"),
                    ("mul.wide.u32", "%rdt", pg, "4"), ("add.s64", "%rdt", "%rdt", pt),
                    ("ld.global.nc.u32", pg, "[%rdt]")]
        for i in range(nbox):
            ins += [("ld.param.u32", "%tmp0", "[num_pages]"), ("sub.u32", "%tmp0", "%tmp0", "1"),
                    ("min.u32", f"%pg{i}", f"%pg{i}", "%tmp0")]
        self.page_block = op.block
        self.what(f"page-table entries of K/V block {self.block_note(op.block)}: {nbox} box(es) of {rows} keys, "
                  "entry min(key / page_size, max_pages - 1) of row b, page min(entry, num_pages - 1)")
        self.emit("instrs_item", list=ins)

    def paged_kv_load(self, op: TmaLoad, pre: list, base: str, off: int, kvh: str, tmap: str) -> None:
        """A paged K/V block: its 128 keys are 128 / box_rows TMA boxes of box_rows = min(page_size,
        128) rows, box i from page %pg<i> (the block's PageLookup), row j % page_size of it
        (j = block * 128: 0 unless a page holds more than one block). Tensor maps (D, Hkv, page_size, pages)."""
        cfg = self.cfg
        if getattr(self, "page_block", None) is not op.block:
            raise Sm100LoweringError(f"{self.p}: paged TmaLoad of block {op.block.value} without a PageLookup "
                                     "of that block before it")
        rows = kv_box_rows(cfg)
        row = self.r("b32", "prow")
        pre = pre + ([("and.b32", row, "%c2", str(cfg.page_size - 1))] if cfg.page_size > ROWS
                     else [("mov.u32", row, "0")])
        pn = vo_panels(cfg) if op.tensor == "v" else qk_panels(cfg)
        half_bytes, w = pn.bytes(ROWS), pn.panel_cols
        what = f"{op.tensor.upper()} block {self.block_note(op.block)}"
        into, bar = f"{op.dst}[{self.slot_note(op.dst_slot)}]", self.bar_note(op.barrier, op.bar_slot)
        bpre, mbar = self.bar_addr(op.barrier, op.bar_slot)
        boxes = []
        for i in range(ROWS // rows):
            for h in range(pn.count):
                boxes.append({"dst": f"{base}+{off + h * half_bytes + i * rows * pn.row_bytes}", "c0": h * w,
                              "coords": ["%c0", kvh, row, f"%pg{i}"],
                              "note": f"load {what} keys {i * rows}-{(i + 1) * rows - 1} cols {h * w}-"
                                      f"{(h + 1) * w - 1} into {into} from page %pg{i}, complete_tx on {bar}"})
        self.emit("tma_load", pre=pre + bpre, rank=4, tmap=tmap, coords=["%c0", kvh, row, "%pg0"], boxes=boxes,
                  mbar=mbar, skip=self.label("noel"))

    def op_TmaStore(self, op: TmaStore) -> None:
        cfg = self.cfg
        st = self.role.state(op.src_slot) if isinstance(op.src_slot, str) else None
        # The store of a task's k-th O tile reads O_smem slot k: check it, since the coordinates of
        # the k-th store are those of Q tile k.
        qtile = self.store_ordinal % cfg.tiles_per_task
        self.store_ordinal += 1
        if st is None or st.depth != cfg.tiles_per_task or st.stride != 1:
            raise Sm100LoweringError(f"{self.p}: TmaStore needs a depth-{cfg.tiles_per_task} (tiles per task), "
                                     "stride-1 state over O_smem (slot k holds Q tile k)")
        pre, base, off = self.smem_addr(op.src, op.src_slot, "%rsrc")
        vo = vo_panels(cfg)
        half_bytes, w = vo.bytes(cfg.block_m), vo.panel_cols
        pre = pre + [("mad.lo.u32", "%c3", "%mpair", str(cfg.seq_q_per_task),
                      str(qtile * cfg.seq_q_per_tile)), ("mov.u32", "%c1", "0")]
        src = f"{op.src}[{self.slot_note(op.src_slot)}]"
        boxes = [{"src": f"{base}+{off + h * half_bytes}", "c0": h * w,
                  "note": f"store O tile {qtile} cols {h * w}-{(h + 1) * w - 1} from {src}"}
                 for h in range(vo.count)]
        self.emit("tma_store", pre=pre, tmap="%tmo", coords=["%c0", "%c1", "%hkv", "%c3", "%b"], boxes=boxes,
                  skip=self.label("noel"))

    def op_StoreRows(self, op: StoreRows) -> None:
        """The role's threads copy O tile k (the k-th store of the task, as for TmaStore) from the
        128B-swizzled staging slot to o_ptr ((total_q, Hq, D)), 16 bytes per lane and row, rows of
        the sequence only: position < %sq (a pair's second tile may lie wholly past the end)."""
        cfg = self.cfg
        if not cfg.varlen:
            raise Sm100LoweringError(f"{self.p}: StoreRows writes through o_ptr, a varlen parameter")
        st = self.role.state(op.src_slot) if isinstance(op.src_slot, str) else None
        qtile = self.store_ordinal % cfg.tiles_per_task
        self.store_ordinal += 1
        if st is None or st.depth != cfg.tiles_per_task or st.stride != 1:
            raise Sm100LoweringError(f"{self.p}: StoreRows needs a depth-{cfg.tiles_per_task} (tiles per task), "
                                     "stride-1 state over O_smem (slot k holds Q tile k)")
        if op.src != "O_smem":
            raise Sm100LoweringError(f"{self.p}: StoreRows copies the O staging buffer, not {op.src}")
        nthreads = self.role.threads
        vo = vo_panels(cfg)
        row_bytes = cfg.head_dim_v * cfg.elem_bytes
        chunks = row_bytes // 16  # 16-byte chunks per row; cpr: rounded up to a power of two (D = 96: 12 of 16)
        cpr = 1 << (chunks - 1).bit_length()
        if nthreads % cpr or ROWS % (nthreads // cpr):
            raise Sm100LoweringError(f"{self.p}: {nthreads} threads do not tile {ROWS} rows of {cpr} chunks")
        pre, base, off = self.smem_addr(op.src, op.src_slot, "%rsrc")
        if base == "%smem":
            pre = pre + [("mov.u32", "%rsrc", "%smem")]
        p = cfg.gqa_pack
        for n in ("vrow", "vpos", "vhq", "vhead", "vsw", "vsa"):
            self.r("b32", n)
        for n in ("vop", "vga"):
            self.r("b64", n)
        self.r("pred", "p_row")
        if chunks < cpr:
            self.r("pred", "p_vc")
        src = f"{op.src}[{self.slot_note(op.src_slot)}]"
        idle = f" (lanes of chunks >= {chunks} idle)" if chunks < cpr else ""
        self.what(f"store O tile {qtile} from {src} to o_ptr: lane l copies 16-byte chunk l % {cpr} of rows "
                  f"l / {cpr} + {nthreads // cpr} i{idle}, rows whose position < %sq only")
        self.emit("store_rows", pre=pre, base="%rsrc", off=off, cpr=cpr, cpr_mask=cpr - 1, chunks=chunks,
                  cpr_shift=cpr.bit_length() - 1, step=nthreads // cpr, panel=vo.bytes(cfg.block_m),
                  pn=_panel_swizzle(vo), row_bytes=row_bytes,
                  pos0=cfg.seq_q_per_task, pos_tile=qtile * cfg.seq_q_per_tile, p=p,
                  log2_p=p.bit_length() - 1, g=cfg.gqa_ratio,
                  row_shift=exact_log2(row_bytes),
                  loop=self.label("rows"), qtile=qtile)

    def op_StorePartial(self, op: StorePartial) -> None:
        """KV cache, num_splits > 1: every thread stores its row's normalized fp32 O columns
        [col_lo, col_hi) (computed by normalize_partial since their tcgen05.ld) to o_partial, 16 bytes
        per st.global.v4.f32, rows of position < Sq only."""
        cfg = self.cfg
        if not cfg.kvcache:
            raise Sm100LoweringError(f"{self.p}: StorePartial writes o_partial, a KV-cache parameter")
        want = list(range(op.col_lo, op.col_hi))
        have = self.computed.get(op.src, [])
        missing = [c for c in want if c not in have]
        if missing or op.col_lo % 4 or op.col_hi % 4:
            raise Sm100LoweringError(f"{self.p}: StorePartial of {op.src}[{op.col_lo}:{op.col_hi}]: columns "
                                     f"{missing[:4]}... not normalized since their tcgen05.ld (or not 4-aligned)")
        self.computed[op.src] = [c for c in have if c not in want]
        p = cfg.gqa_pack
        self.r("pred", "p_row")
        self.what(f"store O tile {op.qtile} cols {op.col_lo}-{op.col_hi - 1} (fp32, normalized) to o_partial row "
                  "split * R + (b * Sq + pos) * Hq + head, rows pos < Sq only")
        self.emit("store_partial", pos0=cfg.seq_q_per_task, pos_tile=op.qtile * cfg.seq_q_per_tile, p=p,
                  log2_p=p.bit_length() - 1, g=cfg.gqa_ratio, t2=self.r("b32", "kt2"), t3=self.r("b32", "kt3"),
                  addr=self.r("b64", "kop"),
                  row_bytes=cfg.head_dim_v * 4,
                  stores=[{"off": 4 * c, "regs": [self.buf(op.src, c + j) for j in range(4)]}
                          for c in range(op.col_lo, op.col_hi, 4)])

    def op_StoreO(self, op: StoreO) -> None:
        """O not staged (ir/sm100.sm100_o_staged): every thread stores its row's normalized, cast O
        columns [col_lo, col_hi) (packed by the normalize before it) to o_ptr ((B, Sq, Hq, DV), varlen
        (total_q, Hq, DV)), 16 bytes per st.global.v4.b32, rows of position < Sq only."""
        cfg = self.cfg
        cols, self.packed = self.packed, []
        if cols != list(range(op.col_lo, op.col_hi)) or len(cols) % 8:
            raise Sm100LoweringError(f"{self.p}: StoreO of {op.src}[{op.col_lo}:{op.col_hi}] without a preceding "
                                     "normalize of exactly those columns (whole 8-column groups)")
        p = cfg.gqa_pack
        self.r("pred", "p_row")
        self.what(f"store O tile {op.qtile} cols {op.col_lo}-{op.col_hi - 1} ({cfg.dtype}, normalized) to o_ptr row "
                  f"({'qoff + pos' if cfg.varlen else 'b * Sq + pos'}) * Hq + head, rows pos < Sq only")
        self.emit("store_o", pos0=cfg.seq_q_per_task, pos_tile=op.qtile * cfg.seq_q_per_tile, p=p,
                  log2_p=p.bit_length() - 1, g=cfg.gqa_ratio, t2=self.r("b32", "kt2"), t3=self.r("b32", "kt3"),
                  addr=self.r("b64", "kop"), varlen=cfg.varlen, row_bytes=cfg.head_dim_v * cfg.elem_bytes,
                  stores=[{"off": 2 * c, "regs": [self.r("b32", f"ob{(c + 2 * q) // 2}") for q in range(4)]}
                          for c in range(op.col_lo, op.col_hi, 8)])

    def op_Mma(self, op: Mma) -> None:
        cfg, pipe = self.cfg, self.pipe
        d = pipe.region(op.d)
        if (op.k_hi - op.k_lo) % MMA_K or op.k_lo % MMA_K:
            raise Sm100LoweringError(f"{self.p}: MMA k range [{op.k_lo}, {op.k_hi}) is not in steps of {MMA_K}")
        qk, vo = qk_panels(cfg), vo_panels(cfg)
        pre = []
        steps = []
        acc0 = self.accumulate(op, pre)
        if op.kind == "qk":
            a, b = pipe.region(op.a), pipe.region(op.b)
            if a.space is not Space.SMEM or b.space is not Space.SMEM:
                raise Sm100LoweringError("QK MMA takes Q and K from SMEM")
            pa, abase, aoff = self.smem_addr(op.a, op.a_slot, "%rda")
            pb, bbase, boff = self.smem_addr(op.b, op.b_slot, "%rdb")
            pre += pa + pb
            idesc = TcgenInstrDesc.for_dtype(cfg.dtype, ROWS, d.cols).encode()
            inote = _idesc_note(idesc)
            for i, k in enumerate(range(op.k_lo, op.k_hi, MMA_K)):
                # k16 step k: panel k // panel_cols, k % panel_cols columns along its swizzled rows
                h, inner = divmod(k, qk.panel_cols)
                aoff_k = h * qk.bytes(cfg.block_m) + inner * cfg.elem_bytes
                boff_k = h * qk.bytes(ROWS) + inner * cfg.elem_bytes
                off = f"+{aoff_k} B" if aoff_k == boff_k else f"A +{aoff_k} B, B +{boff_k} B"
                steps.append({"a": aoff_k >> 4, "b": boff_k >> 4, "acc": acc0 if i == 0 else "1",
                              "note": f"k {k}-{k + MMA_K - 1} ({off}), {inote}"})
            qa, kb = f"{op.a}[{self.slot_note(op.a_slot)}]", f"{op.b}[{self.slot_note(op.b_slot)}]"
            self.what(f"{op.d} = {qa} x {kb}^T (QK: M {ROWS}, N {d.cols}, K {op.k_lo}-{op.k_hi - 1}, "
                      f"{self.acc_note(op, acc0)}) into TMEM cols {d.col}-{d.col_end - 1}")
            kdesc = _desc_k_major(qk)
            self.emit("mma_ss", pre=pre, abase=abase, aoff=aoff, bbase=bbase, boff=boff, desc_hi=hex(kdesc),
                      dcol=d.col, idesc=hex(idesc), steps=steps,
                      adesc_note=f"A desc {qa} K-major: {_sdesc_note(kdesc)}, start = address >> 4",
                      bdesc_note=f"B desc {kb} (K) K-major: {_sdesc_note(kdesc)}, start = address >> 4")
            return
        a, b = pipe.region(op.a), pipe.region(op.b)
        if a.space is not Space.TMEM or a.dtype != "f16" or b.space is not Space.SMEM:
            raise Sm100LoweringError("PV MMA takes P from a 16-bit TMEM region and V from SMEM")
        pb, bbase, boff = self.smem_addr(op.b, op.b_slot, "%rdb")
        pre += pb
        idesc = TcgenInstrDesc.for_dtype(cfg.dtype, ROWS, cfg.head_dim_v, b_major=Major.MN).encode()
        inote = _idesc_note(idesc)
        for i, k in enumerate(range(op.k_lo, op.k_hi, MMA_K)):
            # V [keys, DV], DV contiguous: MN-major; 16 keys = 16 rows of one panel row (plan.Panels) in each panel.
            boff_k = k * vo.row_bytes
            steps.append({"a": a.col + k // 2, "b": boff_k >> 4, "acc": acc0 if i == 0 else "1",
                          "note": f"keys {k}-{k + MMA_K - 1}: A = {op.a} at TMEM col {a.col + k // 2}, "
                                  f"B +{boff_k} B, {inote}"})
        vb = f"{op.b}[{self.slot_note(op.b_slot)}]"
        self.what(f"{op.d} += {op.a}[:, {op.k_lo}:{op.k_hi}] x {vb} (PV: M {ROWS}, N {cfg.head_dim_v}, "
                  f"keys {op.k_lo}-{op.k_hi - 1}, {self.acc_note(op, acc0)}) into TMEM cols {d.col}-{d.col_end - 1}")
        vdesc = _desc_mn_major(vo)
        self.emit("mma_ts", pre=pre, bbase=bbase, boff=boff, desc_hi=hex(vdesc), dcol=d.col,
                  idesc=hex(idesc), steps=steps,
                  bdesc_note=f"B desc {vb} (V) MN-major: {_sdesc_note(vdesc)}, start = address >> 4")

    @staticmethod
    def acc_note(op: Mma, acc0: str) -> str:
        if acc0 == "0":
            return "overwrite"
        if acc0 == "1":
            return "accumulate"
        return "accumulate except on the task's first K/V block"

    def accumulate(self, op: Mma, pre: list) -> str:
        """enable-input-d of the first k step: 0, 1 or a predicate (not_first: block iteration != 0)."""
        if op.accumulate == "false":
            return "0"
        if op.accumulate == "true":
            return "1"
        if op.accumulate != "not_first":
            raise Sm100LoweringError(f"MMA accumulate {op.accumulate!r}: false, true or not_first")
        ref = op.block
        if ref is BlockRef.FIRST:
            return "0"
        if ref is BlockRef.LAST:
            pre.append(("setp.ne.u32", "%p_acc", "%n", "1"))
        elif ref is BlockRef.PREV:
            pre.append(("setp.ne.u32", "%p_acc", "%t", "1"))
        else:
            pre.append(("setp.ne.u32", "%p_acc", "%t", "0"))
        return "%p_acc"

    def op_Commit(self, op: Commit) -> None:
        pre, addr = self.bar_addr(op.barrier, op.slot)
        note = f"commit {self.bar_note(op.barrier, op.slot)}: 1 arrival once this thread's prior MMAs complete"
        self.emit("commit", pre=pre, addr=addr, note=note)

    def tmem_cols(self, region: str, lo: int, hi: int) -> tuple[int, int]:
        r = self.pipe.region(region)
        if r.dtype == "f16":
            if lo % 2 or hi % 2:
                raise Sm100LoweringError(f"{region}: 16-bit columns [{lo}, {hi}) must be pair-aligned")
            return r.col + lo // 2, (hi - lo) // 2
        return r.col + lo, hi - lo

    def op_TmemLd(self, op: TmemLd) -> None:
        r = self.pipe.region(op.region)
        if r.dtype != "f32":
            raise Sm100LoweringError(f"{self.p}: tcgen05.ld of 16-bit region {op.region} is not lowered")
        col, n = self.tmem_cols(op.region, op.col_lo, op.col_hi)
        regs = [self.buf(op.dst, c) for c in range(op.col_lo, op.col_hi)]
        self.pending.setdefault(op.dst, []).extend(range(op.col_lo, op.col_hi))
        self.emit("tmem_ld", col=col, n=n, regs=regs)

    def op_TmemSt(self, op: TmemSt) -> None:
        r = self.pipe.region(op.region)
        col, n = self.tmem_cols(op.region, op.col_lo, op.col_hi)
        if r.dtype == "f16":
            packs = []
            for j, c in enumerate(range(op.col_lo, op.col_hi, 2)):
                pk = self.r("b32", f"pk{c // 2}")
                packs.append((pk, self.buf(op.src, c + 1), self.buf(op.src, c)))
            self.emit("tmem_st", col=col, n=n, regs=[p[0] for p in packs], packs=packs, cvt=self.cvt)
        else:
            want = list(range(op.col_lo, op.col_hi))
            have = self.computed.get(op.src, [])
            missing = [c for c in want if c not in have]
            if missing:
                raise Sm100LoweringError(f"{self.p}: tcgen05.st of {op.src}[{op.col_lo}:{op.col_hi}] stores columns "
                                         f"{missing[:4]}... that no Compute produced since their tcgen05.ld")
            self.computed[op.src] = [c for c in have if c not in want]
            self.emit("tmem_st", col=col, n=n, regs=[self.buf(op.src, c) for c in want], packs=[], cvt=self.cvt)

    @property
    def cvt(self) -> str:
        return {"bf16": "cvt.rn.bf16x2.f32", "fp16": "cvt.rn.f16x2.f32"}[self.cfg.dtype]

    def op_WaitLd(self, op: WaitLd) -> None:
        self.emit("wait_ld")

    def op_WaitSt(self, op: WaitSt) -> None:
        self.emit("wait_st")

    def scalar(self, name: str) -> str:
        table = {"row_max": "ref", "acc_scale": "acc", "row_sum": "sum"}
        if name not in table:
            raise Sm100LoweringError(f"{self.p}: no scalar register for buffer {name!r}")
        return self.r("f32", table[name])

    def buf(self, name: str, col: int) -> str:
        if name in ("s", "p"):
            self.ctx.family("f32", "%s", ROWS)
            return f"%s{col}"
        if name == "o":  # named by O's column (a chunked role's chunk keeps its columns' names)
            self.ctx.family("f32", "%o", max(ROWS, self.cfg.head_dim_v))
            return f"%o{col}"
        raise Sm100LoweringError(f"{self.p}: no register tile for buffer {name!r}")

    def op_SmemSt(self, op: SmemSt) -> None:
        if op.region == "sScale":
            kind, v = self.slot(op.slot)
            if kind != "const":
                raise Sm100LoweringError("sScale is addressed by constant Q-stage slots")
            self.emit("smem_st_row", addr=f"%srow+{v * self.ctx.layout.slot_bytes('sScale')}",
                      src=self.scalar(op.src))
            return
        if op.region != "O_smem":
            raise Sm100LoweringError(f"{self.p}: SmemSt to {op.region} is not lowered")
        cols, self.packed = self.packed, []
        if not cols or len(cols) % 8:
            raise Sm100LoweringError(f"{self.p}: O_smem store without a preceding normalize of whole 8-column groups")
        cfg = self.cfg
        vo = vo_panels(cfg)
        half_bytes, per_row = vo.bytes(cfg.block_m), vo.row_bytes // 16  # 16-byte chunks per panel row
        kind, v = self.slot(op.slot)
        if kind == "const":
            base, pre = "%orow", []
            slot_off = v * self.ctx.layout.slot_bytes("O_smem")
        else:
            base = "%rsa"
            pre = self.resolve(v, slot_dst="%qs") + [
                ("mad.lo.u32", "%rsa", "%qs", str(self.ctx.layout.slot_bytes("O_smem")), "%orow")]
            slot_off = v.slot_base * self.ctx.layout.slot_bytes("O_smem")
        groups = []
        # the TMA store's layout (plan.Panels): 16-byte chunk c of a panel's row R lives at chunk
        # c ^ ((R >> s) % per_row), %xsw holding ((R >> s) % per_row) * 16 (128B: s = 0; 64B: s = 1)
        for g0 in range(cols[0], cols[-1] + 1, 8):
            h, c8 = divmod(g0 // 8, per_row)
            groups.append({"x": c8 * 16, "off": slot_off + h * half_bytes,
                           "regs": [self.r("b32", f"ob{(g0 + 2 * q) // 2}") for q in range(4)]})
        self.emit("smem_st_tile", pre=pre, base=base, groups=groups)

    def op_SmemLd(self, op: SmemLd) -> None:
        if op.region != "sScale":
            raise Sm100LoweringError(f"{self.p}: SmemLd from {op.region} is not lowered")
        kind, v = self.slot(op.slot)
        if kind != "const":
            raise Sm100LoweringError("sScale is addressed by constant Q-stage slots")
        self.emit("smem_ld_row", addr=f"%srow+{v * self.ctx.layout.slot_bytes('sScale')}", dst=self.scalar(op.dst))

    def op_Compute(self, op: Compute) -> None:
        fn = getattr(self, "compute_" + op.fn, None)
        if fn is None:
            raise Sm100LoweringError(f"{self.p}: Compute fn {op.fn!r} has no sm_100a macro")
        fn(op)

    # ---- computes ----------------------------------------------------------------------------
    def row(self) -> dict:
        cfg = self.cfg
        words, where = mask_words(range(cfg.block_n)) if MASK_AS_WORDS[cfg.arch] else ([], [])
        wregs = {w: self.r("b32", f"mw{w}") for w in words}
        elems = []
        for j in range(cfg.block_n):
            frag = j // FRAG_COLS
            emu = bool(emulated_mask(cfg, frag, False)[j % FRAG_COLS])
            e = {"reg": self.buf("s", j), "col": j, "emu": emu, "i": j}
            if words:
                e["mword"], e["mbit"] = wregs[where[j][0]], where[j][1]
            elems.append(e)
        pairs = []
        for i in range(cfg.block_n // 2):
            lo, hi = elems[2 * i], elems[2 * i + 1]
            if lo["emu"] != hi["emu"]:  # emulated_mask's pairs rule: (2i, 2i+1) share the exp path
                raise Sm100LoweringError(f"{self.p}: columns {2 * i} and {2 * i + 1} take different exp paths")
            pairs.append({"lo": lo, "hi": hi, "emu": lo["emu"], "i": i})
        # row max: three-input max.f32 (FMNMX3); row sum: packed add.rn.f32x2 over the (2i, 2i+1)
        # pairs down to one pair, whose halves one scalar add joins (FADD2: half the adds)
        max_ops, max_res = pairwise([e["reg"] for e in elems], "%mx", arity=3)
        sum2_ops, sum2_res = pairwise([f"%sq{i}" for i in range(len(pairs))], "%sqt")
        self.ctx.family("f32", "%mx", len(max_ops))
        self.ctx.family("b64", "%sq", len(pairs))
        self.ctx.family("b64", "%sqt", len(sum2_ops))
        self.ctx.family("f32", "%sm", 2)
        for fam in ("%x", "%ej"):
            self.ctx.family("f32", fam, cfg.block_n)
        for fam in ("%ee", "%eb"):
            self.ctx.family("b32", fam, cfg.block_n)
        for fam in ("%sp", "%xp", "%jp", "%fp", "%pp"):
            self.ctx.family("b64", fam, cfg.block_n // 2)
        for k in ("k_s2", "k_n2", "k_mg2", "k_c02", "k_c12", "k_c22", "k_c32"):
            self.r("b64", k)
        return {"elems": elems, "pairs": pairs, "max_ops": max_ops, "max_res": max_res,
                "sum2_ops": sum2_ops, "sum2_res": sum2_res, "sum_halves": ("%sm0", "%sm1"),
                "mask_words": [{"reg": wregs[w], "base": w * MASK_WORD_BITS} for w in words],
                "mtmp": self.r("b32", "mt"), "magic2": _x2(ROUND_MAGIC),
                "poly2": [_x2(c) for c in EXP2_POLY],
                "ref": self.r("f32", "ref"), "nrs": self.r("f32", "nrs"), "sum": self.r("f32", "sum"),
                "acc": self.r("f32", "acc"), "lim": self.r("b32", "lim"), "bmax": self.r("f32", "bmax")}

    def masked_block(self) -> list[tuple]:
        """%p_mask = this K/V block needs the mask (plan.BlockInfo.needs_mask: it crosses the
        diagonal or Skv, block >= %nunm, or a window's left edge, block < %unmlo)."""
        ins = self.block_reg(BlockRef.CUR, "%nb") + [("setp.ge.s32", "%p_mask", "%nb", "%nunm")]
        if self.cfg.window:
            ins.append(("setp.lt.or.s32", "%p_mask", "%nb", self.r("b32", "unmlo"), "%p_mask"))
        return ins

    def compute_softmax_max(self, op: Compute) -> None:
        cfg = self.cfg
        mask = "causal mask and Skv tail" if cfg.causal else "Skv tail mask"
        blocks = "blocks >= %nunm"
        if cfg.window:
            mask, blocks = f"window ({'causal, ' if cfg.causal else ''}keys [%cbegin, %climit))", \
                "blocks >= %nunm or < %unmlo"
        if cfg.softcap:
            mask = f"softcap (S = tanh(S * softcap_in)), then {mask}"
        self.what(f"softmax_max (Q tile {op.qtile}): {mask} on {blocks}, row max of S "
                  f"({cfg.block_n} cols), conditional rescale decision (threshold {cfg.rescale_threshold:g}: the "
                  "reference max moves, acc_scale = 2^((old-new)*scale), only when the block max exceeds it by "
                  "more, else acc_scale = 1)")
        row = self.row()
        extra = {"softcap": None, "window": None}
        if cfg.softcap:  # tanh.approx.f32 of every raw score times softcap_in, before the mask and the max
            self.ctx.family("b64", "%sp", cfg.block_n // 2)
            extra["softcap"] = {"cap": self.r("f32", "capin"), "cap2": self.r("b64", "k_cap2")}
        if cfg.window:  # the row's first visible column of this block: %cbegin - 128 * block
            if not row["mask_words"]:
                raise Sm100LoweringError(f"{self.p}: the window mask is spelled as mask words (plan.MASK_AS_WORDS)")
            extra["window"] = {"begin": self.r("b32", "cbegin"), "blim": self.r("b32", "blim"),
                               "bw": self.r("b32", "mbw")}
        self.emit("softmax_max", pre=self.masked_block(), row=row, skip=self.label("nomask"),
                  threshold=f32(-self.cfg.rescale_threshold), **extra)

    def compute_softmax_exp(self, op: Compute) -> None:
        row = self.row()
        has_emu = any(e["emu"] for e in row["elems"])
        n_emu, n = sum(e["emu"] for e in row["elems"]), len(row["elems"])
        split = (f"{n_emu} of {n} columns on the FMA cubic (packed f32x2), the rest on MUFU ex2, "
                 f"masked blocks all {n} on MUFU" if n_emu else f"all {n} columns on MUFU ex2")
        self.what(f"softmax_exp (Q tile {op.qtile}): P = 2^(S*scale - ref*scale) (packed f32x2 FMA), {split}")
        self.emit("softmax_exp", row=row, has_emu=has_emu, hw=self.label("exp_hw"), done=self.label("exp_done"),
                  poly=[f32(c) for c in EXP2_POLY])

    def compute_row_sum(self, op: Compute) -> None:
        self.what(f"row_sum (Q tile {op.qtile}): row_sum = row_sum * acc_scale + sum of P ({self.cfg.block_n} cols, "
                  "this thread's share)")
        self.emit("row_sum", row=self.row())

    def _take(self, buf: str) -> list[int]:
        cols = self.pending.pop(buf, [])
        if not cols:
            raise Sm100LoweringError(f"{self.p}: compute on buffer {buf!r} without a preceding tcgen05.ld")
        return cols

    def compute_rescale_o(self, op: Compute) -> None:
        cols = self._take("o")
        self.what(f"correction: O{op.qtile}[{cols[0]}:{cols[-1] + 1}] *= acc_scale (packed f32x2)")
        self.computed.setdefault("o", []).extend(cols)  # stored back from the same registers
        acc = self.scalar("acc_scale")
        self.emit("rescale_o", regs=[self.buf("o", c) for c in cols], pairs=self._x2_pairs(cols, "%k_a2"),
                  factors=[(self.r("b64", "k_a2"), acc)])

    def _x2_pairs(self, cols: list[int], factor2: str) -> list[tuple]:
        """(lo, hi, pair register, factor pair) for o columns (c, c + 1): packed f32x2 operands."""
        if len(cols) % 2 or any(cols[i + 1] != cols[i] + 1 for i in range(0, len(cols), 2)):
            raise Sm100LoweringError(f"{self.p}: o columns {cols[:4]}... do not form (even, odd) pairs")
        self.ctx.family("b64", "%op", max(ROWS, self.cfg.head_dim_v) // 2)
        return [(self.buf("o", c), self.buf("o", c + 1), f"%op{c // 2}", factor2) for c in cols[::2]]

    def compute_normalize(self, op: Compute) -> None:
        cols = self._take("o")
        self.what(f"normalize: O{op.qtile}[{cols[0]}:{cols[-1] + 1}] *= 1/row_sum (0 for a row without keys, "
                  f"packed f32x2), cast to {self.cfg.dtype} pairs")
        rs = self.scalar(op.reads[1] if len(op.reads) > 1 else "row_sum")
        pairs = [(self.r("b32", f"ob{c // 2}"), self.buf("o", c + 1), self.buf("o", c)) for c in cols[::2]]
        self.packed = cols
        inv = self.r("f32", "inv")
        self.emit("normalize", regs=[self.buf("o", c) for c in cols], sum=rs, inv=inv,
                  pairs=pairs, cvt=self.cvt, scaled=self._x2_pairs(cols, "%k_i2"),
                  factors=[(self.r("b64", "k_i2"), inv)])

    def compute_normalize_partial(self, op: Compute) -> None:
        cols = self._take("o")
        self.what(f"normalize_partial: O{op.qtile}[{cols[0]}:{cols[-1] + 1}] *= 1/row_sum (0 for a row without "
                  "keys, packed f32x2), kept in fp32 for the split's partial O")
        rs = self.scalar(op.reads[1] if len(op.reads) > 1 else "row_sum")
        self.computed.setdefault("o", []).extend(cols)
        self.emit("normalize", regs=[self.buf("o", c) for c in cols], sum=rs, inv=self.r("f32", "inv"),
                  pairs=[], cvt=self.cvt, scaled=self._x2_pairs(cols, "%k_i2"),
                  factors=[(self.r("b64", "k_i2"), self.r("f32", "inv"))])

    def compute_store_lse_partial(self, op: Compute) -> None:
        self.what(f"store_lse_partial (Q tile {op.qtile}): LSE = (ref*scale + log2(row_sum)) * ln 2 (-inf for a "
                  "row without keys) to lse_partial[split * R + (b * Sq + seq) * Hq + head], rows < Sq only")
        self.emit("store_lse_partial", ln2=f32(LN2), g=self.cfg.gqa_ratio, neg_inf=NEG_INF, t2=self.r("b32", "kt2"))

    def compute_apply_sink(self, op: Compute) -> None:
        """The head's sink z (sink_ptr[head], natural log of the scaled score) joins the row: in the
        kernel's log2 units s2 = z log2(e), m' = ref * scale, M = max(m', s2),
        l' = row_sum 2^(m' - M) + 2^(s2 - M), LSE = (M + log2 l') ln 2 (-inf when l' is not > 0:
        no key and a sink of -inf); O's divisor becomes row_sum + 2^(s2 - m') (= l' 2^(M - m')), so
        O = acc 2^(m' - M) / l'. A row without keys (m' = -inf) gets an infinite divisor, O = 0, and
        LSE = z; a sink of -inf changes nothing. %lsev holds the LSE for store_lse."""
        self.what(f"apply_sink (Q tile {op.qtile}): sink z = sink_ptr[head]; LSE = ln2 (M + log2(row_sum 2^(m'-M) + "
                  "2^(z log2e - M))), M = max(m', z log2e), m' = ref*scale; row_sum += 2^(z log2e - m') for O")
        self.emit("apply_sink", s2=self.r("f32", "snk"), m2=self.r("f32", "snkm"), mx=self.r("f32", "snkM"),
                  f=self.r("f32", "snkf"), e=self.r("f32", "snke"), log2e=f32(1.0 / LN2), ln2=f32(LN2),
                  neg_inf=NEG_INF, zero=ZERO)

    def compute_store_lse(self, op: Compute) -> None:
        if self.cfg.varlen:
            self.what(f"store_lse (Q tile {op.qtile}): LSE = (ref*scale + log2(row_sum)) * ln 2 (-inf for a row "
                      "without keys) to lse[head, row of the packed batch], rows of the sequence only")
        else:
            self.what(f"store_lse (Q tile {op.qtile}): LSE = (ref*scale + log2(row_sum)) * ln 2 (-inf for a row "
                      "without keys) to lse[b, head, seq], rows < Sq only")
        self.emit("store_lse", ln2=f32(LN2), g=self.cfg.gqa_ratio, neg_inf=NEG_INF, varlen=self.cfg.varlen,
                  sink=self.cfg.sinks)


def _desc_k_major(pn: Panels) -> int:
    """Q or K (K-major) with the panels' swizzle: the address-independent bits (start 0)."""
    return SmemMatrixDesc.k_major(DescArch.SM100A, 0, pn.swizzle).encode()


def _idesc_note(value: int) -> str:
    """The comment beside a tcgen05.mma: its instruction descriptor decoded (not the config's intent)."""
    return "idesc: " + TcgenInstrDesc.decode(value).describe()


def _sdesc_note(value: int) -> str:
    """An SMEM matrix descriptor constant decoded (encodings.SmemMatrixDesc.decode)."""
    return SmemMatrixDesc.decode(value, DescArch.SM100A).describe()


def _desc_mn_major(pn: Panels) -> int:
    """V (MN-major) with the panels' swizzle, its DV columns spanned through LBO = the 128-row panel stride."""
    return SmemMatrixDesc.mn_major(DescArch.SM100A, 0, pn.swizzle, panel_stride=pn.bytes(ROWS)).encode()


def _panel_swizzle(pn: Panels) -> dict:
    """A panel's row swizzle as the templates spell it (plan.Panels.row_swizzle_shift): 16-byte chunk c of
    row R at c ^ ((R >> sw_shift) & mask), rows row_bytes apart; shift = log2(chunks per row)."""
    chunks = pn.row_bytes // 16
    return {"row_bytes": pn.row_bytes, "mask": chunks - 1, "shift": chunks.bit_length() - 1,
            "sw_shift": pn.row_swizzle_shift}


def lower_sm100(pipe: Pipeline) -> dict:
    """Template context for templates/sm100/fa4_fwd.ptx.j2 from an sm_100a pipeline."""
    cfg = pipe.config
    if pipe.arch != TARGET or cfg.arch != TARGET:
        raise Sm100LoweringError(f"arch {cfg.arch!r}: this lowering emits {TARGET} only")
    refuse_planned(cfg, Sm100LoweringError)
    try:
        qk_panels(cfg), vo_panels(cfg)
    except PlanError as e:  # a width no swizzled panel divides
        raise Sm100LoweringError(f"head_dim {cfg.head_dim}/{cfg.head_dim_v}: {e}") from None
    check_tmem_alloc(pipe.tmem_alloc_cols)
    layout = smem_layout(pipe, Sm100LoweringError)
    # One warp owns TMEM: it allocates (the MMA issuer's, as in the seed) and, after the final
    # sync, frees it. Only that warp may execute tcgen05.dealloc (a second dealloc of the same
    # columns is an error: the emulator found every warp of the owning role freeing them).
    mma_roles = [r for r in pipe.roles if any(isinstance(op, Mma) for op in walk_ops(r.program))]
    alloc_warp = mma_roles[0].warps[0] if mma_roles else 0
    dealloc_role = next(r.name for r in pipe.roles if alloc_warp in r.warps)
    ctx = WalkCtx(pipe, layout, alloc_warp)
    roles = [_RoleEmitter(ctx, r).run() for r in pipe.roles]
    inits = []
    for b in pipe.barriers:
        if b.kind is BarrierKind.NAMED:
            continue
        for s in range(b.slots):
            tx = f", {b.tx_bytes} transaction bytes" if b.tx_bytes else ""
            inits.append({"addr": f"%bar+{layout.barriers[b.name] + 8 * s}", "count": b.count,
                          "what": f"init {b.name}[{s}]: {b.kind.value}, {b.count} arrival{'s' if b.count != 1 else ''} "
                                  f"per phase{tx}"})
    bar_base = min(layout.barriers.values())
    decls = ctx.decls()
    return {
        "generator_version": GENERATOR_VERSION,
        "name": cfg.name,
        "ptx_version": PTX_VERSION_FOR_ARCH["sm_100a"],
        "target": TARGET,
        "entry": ENTRY,
        "param_decls": [decl for _, decl in entry_params(pipe)],
        "threads": pipe.threads,
        "maxnreg": ARCH_LIMITS[TARGET].regs_per_sm // pipe.threads,
        "causal": cfg.causal,
        "varlen": cfg.varlen,
        "head_dim": cfg.head_dim,
        "dtype": cfg.dtype,
        "G": cfg.gqa_ratio,
        "P": cfg.gqa_pack,
        "NG": cfg.head_groups,
        "sqt": cfg.seq_q_per_tile,
        "kv_stages": cfg.kv_stages,
        "k_split": cfg.k_split,
        "smem": layout,
        "bar_base": bar_base,
        "tmem_slot": layout.tmem_slot,
        "tmem_cols": pipe.tmem_alloc_cols,
        "alloc_warp": alloc_warp,
        "dealloc_role": dealloc_role,
        "inits": inits,
        "decls": decls,
        "roles": roles,
        "dispatch": dispatch(pipe, roles, Sm100LoweringError),
        "neg_inf": NEG_INF,
        "one": ONE,
        "zero": ZERO,
        "notes": list(pipe.notes),
        "kvcache": cfg.kvcache,
        "page_size": cfg.page_size,
        # the module's second entry (templates/common/combine.ptx.j2, target-independent SIMT PTX)
        **({"cmb": combine_context(cfg), "cvt_pack": {"bf16": "cvt.rn.bf16x2.f32", "fp16": "cvt.rn.f16x2.f32"}[cfg.dtype],
            "ln2": f32(LN2), "log2e": f32(1.0 / LN2)} if cfg.kvcache else {}),
    }


# ---------------------------------------------------------------------------------------------------
# Manifest


def manifest_sm100(pipe: Pipeline) -> dict:
    """The ABI manifest (fa4gen.lower.manifest) with the sm_100a facts: the SMEM layout derived from
    the pipeline, whole 128-row O boxes, cfg.tiles_per_task Q tiles per task (one CTA per task when causal, except
    KV-cache kernels), and the layout's own section."""
    cfg = pipe.config
    layout = smem_layout(pipe, Sm100LoweringError)
    # causal dense kernels launch one CTA per task (the hardware deals them); the dynamic deal's CTAs
    # take tasks until none is left, so its grid is persistent
    grid = GridFacts(policy="one_per_task" if cfg.causal and not cfg.kvcache and not dynamic_tasks(cfg) else "persistent",
                     deal=DYNAMIC_DEAL if dynamic_tasks(cfg) else ", task += gridDim.x", lpt_deal="", varlen_lpt=False, mode_keys=True, launch=True)
    return manifest(pipe, smem_bytes=layout.total, o_rows=cfg.block_m, grid=grid, sections=smem_layout_section(layout))


def lowered_sm100(pipe_or_cfg) -> tuple[dict, dict]:
    """(template context, ABI manifest) of the sm_100a kernel; render.kernels.build_sm100 renders it. Takes a
    KernelConfig (builds its pipeline, unverified: fa4gen.codegen.build is the verified chain) or a Pipeline."""
    if isinstance(pipe_or_cfg, KernelConfig):
        from ..ir import build_pipeline

        pipe = build_pipeline(pipe_or_cfg)
    else:
        pipe = pipe_or_cfg
    return lower_sm100(pipe), manifest_sm100(pipe)


SPELLING = _RoleEmitter.spelling(TCGEN05_PTX, single=("%p_el",))
