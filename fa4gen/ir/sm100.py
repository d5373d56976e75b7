"""The sm_100a (Blackwell) FA4 forward pipeline, as IR.

One CTA task = (batch, kv_head, m_block) with two 128-row Q tiles in flight (Q stages 0 and 1).
Warps: WG0 / WG1 softmax for Q tile 0 / 1, WG2 correction, WG3 warp 0 MMA, warp 1 TMA load,
warp 2 TMA store, warp 3 idle. K and V blocks share one SMEM ring (K[n-1], V[n-1], K[n-2], ...),
so the K walk and the V walk are two States over the same ring with stride 2.

Where two tiles' S and O do not fit TMEM (DV = 256: KernelConfig.tiles_per_task == 1) a task holds
one Q tile: WG0 its softmax, WG1 idle, S0 at TMEM columns [0, 128) and O0 at [256, 512), the same
roles and barriers with one slot per tile (docs/HEAD_DIMS.md "sm_100a", D = 256).
"""

from __future__ import annotations

from ..spec.config import KV_STAGES_MIN, KernelConfig
from ..spec.plan import ARCH_LIMITS, SM100_STATS_BAR_ID, dynamic_tasks, tile_bytes as plan_tile_bytes, v_tile_bytes
from .core import (Advance, Arrive, Barrier, BarrierKind, BlockRef, Commit, Compute, Cond, ExpectTx,
                   FenceProxyAsync, If, Loop, LoopKind, Mma, NamedArrive, NamedSync, Pipeline, Region,
                   PageLookup, Role, Scope, SmemLd, SmemSt, Space, State, StoreO, StorePartial, StoreRows, TmaLoad, TmaStore, TmaStoreWait, TmemLd,
                   TmemSt, Wait, WaitLd, WaitSt)
from .layout import fits, o_staged as o_staged_rule
from .tasks import task_ring, with_task_head

LIMITS = ARCH_LIMITS["sm_100a"]  # the kernel allocates all of TMEM
LD_CHUNK = 32  # softmax reads S and writes P in 32-column tcgen05.ld/st chunks
RESCALE_CHUNK = 16  # correction rescales O 16 columns at a time (seed: RESCALE_TILE)
STATS_BAR_ID = SM100_STATS_BAR_ID
SOFTMAX_REGS, CORRECTION_REGS, WG3_REGS = 200, 64, 48  # 128 x (200 + 200 + 64 + 48) = 65,536
IDLE_WG_REGS = 24  # a warpgroup without a role (WG1 with one Q tile per task): setmaxnreg's minimum


def regions(cfg: KernelConfig, kv: int | None = None, o_staged: bool | None = None,
            tiles: int | None = None) -> tuple[Region, ...]:
    """The kernel's regions with a kv-deep K/V ring (None: sm100_kv_stages) and O staged in SMEM or
    not (None: sm100_o_staged): per Q tile i (tiles, None: cfg.tiles_per_task) a Q slot, S_i at TMEM
    column 128 i with P_i in its upper half, and O_i at 256 + 128 i."""
    kv = sm100_kv_stages(cfg) if kv is None else kv
    staged = sm100_o_staged(cfg) if o_staged is None else o_staged
    nt = cfg.tiles_per_task if tiles is None else tiles
    dv, tile_bytes, vtile = cfg.head_dim_v, plan_tile_bytes(cfg), v_tile_bytes(cfg)
    tmem = []
    for i in range(nt):
        tmem += [Region(f"S{i}", Space.TMEM, "f32", 128, col=128 * i, cols=128),
                 Region(f"P{i}", Space.TMEM, "f16", 128, col=128 * i + 64, cols=64, alias_of=f"S{i}")]
    tmem += [Region(f"O{i}", Space.TMEM, "f32", 128, col=256 + 128 * i, cols=dv) for i in range(nt)]
    return (
        Region("Q", Space.SMEM, cfg.dtype, 128, slots=nt, bytes_per_slot=tile_bytes),
        # K and V share the ring: a slot holds the larger of the two tiles
        Region("KV", Space.SMEM, cfg.dtype, 128, slots=kv, bytes_per_slot=max(tile_bytes, vtile)),
        # O from the registers (StoreO) where no staging fits: no staging slots
        *((Region("O_smem", Space.SMEM, cfg.dtype, 128, slots=nt, bytes_per_slot=vtile),) if staged else ()),
        Region("sScale", Space.SMEM, "f32", 128, slots=nt, bytes_per_slot=128 * 4),
        # the dynamic deal's task index ring (ir/tasks.py)
        *(task_ring(_task_readers(nt))[0] if dynamic_tasks(cfg) else ()),
        *tmem,
    )


def barriers(cfg: KernelConfig, kv: int | None = None, tiles: int | None = None) -> tuple[Barrier, ...]:
    kv = sm100_kv_stages(cfg) if kv is None else kv
    tile_bytes = plan_tile_bytes(cfg)  # CTA_GROUP (1) * rows * D * 2 bytes
    per_warp = cfg.gqa_ratio == 1
    nt = cfg.tiles_per_task if tiles is None else tiles  # one slot per Q tile in every per-tile barrier
    return (
        Barrier("q_full", BarrierKind.TMA, nt, 1, tx_bytes=tile_bytes),
        Barrier("q_empty", BarrierKind.TCGEN05, nt, 1),
        # K and V complete the same ring's phases: one tx count where their tiles are one size, none
        # (0) where they differ (dv != d), each load then announcing its own tile's bytes (the
        # verifier holds every TmaLoad to its tensor's tile and to the expect_tx before it)
        Barrier("kv_full", BarrierKind.TMA, kv, 1, tx_bytes=tile_bytes if v_tile_bytes(cfg) == tile_bytes else 0),
        Barrier("kv_empty", BarrierKind.TCGEN05, kv, 1),
        Barrier("s_ready", BarrierKind.TCGEN05, nt, 1),
        Barrier("p_o_rescale", BarrierKind.MBAR, nt, 256),
        Barrier("p_ready_2", BarrierKind.MBAR, nt, 128),
        Barrier("o_ready", BarrierKind.TCGEN05, nt, 1),
        # GQA_RATIO == 1: four 64-thread barriers per Q stage pair warp k of the softmax WG with
        # warp k of WG2 (slot = stage * 4 + warp); otherwise one 256-thread barrier per stage.
        Barrier("stats", BarrierKind.NAMED, 4 * nt if per_warp else nt, 64 if per_warp else 256,
                named_id=STATS_BAR_ID, per_warp=per_warp),
        Barrier("softmax_corr_empty", BarrierKind.MBAR, nt, 128),
        Barrier("corr_epi_full", BarrierKind.MBAR, nt, 128),
        Barrier("corr_epi_empty", BarrierKind.MBAR, nt, 32),
        *(task_ring(_task_readers(nt))[1] if dynamic_tasks(cfg) else ()),
    )


# The warps of each role (one table: the roles below and the task ring's reader count read it).
# WG0 / WG1: softmax of Q tile 0 / 1 (WG1 idle with one tile per task); WG2: correction and the
# epilogue; WG3: MMA, load, store, one idle warp.
ROLE_WARPS = {"softmax0": (0, 1, 2, 3), "softmax1": (4, 5, 6, 7), "idle_wg1": (4, 5, 6, 7),
              "correction": (8, 9, 10, 11), "mma": (12,), "load": (13,), "store": (14,), "idle": (15,)}
TASK_FETCHER = "load"  # the dynamic deal's fetching role (ir/tasks.py): the others with a task loop read


def _task_readers(tiles: int) -> int:
    """Threads that read the dynamic deal's task index: every thread of every role with a task loop
    (ROLE_WARPS) but the fetching one: the MMA and store warps, WG2 and a softmax WG per Q tile."""
    readers = ("mma", "store", "correction", *(f"softmax{i}" for i in range(tiles)))
    return 32 * sum(len(ROLE_WARPS[r]) for r in readers)


def smem_pipeline(cfg: KernelConfig, kv: int, o_staged: bool, tiles: int | None = None) -> Pipeline:
    """The kernel's regions and barriers with a kv-deep K/V ring and O staged or not (and `tiles` Q
    tiles per task, None: cfg.tiles_per_task), without roles: what its SMEM layout (ir/layout.py) is
    computed from."""
    return Pipeline(cfg, "sm_100a", 16, regions(cfg, kv, o_staged, tiles), barriers(cfg, kv, tiles), (), LIMITS.tmem_cols,
                    LIMITS.smem_per_cta)


def sm100_o_staged(cfg: KernelConfig) -> bool:
    """Whether the epilogue stages O in SMEM (a TMA store by the store warp; varlen: its row copies) or
    stores it from the registers (StoreO, each thread its row). sm_90a's rule (ir/layout.o_staged):
    staged where the smallest ring, two Q tiles and KV_STAGES_MIN K/V stages, fits beside the two
    staging slots: D = 64, 96, 128; not (192, 128), whose 2 stages with staging take 264,376 bytes
    (docs/HEAD_DIMS.md). The KV cache takes the same rule (num_splits > 1 stores from the registers
    whatever it says: StorePartial)."""
    return o_staged_rule(smem_pipeline(cfg, KV_STAGES_MIN, True))


def sm100_kv_stages(cfg: KernelConfig) -> int:
    """The K/V ring depth: the config's, except that the default is capped to the deepest ring (at
    least KV_STAGES_MIN) that fits beside the Q tiles and O's staging, as sm_90a caps it ((192, 128):
    3 stages of 48 KiB do not fit, 2 do). An explicit depth is kept: smem_layout refuses one that does
    not fit."""
    default = KernelConfig.__dataclass_fields__["kv_stages"].default
    if cfg.kv_stages != default:
        return cfg.kv_stages
    staged = sm100_o_staged(cfg)
    return next((kv for kv in range(cfg.kv_stages, KV_STAGES_MIN, -1) if fits(smem_pipeline(cfg, kv, staged))),
                KV_STAGES_MIN)


def _q_states(cfg: KernelConfig, phase: int) -> tuple[State, ...]:
    """The Q slot walks: tile i's (qa, qb) over slot i of the Q ring, one per tile."""
    if cfg.tiles_per_task == 1:
        return (State("qa", 1, phase),)
    return (State("qa", 2, phase, start=0, stride=2), State("qb", 2, phase, start=1, stride=2))


def _load_role(cfg: KernelConfig) -> Role:
    tb = plan_tile_bytes(cfg)
    kv = sm100_kv_stages(cfg)

    def load_kv(state: str, tensor: str, block: BlockRef):
        nbytes = tb if tensor == "k" else v_tile_bytes(cfg)
        return (Wait("kv_empty", state), ExpectTx("kv_full", state, nbytes),
                TmaLoad(tensor, "KV", state, "kv_full", state, nbytes, block=block), Advance(state))

    def load_q(state: str, qtile: int):
        return (Wait("q_empty", state), ExpectTx("q_full", state, tb),
                TmaLoad("q", "Q", state, "q_full", state, tb, qtile=qtile), Advance(state))

    # paged KV cache: a block's page-table entries are read once for its K and V loads, before the
    # waits (the reads overlap them)
    pages = (lambda ref: (PageLookup(ref),)) if cfg.page_size else (lambda ref: ())
    second_q = load_q("qb", 1) if cfg.tiles_per_task == 2 else ()
    body = (
        *pages(BlockRef.FIRST), *load_q("qa", 0), *load_kv("k", "k", BlockRef.FIRST),
        *second_q, *load_kv("v", "v", BlockRef.FIRST),
        Loop(LoopKind.KV_REST, (*pages(BlockRef.CUR), *load_kv("k", "k", BlockRef.CUR),
                                *load_kv("v", "v", BlockRef.CUR))),
    )
    states = (*_q_states(cfg, 1), State("k", kv, 1, start=0, stride=2), State("v", kv, 1, start=1, stride=2))
    return Role("load", ROLE_WARPS["load"], WG3_REGS, states, (Loop(LoopKind.TASKS, body),))


def _mma_role(cfg: KernelConfig) -> Role:
    ks = cfg.k_split

    def qk(i: int, block: BlockRef):
        return (Mma("qk", "Q", "qa" if i == 0 else "qb", "KV", "k", f"S{i}", 0, cfg.head_dim, "false", block),
                Commit("s_ready", i))

    def pv(i: int, block: BlockRef):
        # PV split along the 128 reduction positions: the first part needs P[:, :K_SPLIT] and a
        # rescaled (or fresh) O; the second needs the rest of P and always accumulates.
        return (Wait("p_o_rescale", f"por{i}"),
                Mma("pv", f"P{i}", 0, "KV", "v", f"O{i}", 0, ks, "not_first", block),
                Wait("p_ready_2", f"pr{i}"),
                Mma("pv", f"P{i}", 0, "KV", "v", f"O{i}", ks, 128, "true", block),
                Advance(f"por{i}"), Advance(f"pr{i}"))

    if cfg.tiles_per_task == 2:
        body = (
            Wait("q_full", "qa"), Wait("kv_full", "k"), *qk(0, BlockRef.FIRST),
            Wait("q_full", "qb"), *qk(1, BlockRef.FIRST),
            Commit("kv_empty", "k"), Advance("k"),
            Loop(LoopKind.KV_REST, (
                Wait("kv_full", "v"), *pv(0, BlockRef.PREV),
                Wait("kv_full", "k"), *qk(0, BlockRef.CUR),
                *pv(1, BlockRef.PREV), Commit("kv_empty", "v"), Advance("v"),
                *qk(1, BlockRef.CUR), Commit("kv_empty", "k"), Advance("k"),
            )),
            Wait("kv_full", "v"), *pv(0, BlockRef.LAST), Commit("o_ready", 0),
            *pv(1, BlockRef.LAST), Commit("o_ready", 1),
            Commit("kv_empty", "v"), Advance("v"),
            Commit("q_empty", "qa"), Advance("qa"), Commit("q_empty", "qb"), Advance("qb"),
        )
    else:
        # One Q tile: P V of block j - 1, then S = Q K^T of block j into the same columns (S0 holds
        # P0: the tensor core runs one thread's MMAs in issue order, so the product reads P before
        # the next S overwrites it); the softmax of block j waits for that S.
        body = (
            Wait("q_full", "qa"), Wait("kv_full", "k"), *qk(0, BlockRef.FIRST),
            Commit("kv_empty", "k"), Advance("k"),
            Loop(LoopKind.KV_REST, (
                Wait("kv_full", "v"), *pv(0, BlockRef.PREV), Commit("kv_empty", "v"), Advance("v"),
                Wait("kv_full", "k"), *qk(0, BlockRef.CUR), Commit("kv_empty", "k"), Advance("k"),
            )),
            Wait("kv_full", "v"), *pv(0, BlockRef.LAST), Commit("o_ready", 0),
            Commit("kv_empty", "v"), Advance("v"),
            Commit("q_empty", "qa"), Advance("qa"),
        )
    kv = sm100_kv_stages(cfg)
    tiles = range(cfg.tiles_per_task)
    states = (*_q_states(cfg, 0),
              State("k", kv, 0, start=0, stride=2), State("v", kv, 0, start=1, stride=2),
              *(State(f"por{i}", 1, 0, slot_base=i) for i in tiles), *(State(f"pr{i}", 1, 0, slot_base=i) for i in tiles))
    return Role("mma", ROLE_WARPS["mma"], WG3_REGS, states, (Loop(LoopKind.TASKS, body),))


def _epilogue_ops(cfg: KernelConfig, i: int, o_state: str, e_state: str, row_sum_src: str, regs: int) -> tuple:
    """Normalise O tile i, cast, stage it in O_smem and hand it to the store warp; or, where O is not
    staged (sm100_o_staged), store it from the registers (StoreO) and hand the (empty) turn over.

    A role whose register budget cannot hold the whole fp32 row (WG2: 64 registers, dv up to 128)
    loads, normalises and stages one 32-column chunk at a time; the softmax warpgroups (200) load
    the row at once. O from the registers goes one 32-column chunk at a time in every role."""
    loads = [TmemLd(f"O{i}", c, c + LD_CHUNK, "o") for c in range(0, cfg.head_dim_v, LD_CHUNK)]
    step = (Compute("normalize", i, reads=("o", row_sum_src), writes=("o_out",)), SmemSt("O_smem", e_state, "o_out"))
    if cfg.head_dim_v > regs - 32:  # keep 32 registers for addresses, loop state and row statistics
        body = [op for ld in loads for op in (ld, WaitLd(), *step)]
    else:
        body = [*loads, WaitLd(), *step]
    # The TMA store reads O_smem through the async proxy: fence the generic-proxy writes first. A
    # varlen kernel's store warp copies it with ld.shared (generic proxy, ordered by the barrier).
    fence = () if cfg.varlen else (FenceProxyAsync(),)
    staged = (*body, *fence)
    if not sm100_o_staged(cfg):
        staged = tuple(op for c in range(0, cfg.head_dim_v, LD_CHUNK)
                       for op in (TmemLd(f"O{i}", c, c + LD_CHUNK, "o"), WaitLd(), step[0],
                                  StoreO("o_out", c, c + LD_CHUNK, i)))
    if cfg.kvcache:
        # KV cache with num_splits > 1: the split's normalized O stays fp32 and goes from the
        # registers to o_partial (StorePartial); O_smem is not written, the store warp stores nothing.
        # The corr_epi hand-off is kept on both paths, so the store warp's protocol is one.
        def part(lo, hi):
            return (Compute("normalize_partial", i, reads=("o", row_sum_src), writes=("o",)),
                    StorePartial("o", lo, hi, i))
        # one chunk at a time in every role: the fp32 row is not packed to 16 bits, so a whole row
        # (D registers) beside the partial's addresses does not fit the softmax budget, nor 32
        # columns WG2's 64 registers (ptxas spilled): 16-column chunks there
        chunk = LD_CHUNK if regs > 2 * LD_CHUNK else RESCALE_CHUNK
        split = [op for c in range(0, cfg.head_dim_v, chunk)
                 for op in (TmemLd(f"O{i}", c, c + chunk, "o"), WaitLd(), *part(c, c + chunk))]
        staged = (If(Cond.SPLIT_KV, tuple(split), staged),)
    return (Wait("o_ready", o_state), Wait("corr_epi_empty", e_state), *staged,
            Arrive("corr_epi_full", e_state, Scope.ALL), Advance(e_state), Advance(o_state))


def _softmax_role(cfg: KernelConfig, i: int) -> Role:
    first = cfg.p_chunks_first
    body = (
        Wait("s_ready", "sr"),
        *(TmemLd(f"S{i}", c, c + LD_CHUNK, "s") for c in range(0, 128, LD_CHUNK)),
        WaitLd(),  # every S column is in registers before P (aliasing S's upper half) is written
        Compute("softmax_max", i, reads=("s", "row_max"), writes=("row_max", "acc_scale")),
        Compute("softmax_exp", i, reads=("s", "row_max"), writes=("p",)),
        *(TmemSt(f"P{i}", 32 * c, 32 * c + 32, "p") for c in range(first)),
        WaitSt(), Arrive("p_o_rescale", i, Scope.ALL),
        *(TmemSt(f"P{i}", 32 * c, 32 * c + 32, "p") for c in range(first, 4)),
        WaitSt(), Arrive("p_ready_2", i, Scope.ALL),
        Wait("softmax_corr_empty", "ce"), SmemSt("sScale", i, "acc_scale"), NamedArrive("stats", i),
        Compute("row_sum", i, reads=("p", "acc_scale", "row_sum"), writes=("row_sum",)),
        Advance("sr"), Advance("ce"),
    )
    # LSE needs the final reference and row_sum, both in this role's registers.
    lse = (If(Cond.HAS_LSE, (Compute("store_lse", i, reads=("row_sum", "row_max")),)),)
    if cfg.sinks:
        # the head's sink joins the row's denominator before O is normalised (here or, non-causal, in
        # WG2 from the row_sum handed over) and before the LSE; a split's partial leaves it out
        # (fa4_combine counts it once)
        lse = (Compute("apply_sink", i, reads=("row_sum", "row_max"), writes=("row_sum",)),) + lse
    if cfg.kvcache:  # split-KV: the split's LSE always goes to lse_partial (fa4_combine reads it)
        lse = (If(Cond.SPLIT_KV, (Compute("store_lse_partial", i, reads=("row_sum", "row_max")),), lse),)
    if cfg.causal:
        tail = lse + _epilogue_ops(cfg, i, "or", "e", "row_sum", SOFTMAX_REGS)
        states = (State("or", 1, 0, slot_base=i), State("e", 1, 1, slot_base=i))
    else:  # the last sScale hand-off carries row_sum to WG2, which runs the epilogue
        tail = lse + (Wait("softmax_corr_empty", "ce"), SmemSt("sScale", i, "row_sum"),
                      NamedArrive("stats", i), Advance("ce"))
        states = ()
    # WG2 hands the sScale slots back crosswise (softmax_corr_empty[1 - i] after stage i), so the two
    # softmax warpgroups alternate: stage 0 starts free (producer phase 1), stage 1 waits for WG2 to
    # finish stage 0 of the same block (consumer phase 0).
    states = (State("sr", 1, 0, slot_base=i), State("ce", 1, 1 - i, slot_base=i), *states)
    return Role(f"softmax{i}", ROLE_WARPS[f"softmax{i}"], SOFTMAX_REGS, states, (Loop(LoopKind.TASKS, (Loop(LoopKind.KV, body), *tail)),),
                qtile=i)


def _correction_role(cfg: KernelConfig) -> Role:
    def rescale(i: int):
        chunks = []
        for c in range(0, cfg.head_dim_v, RESCALE_CHUNK):
            chunks += [TmemLd(f"O{i}", c, c + RESCALE_CHUNK, "o"), WaitLd(),
                       Compute("rescale_o", i, reads=("o", "acc_scale"), writes=("o",)),
                       TmemSt(f"O{i}", c, c + RESCALE_CHUNK, "o")]
        return (*chunks, WaitSt())

    # the sScale slots go back crosswise: after tile i's, tile i + 1's softmax may write (one tile:
    # its own, for the next block)
    tiles = range(nt := cfg.tiles_per_task)
    per_block = []
    for i in tiles:
        per_block += [NamedSync("stats", i), SmemLd("sScale", i, "acc_scale"),
                      If(Cond.NOT_FIRST_BLOCK, (If(Cond.ANY_RESCALE, rescale(i)), Arrive("p_o_rescale", i, Scope.ALL))),
                      Arrive("softmax_corr_empty", (i + 1) % nt, Scope.ALL)]
    # Before a task's first PV MMA there is no old O: release every O slot at once.
    body = [*(Arrive("p_o_rescale", i, Scope.ALL) for i in tiles), Loop(LoopKind.KV, tuple(per_block))]
    states = [State(f"or{i}", 1, 0, slot_base=i) for i in tiles]
    if not cfg.causal:
        for i in tiles:
            body += [NamedSync("stats", i), SmemLd("sScale", i, "row_sum"),
                     Arrive("softmax_corr_empty", (i + 1) % nt, Scope.ALL),
                     *_epilogue_ops(cfg, i, f"or{i}", "e", "row_sum", CORRECTION_REGS)]
        states.append(State("e", nt, 1))
    else:
        # p_o_rescale counts arrivals, not who sends them, and the four correction warps are not
        # synchronised with each other: without this wait a fast warp's next-task early arrival
        # (above) could complete the previous task's last phase for a warp still rescaling O, and
        # the last PV MMA would read O mid-rescale (found by fa4gen emulate with several tasks per
        # CTA; the engine runs a role's warps as one process, so the verifier cannot see warp skew).
        # Waiting for the task's o_ready (its last PV MMA done) closes every p_o_rescale phase first.
        body += [*(Wait("o_ready", f"or{i}") for i in tiles), *(Advance(f"or{i}") for i in tiles)]
    return Role("correction", ROLE_WARPS["correction"], CORRECTION_REGS, tuple(states), (Loop(LoopKind.TASKS, tuple(body)),))


def _store_role(cfg: KernelConfig) -> Role:
    body = []
    staged = sm100_o_staged(cfg)
    for _ in range(cfg.tiles_per_task):
        if not staged:
            # O leaves from the epilogue's registers (StoreO): the warp only passes the turn back
            store = ()
        elif cfg.varlen:
            # Varlen: the tile's rows past the sequence's end belong to the next sequence (or lie
            # past total_q): the warp's threads copy only the sequence's rows (StoreRows).
            store = (StoreRows("O_smem", "e"),)
        elif cfg.kvcache:
            # KV cache: num_splits > 1 writes partials from the epilogue's registers; O_smem holds
            # nothing to store, so only num_splits == 1 stores the tile (as the dense kernel).
            store = (If(Cond.SPLIT_KV, (), (TmaStore("O_smem", "e"), TmaStoreWait())),)
        else:
            store = (TmaStore("O_smem", "e"), TmaStoreWait())
        body += [Wait("corr_epi_full", "e"), *store, Arrive("corr_epi_empty", "e", Scope.ALL), Advance("e")]
    return Role("store", ROLE_WARPS["store"], WG3_REGS, (State("e", cfg.tiles_per_task, 0),), (Loop(LoopKind.TASKS, tuple(body)),))


def build_sm100(cfg: KernelConfig) -> Pipeline:
    if cfg.arch != "sm_100a":
        raise ValueError(f"build_sm100 needs arch sm_100a, got {cfg.arch}")
    nt = cfg.tiles_per_task
    # one Q tile: WG1 has no tile, and gives its registers back (setmaxnreg.dec to the minimum)
    wg1 = (_softmax_role(cfg, 1),) if nt == 2 else (Role("idle_wg1", ROLE_WARPS["idle_wg1"], IDLE_WG_REGS, (), ()),)
    roles = (_softmax_role(cfg, 0), *wg1, _correction_role(cfg), _mma_role(cfg),
             _load_role(cfg), _store_role(cfg), Role("idle", ROLE_WARPS["idle"], WG3_REGS, (), ()))
    if dynamic_tasks(cfg):
        # the dynamic deal (ir/tasks.py): the load warp fetches each task index, every other role reads it
        roles = tuple(with_task_head(r, fetcher=r.name == TASK_FETCHER) for r in roles)
    notes = (("causal epilogue in WG0/WG1" if nt == 2 else "causal epilogue in WG0") if cfg.causal
             else "non-causal epilogue in WG2",)
    if nt == 1:
        notes += (f"one Q tile per task (S0 and O0 of {cfg.head_dim_v} columns fill TMEM where two tiles' would "
                  "not): WG1 idle",)
    if not sm100_o_staged(cfg):
        notes += (f"O from the registers (StoreO): {sm100_kv_stages(cfg)} K/V stages and O staging do not fit "
                  "together",)
    if cfg.varlen:
        notes += ("varlen: packed sequences (cu_seqlens); the store warp writes O rows of the task's sequence "
                  "with st.global (StoreRows), not a TMA store",)
    if cfg.kvcache:
        notes += ("kvcache: split-KV decode over a KV cache (cache_seqlens" + (f", pages of {cfg.page_size} keys"
                  if cfg.page_size else "") + "); num_splits > 1 writes fp32 partial O (StorePartial) and LSE, "
                  "merged by the fa4_combine entry",)
    return Pipeline(cfg, "sm_100a", 16, regions(cfg), barriers(cfg), roles, LIMITS.tmem_cols, LIMITS.smem_per_cta,
                    notes=notes)
