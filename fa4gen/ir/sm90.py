"""The sm_90a (Hopper) pipeline, as IR: the programs fa4gen/lower/sm90.py lowers the kernel from.

CTA = 1 + C warpgroups. WG0 warp 0 is the TMA producer (warps 1-3 idle, same setmaxnreg), WG1 .. WGC
are consumers that each own 64 rows of the block_m-row Q tile (C = block_m / 64: 2, or 3 for the
192-row tiles of tiles.SM90_Q_ROWS). S, P and O live in registers (wgmma
accumulators; P as the RS-form A fragments), so the TMEM hand-offs of sm_100a become
`wgmma.wait_group` (MmaWait) points. Q has two SMEM slots (the next task's Q loads under this
task's K/V loop; one where two do not fit, D = 192 and 256), K and V separate rings of block_n-key
blocks (each with its own tile size and tx count: K D columns, V DV; 64 keys at D = 256); O leaves through a staging slot per consumer (a TMA store, or
varlen's row copies) where one fits beside the rings, else from the registers (KV cache, and the
(192, 128) and D = 256 kernels: `sm90_o_staged`); every empty
barrier gets one arrival per consumer warp (4 C). C 256-thread named barriers pass the tensor core
around the consumers in a ring (ping-pong; consumer i hands it to i + 1 mod C): consumer C - 1
pre-arrives once so consumer 0 goes first, and consumer 0 takes the last hand-off after its final task.
"""

from __future__ import annotations

from ..spec.config import K_SPLIT_DEFAULT, KV_STAGES_MAX, KV_STAGES_MIN, ConfigError, KernelConfig
from ..spec.plan import (ARCH_LIMITS, SM90_CONSUMER_REGS, SM90_WG_ROWS, dynamic_tasks, sm90_idle_consumers, sm90_overlap, sm90_pack_first, sm90_regs, SM90_PRODUCER_REGS, SM90_SCHED_BAR_ID, block_n, q_tile_bytes,
                         sm90_consumers, sm90_epi_bar_id, tile_bytes, v_tile_bytes)
from ..spec.tiles import PlanError
from .core import (Advance, Arrive, Barrier, BarrierKind, BlockRef, Compute, Cond, ExpectTx, FenceProxyAsync,
                   If, InstSlot, Loop, LoopKind, Mma, PageLookup, MmaWait, NamedArrive, NamedSync, Pipeline, Region, Role, Scope,
                   SmemSt, Space, State, StoreRows, TmaLoad, TmaStore, TmaStoreWait, Wait, instantiate)
from .layout import fits, o_staged as o_staged_rule
from .tasks import task_ring, with_task_head

TARGET = "sm_90a"

SCHED_BAR_ID = SM90_SCHED_BAR_ID
PRODUCER_REGS, CONSUMER_REGS = SM90_PRODUCER_REGS, SM90_CONSUMER_REGS


def _smem(cfg: KernelConfig, nq: int, kv: int, o_staged: bool) -> tuple[tuple[Region, ...], tuple[Barrier, ...]]:
    """The regions and barriers of the kernel with nq Q slots, a kv-deep K/V ring and (o_staged) an
    O staging slot per consumer."""
    dv, tile, vtile, qtile = cfg.head_dim_v, tile_bytes(cfg), v_tile_bytes(cfg), q_tile_bytes(cfg)
    nc = sm90_consumers(cfg.block_m)
    arrivals = 4 * nc  # one per consumer warp
    regions = (
        Region("Q", Space.SMEM, cfg.dtype, cfg.block_m, slots=nq, bytes_per_slot=qtile),
        Region("K", Space.SMEM, cfg.dtype, block_n(cfg), slots=kv, bytes_per_slot=tile),
        Region("V", Space.SMEM, cfg.dtype, block_n(cfg), slots=kv, bytes_per_slot=vtile),
        # O from the registers (KV cache, or no staging fits): no staging slots
        *((Region("O_smem", Space.SMEM, cfg.dtype, SM90_WG_ROWS, slots=nc, bytes_per_slot=SM90_WG_ROWS * dv * 2),)
          if o_staged else ()),
        Region("S", Space.REG, "f32", SM90_WG_ROWS),
        Region("P", Space.REG, cfg.dtype, SM90_WG_ROWS),
        Region("O", Space.REG, "f32", SM90_WG_ROWS),
    )
    barriers = (
        Barrier("q_full", BarrierKind.TMA, nq, 1, tx_bytes=qtile),
        Barrier("q_empty", BarrierKind.MBAR, nq, arrivals),
        Barrier("k_full", BarrierKind.TMA, kv, 1, tx_bytes=tile),
        Barrier("k_empty", BarrierKind.MBAR, kv, arrivals),
        Barrier("v_full", BarrierKind.TMA, kv, 1, tx_bytes=vtile),
        Barrier("v_empty", BarrierKind.MBAR, kv, arrivals),
        Barrier("sched", BarrierKind.NAMED, nc, 256, named_id=SCHED_BAR_ID),
        *((Barrier("epi", BarrierKind.NAMED, nc, 128, named_id=sm90_epi_bar_id(nc)),) if o_staged else ()),
    )
    if dynamic_tasks(cfg):  # the dynamic deal's hand-off (ir/tasks.py): the producer to every consumer thread
        ring_regions, ring_barriers = task_ring(128 * nc)
        regions, barriers = regions + ring_regions, barriers + ring_barriers
    return regions, barriers


def smem_pipeline(cfg: KernelConfig, nq: int, kv: int, o_staged: bool | None = None) -> Pipeline:
    """The kernel's regions and barriers with nq Q slots, a kv-deep K/V ring and O staged or not
    (None: as the kernel does, `sm90_o_staged`), without roles: what its SMEM layout (ir/layout.py)
    is computed from."""
    staged = sm90_o_staged(cfg) if o_staged is None else o_staged
    return Pipeline(cfg, TARGET, 4 * (1 + sm90_consumers(cfg.block_m)), *_smem(cfg, nq, kv, staged), (), 0,
                    ARCH_LIMITS[TARGET].smem_per_cta)


def _fits(cfg: KernelConfig, nq: int, kv: int, o_staged: bool | None = None) -> bool:
    """The layout of the pipeline with these rings (ir/layout.py, the kernel's own) fits the SMEM limit."""
    return fits(smem_pipeline(cfg, nq, kv, o_staged))


def sm90_o_staged(cfg: KernelConfig) -> bool:
    """Whether the consumers stage O in SMEM (a TMA store of 64 rows each; varlen: row copies to
    o_ptr) or store it from the registers (each thread its rows < Sq, st.global through o_ptr).
    KV-cache kernels always store from the registers (their O rows and fp32 split partials are row
    stores); the others stage O where the smallest ring, 1 Q slot and KV_STAGES_MIN K/V stages,
    fits beside the staging slots (D = 64, 96 and 128; not (192, 128) nor 256: docs/HEAD_DIMS.md)."""
    return not cfg.kvcache and o_staged_rule(smem_pipeline(cfg, 1, KV_STAGES_MIN, o_staged=True))


def sm90_stages(cfg: KernelConfig, kv_cap: int | None = None) -> tuple[int, int]:
    """(Q slots, K/V ring depth) of the kernel: the config's, capped by what fits in SMEM (the
    manifest records the result). kv_cap replaces cfg.kv_stages as the deepest ring asked for.

    Q slots (cfg.q_stages, 2) hold consecutive tasks' tiles of a persistent CTA, so the next tile's
    Q loads while this one finishes; K/V keep at least 2 stages, and Q drops to 1 slot before
    K/V would (D = 128: 2 Q + 2x2 K/V + O = 224 KiB fits; 3 K/V stages would not).

    Kernels that store O from the registers (sm90_o_staged) have no O staging. (KV cache: one Q slot
    and a third K/V stage at D = 128, 224 KiB, measured the same on contiguous caches and 1.5-4%
    slower on paged ones on the H200, bench/results/2026-12-02T152230Z_kvcache.json: not taken.)
    """
    cap = cfg.kv_stages if kv_cap is None else kv_cap

    def deepest(nq: int) -> int:
        return next((kv for kv in range(cap, 1, -1) if _fits(cfg, nq, kv)), 0)

    nq = cfg.q_stages
    while nq > 1 and deepest(nq) < 2:
        nq -= 1
    kv = deepest(nq)
    if kv < KV_STAGES_MIN:
        raise PlanError(f"head_dim {cfg.head_dim}: fewer than {KV_STAGES_MIN} K/V stages fit in SMEM")
    return nq, kv


def refuse_ignored(cfg: KernelConfig) -> KernelConfig:
    """Options sm_90a would ignore are refused, not silently folded into a new name for the same
    kernel: it has no TMEM P split (k_split), and its K/V ring takes kv_stages only as far as SMEM
    allows (the default, 3, is capped to what fits; an explicit other value must fit)."""
    if cfg.k_split != K_SPLIT_DEFAULT[cfg.causal]:
        raise ConfigError("k_split", cfg.k_split, "sm_100a only (the TMEM P split); sm_90a keeps P in registers")
    default_stages = KernelConfig.__dataclass_fields__["kv_stages"].default
    fit = sm90_stages(cfg, kv_cap=KV_STAGES_MAX)[1]
    if cfg.kv_stages != default_stages and cfg.kv_stages > fit:
        raise ConfigError("kv_stages", cfg.kv_stages, f"at most {fit} K/V stages fit in sm_90a SMEM beside "
                                                       f"{sm90_stages(cfg)[0]} Q slots at head_dim {cfg.head_dim}")
    return cfg


def build_sm90_pipeline(cfg: KernelConfig) -> Pipeline:
    if cfg.arch != TARGET:
        raise ValueError(f"build_sm90_pipeline needs arch sm_90a, got {cfg.arch}")
    d, tile, vtile, qtile = cfg.head_dim, tile_bytes(cfg), v_tile_bytes(cfg), q_tile_bytes(cfg)
    # the verified pipeline has exactly the rings the emitted PTX has: both read them from here
    nq, kv = sm90_stages(cfg)
    staged = sm90_o_staged(cfg)
    nc = sm90_consumers(cfg.block_m)
    producer_regs, consumer_regs = sm90_regs(cfg)
    regions, barriers = _smem(cfg, nq, kv, staged)

    def load(tensor: str, bar: str, state: str, block: BlockRef, dst: str):
        nbytes = {"q": qtile, "k": tile, "v": vtile}[tensor]
        # paged K/V: the block's page-table entries are read before the empty wait (their latency
        # hides under it); K(t) and V(t-1) are different blocks, so each load looks its block up
        lookup = (PageLookup(block),) if cfg.page_size and tensor != "q" else ()
        return (*lookup, Wait(f"{bar}_empty", state), ExpectTx(f"{bar}_full", state, nbytes),
                TmaLoad(tensor, dst, state, f"{bar}_full", state, nbytes, block=block), Advance(state))

    producer = Role("producer", (0,), producer_regs,
                    (State("q", nq, 1), State("k", kv, 1), State("v", kv, 1)),
                    (Loop(LoopKind.TASKS, (
                        *load("q", "q", "q", BlockRef.FIRST, "Q"),
                        *load("k", "k", "k", BlockRef.FIRST, "K"),
                        Loop(LoopKind.KV_REST, (*load("k", "k", "k", BlockRef.CUR, "K"),
                                                *load("v", "v", "v", BlockRef.PREV, "V"))),
                        *load("v", "v", "v", BlockRef.LAST, "V"),
                    )),))

    # One program for the C consumer warpgroups (instance i owns rows 64 i .. 64 i + 63 of the tile,
    # O_smem slot i and epilogue barrier i; InstSlot(1) is the next consumer of the ping-pong ring).
    me, nxt = InstSlot(0), InstSlot(1)

    def qk(block):
        return Mma("qk", "Q", "q", "K", "k", "S", 0, d, "false", block)

    def pv(block):
        return Mma("pv", "P", 0, "V", "v", "O", 0, block_n(cfg), "not_first", block)

    rescale = If(Cond.ANY_RESCALE, (Compute("rescale_o", me, reads=("O",), writes=("O",)),))
    release_q = If(Cond.LAST_BLOCK, (Arrive("q_empty", "q", Scope.WARP),))
    softmax = Compute("softmax", me, reads=("S",), writes=("S",))
    pack = Compute("pack_p", me, reads=("S",), writes=("P",))
    blocks = (
        Wait("k_full", "k"), NamedSync("sched", me), qk(BlockRef.FIRST), NamedArrive("sched", nxt),
        MmaWait(0), Arrive("k_empty", "k", Scope.WARP), Advance("k"), release_q,
        softmax, pack,
        Loop(LoopKind.KV_REST, (
            Wait("k_full", "k"), Wait("v_full", "v"), NamedSync("sched", me),
            qk(BlockRef.CUR), pv(BlockRef.PREV), NamedArrive("sched", nxt),
            MmaWait(1),  # S(t) done; O += P V(t-1) may still run under this block's softmax
            Arrive("k_empty", "k", Scope.WARP), Advance("k"), release_q,
            softmax,
            MmaWait(0), Arrive("v_empty", "v", Scope.WARP), Advance("v"),
            # O *= acc(t) once the PV that wrote O completed, outside the tensor-core turn; P registers
            # are rewritten only after the PV MMA that read them completed; which first: plan.sm90_pack_first
            *((pack, rescale) if sm90_pack_first(cfg) else (rescale, pack)),
        )) if sm90_overlap(cfg) else Loop(LoopKind.KV_REST, (
            # no room for S(t) and P(t-1) at once (plan.sm90_overlap): the PV first, then the QK, in one turn
            Wait("k_full", "k"), Wait("v_full", "v"), NamedSync("sched", me),
            pv(BlockRef.PREV), MmaWait(0),  # P(t-1)'s registers are free before S(t) is written
            qk(BlockRef.CUR), NamedArrive("sched", nxt),
            Arrive("v_empty", "v", Scope.WARP), Advance("v"),
            MmaWait(0),
            Arrive("k_empty", "k", Scope.WARP), Advance("k"), release_q,
            softmax,
            rescale,  # O *= acc(t): the PV that wrote O completed before the QK
            pack,
        )),
        Wait("v_full", "v"), NamedSync("sched", me), pv(BlockRef.LAST), NamedArrive("sched", nxt),
        MmaWait(0), Arrive("v_empty", "v", Scope.WARP), Advance("v"),
    )
    if sm90_idle_consumers(cfg):
        # a consumer whose 64 rows are all past Sq (the last tile of a sequence; decode: Sq * G rows
        # fit the first) keeps every barrier step of the blocks, in order, without the GEMMs and the
        # softmax (its O stays 0; no row of it is stored)
        idle = (
            Wait("k_full", "k"), NamedSync("sched", me), NamedArrive("sched", nxt),
            Arrive("k_empty", "k", Scope.WARP), Advance("k"), release_q,
            Loop(LoopKind.KV_REST, (
                Wait("k_full", "k"), Wait("v_full", "v"), NamedSync("sched", me), NamedArrive("sched", nxt),
                Arrive("k_empty", "k", Scope.WARP), Advance("k"), release_q,
                Arrive("v_empty", "v", Scope.WARP), Advance("v"),
            )),
            Wait("v_full", "v"), NamedSync("sched", me), NamedArrive("sched", nxt),
            Arrive("v_empty", "v", Scope.WARP), Advance("v"),
        )
        blocks = (If(Cond.ROWS_IN_SQ, blocks, idle),)
    body = (
        Wait("q_full", "q"),
        *blocks,
        Compute("normalize", me, reads=("O",), writes=("O",)),
        *(  # KV cache: each thread stores its rows of O straight from the registers, rows < Sq only:
            # one split, the output (and LSE when asked); several, the fp32 partials fa4_combine merges
            (If(Cond.SPLIT_KV, (Compute("store_lse_partial", me), Compute("store_o_partial", me, reads=("O",))),
                (If(Cond.HAS_LSE, (Compute("store_lse", me),)), Compute("store_o_rows", me, reads=("O",)))),)
            if cfg.kvcache else (If(Cond.HAS_LSE, (Compute("store_lse", me),)),) + (
            # no staging: each thread stores its rows < Sq of O from the registers through o_ptr
            (Compute("store_o_rows", me, reads=("O",)),) if not staged else
            # varlen: the WG's threads copy the sequence's rows to o_ptr
            (NamedSync("epi", me),  # every thread of the WG has read the previous task's O_smem
             SmemSt("O_smem", me, "O"), NamedSync("epi", me), StoreRows("O_smem", me)) if cfg.varlen else
            (TmaStoreWait(), NamedSync("epi", me),  # the previous task's store has read O_smem
             SmemSt("O_smem", me, "O"), FenceProxyAsync(), NamedSync("epi", me), TmaStore("O_smem", me)))),
        Advance("q"),
    )
    consumer = Role("consumer", (4, 5, 6, 7), consumer_regs,
                    (State("q", nq, 0), State("k", kv, 0), State("v", kv, 0)),
                    (If(Cond.LAST_INSTANCE, (NamedArrive("sched", 0),)),  # the last hands consumer 0 the first turn
                     Loop(LoopKind.TASKS, body),
                     If(Cond.FIRST_INSTANCE, (NamedSync("sched", 0),)),  # consumer 0 takes the last hand-off
                     *((TmaStoreWait(),) if staged else ())),
                    instances=nc)

    if dynamic_tasks(cfg):
        # the dynamic deal (ir/tasks.py): the producer fetches each task index and hands it to the
        # consumers through T, before every exit test (the index that ends the loop too)
        producer, consumer = with_task_head(producer, fetcher=True), with_task_head(consumer, fetcher=False)
    roles = (producer, Role("producer_idle", (1, 2, 3), producer_regs, (), ()),
             *(instantiate(consumer, i) for i in range(nc)))
    return Pipeline(cfg, TARGET, 4 * (1 + nc), regions, barriers, roles, 0, ARCH_LIMITS[TARGET].smem_per_cta,
                    notes=(f"{kv} K/V stages", "ping-pong consumers" if nc == 2 else f"ping-pong ring of {nc} consumers"),
                    replicated=(consumer,))
