"""A corpus of broken PTX: edits of emitted kernel text, each a class of bug that the IR checks cannot
see because they live below the IR (template spelling, encodings, emitter bookkeeping). Every entry
must make `fa4gen emulate` fail; `expect` names the findings it may produce (a Fault kind, or
"mismatch" for a wrong O/LSE).

Each mutation applies to the PTX of one named default variant; `apply` raises MutationMiss when the
text it edits is not there (the corpus must not silently go stale when the templates change).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ...spec.config import KernelConfig


class MutationMiss(Exception):
    """The text a mutation edits is not in the PTX (the corpus needs updating)."""


@dataclass(frozen=True)
class PtxMutation:
    name: str
    config: dict  # KernelConfig keywords of the variant it edits
    what: str  # the bug class, in words
    expect: tuple  # acceptable findings: Fault kinds and/or "mismatch"
    edit: object  # fn(text, manifest) -> text
    protocol: bool = True  # `fa4gen check` must flag it too (False: data path, the emulator's alone)
    persistent: bool = False  # launch as a persistent grid of one CTA (several tasks per CTA)

    def kernel_config(self) -> KernelConfig:
        return KernelConfig(**self.config)

    def apply(self, text: str, manifest: dict) -> str:
        out = self.edit(text, manifest)
        if out == text:
            raise MutationMiss(f"{self.name}: the edit changed nothing")
        return out


def _sub(pattern, repl, *, count=1, nth=None, flags=re.M):
    """Replace the first `count` matches (or only the nth, 0-based)."""
    def edit(text, man):
        ms = list(re.finditer(pattern, text, flags))
        if not ms:
            raise MutationMiss(f"pattern {pattern!r} not found")
        sel = [ms[nth]] if nth is not None else (ms if count == 0 else ms[:count])
        out, last = [], 0
        for m in sel:
            out.append(text[last:m.start()])
            out.append(m.expand(repl) if isinstance(repl, str) else repl(m))
            last = m.end()
        out.append(text[last:])
        return "".join(out)
    return edit


def _bar_off(man, name, slot=0):
    bars = man["smem_layout"]["barriers"]
    if name not in bars:
        raise MutationMiss(f"the kernel has no barrier {name}")
    return bars[name] + 8 * slot


def _init_count(name, new):
    def edit(text, man):
        off = _bar_off(man, name)
        return _sub(rf"(mbarrier\.init\.shared::cta\.b64 \[%bar\+{off}\]), \d+;", rf"\1, {new};")(text, man)
    return edit


def _drop_line(pattern, nth=0):
    return _sub(rf"^[^\n]*{pattern}[^\n]*\n", "", nth=nth)


def _commit_to(name):
    def edit(text, man):
        off = _bar_off(man, name)
        return _drop_line(rf"tcgen05\.commit[^\n]*\[%(?:bar|qb)\+{off}\]", nth=0)(text, man)
    return edit


def _arrive_on(name, nth=0):
    def edit(text, man):
        off = _bar_off(man, name)
        return _drop_line(rf"mbarrier\.arrive\.shared::cta\.b64 _, \[%(?:bar|qb)\+{off}\]", nth=nth)(text, man)
    return edit


def _wait_on_other_barrier(src, dst):
    def edit(text, man):
        a, b = _bar_off(man, src), _bar_off(man, dst)
        return _sub(rf"(mbarrier\.try_wait\.parity\.shared::cta\.b64 %p_w, \[%qb\+){a}\]", rf"\g<1>{b}]", nth=0)(text, man)
    return edit


def _v_desc_lbo(text, man):
    # The V operand's descriptor (MN-major, LBO = the 64-column panel stride) is the constant OR-ed
    # into %db before the PV MMAs; halve its LBO field (bits 16-29, 16-byte units).
    def repl(m):
        v = int(m.group(2), 16)
        lbo = (v >> 16) & 0x3FFF
        v = (v & ~(0x3FFF << 16)) | ((lbo // 2) << 16)
        return f"{m.group(1)}{v:#x}"
    ms = [m for m in re.finditer(r"(or\.b64 %db, %db, )(0x[0-9a-fA-F]+)", text)
          if ((int(m.group(2), 16) >> 16) & 0x3FFF) > 1]
    if not ms:
        raise MutationMiss("no MN-major V descriptor constant")
    m = ms[0]
    return text[:m.start()] + repl(m) + text[m.end():]


def _idesc_bit(bit, which="qk"):
    def edit(text, man):
        def repl(m):
            v = int(m.group(2), 16) ^ (1 << bit)
            return f"{m.group(1)}{v:#x}"
        pat = r"(tcgen05\.mma\.cta_group::1\.kind::f16 \[%tmem\+\d+\], %dak, %dbk, )(0x[0-9a-fA-F]+)" if which == "qk" else \
              r"(tcgen05\.mma\.cta_group::1\.kind::f16 \[%tmem\+\d+\], \[%tmem\+\d+\], %dbk, )(0x[0-9a-fA-F]+)"
        return _sub(pat, repl, count=0)(text, man)
    return edit


def _idesc_m(new_m):
    def edit(text, man):
        def repl(m):
            v = int(m.group(2), 16)
            v = (v & ~(0x1F << 24)) | ((new_m >> 4) << 24)
            return f"{m.group(1)}{v:#x}"
        return _sub(r"(tcgen05\.mma\.cta_group::1\.kind::f16 \[%tmem\+\d+\], %dak, %dbk, )(0x[0-9a-fA-F]+)", repl,
                    count=0)(text, man)
    return edit


def _duplicate_line(pattern, nth=0):
    return _sub(rf"^([^\n]*{pattern}[^\n]*\n)", r"\1\1", nth=nth)


def _sm90_bar(text, name, slot=0):
    """sm_90a: the byte offset of barrier `name`'s slot from %bar, as the walker's mbarrier.init of it
    says (`mbarrier.init.shared::cta.b64 [%bar+OFF], N; // init NAME[SLOT]: ...`)."""
    m = re.search(rf"mbarrier\.init\.shared::cta\.b64 \[%bar\+(\d+)\], \d+; // init {name}\[{slot}\]", text)
    if not m:
        raise MutationMiss(f"no mbarrier.init of {name}[{slot}]")
    return int(m.group(1))


def _sm90_section(start, end):
    """Apply edit(section, manifest, whole_text) to the text between the first match of `start` and the
    next match of `end` (e.g. the consumer's steady-state KV loop, $L_consumer_kvN: .. $L_consumer_kv_doneN:)."""
    def wrap(edit):
        def inner(text, man):
            a = re.search(start, text, re.M)
            if not a:
                raise MutationMiss(f"no section start {start!r}")
            b = re.compile(end, re.M).search(text, a.end())
            if not b:
                raise MutationMiss(f"no section end {end!r}")
            return text[:a.end()] + edit(text[a.end():b.start()], man, text) + text[b.start():]
        return inner
    return wrap


def _sm90_swap_full_waits(text, man):
    """In the consumer's steady-state KV loop, the K wait (k_full[%st_consumer_k]) polls v_full and the
    V wait (v_full[%st_consumer_v]) polls k_full."""
    kf, vf = _sm90_bar(text, "k_full"), _sm90_bar(text, "v_full")

    def edit(sec, man, whole):
        kw = rf"(mbarrier\.try_wait\.parity\.shared::cta\.b64 %p_w, \[%qb\+){kf}(\], %ph_consumer_k;)"
        vw = rf"(mbarrier\.try_wait\.parity\.shared::cta\.b64 %p_w, \[%qb\+){vf}(\], %ph_consumer_v;)"
        if len(re.findall(kw, sec)) != 1 or len(re.findall(vw, sec)) != 1:
            raise MutationMiss("the steady-state loop's one k_full and one v_full wait")
        sec = re.sub(kw, rf"\g<1>{vf}\g<2>", sec)
        return re.sub(vw, rf"\g<1>{kf}\g<2>", sec)
    return _sm90_section(r"^\$L_consumer_kv\d+:", r"^\$L_consumer_kv_done\d+:")(edit)(text, man)


def _sm90_q_tx(old, new):
    """The producer's Q expect_tx (on q_full) announces `new` bytes where the TMA delivers `old`."""
    def edit(text, man):
        qf = _sm90_bar(text, "q_full")
        return _sub(rf"(mbarrier\.arrive\.expect_tx\.shared::cta\.b64 _, \[%qb\+{qf}\]), {old};", rf"\1, {new};")(text, man)
    return edit


def _sm90_init_count(name, new, slot=0):
    def edit(text, man):
        off = _sm90_bar(text, name, slot)
        return _sub(rf"(mbarrier\.init\.shared::cta\.b64 \[%bar\+{off}\]), \d+;", rf"\1, {new};")(text, man)
    return edit


_SM100 = dict(arch="sm_100a", head_dim=128, causal=False, gqa_ratio=1, dtype="bf16")
_SM100C = dict(arch="sm_100a", head_dim=128, causal=True, gqa_ratio=1, dtype="bf16")
_SM90 = dict(arch="sm_90a", head_dim=128, causal=False, gqa_ratio=1, dtype="bf16")
_SM90C = dict(arch="sm_90a", head_dim=128, causal=True, gqa_ratio=1, dtype="bf16")

PTX_MUTATIONS: tuple[PtxMutation, ...] = (
    # half the arrivals complete a phase: the rest overflow it, or (when a long TMA latency lets the
    # early half run ahead: machine.CTA.delay's tail) complete a phase nobody waits for and the
    # correction's next wait starves
    PtxMutation("init_count_p_o_rescale", _SM100, "mbarrier.init count of p_o_rescale halved (256 -> 128)",
                ("ARRIVAL_OVERFLOW", "RACE", "mismatch", "DEADLOCK"), _init_count("p_o_rescale", 128)),
    PtxMutation("init_count_s_ready", _SM100, "mbarrier.init count of s_ready doubled (1 -> 2)",
                ("DEADLOCK",), _init_count("s_ready", 2)),
    PtxMutation("tmem_lane_field", _SM100, "TMEM lane field of the softmax tcgen05 address shifted by 20, not 21",
                ("TMEM_LANE",), _sub(r"shl\.b32 %tmp0, %warp4, 21;", "shl.b32 %tmp0, %warp4, 20;")),
    PtxMutation("idesc_transpose_b", _SM100, "QK instruction descriptor: B (K) read MN-major (bit 16 flipped)",
                ("mismatch", "RACE"), _idesc_bit(16, "qk")),
    PtxMutation("idesc_transpose_a", _SM100, "QK instruction descriptor: A (Q) read MN-major (bit 15 flipped)",
                ("mismatch", "RACE"), _idesc_bit(15, "qk")),
    PtxMutation("idesc_m_field", _SM100, "QK instruction descriptor: M = 64 instead of 128",
                ("UNIT", "mismatch"), _idesc_m(64)),
    PtxMutation("v_desc_lbo", _SM100, "V SMEM descriptor: leading byte offset halved (panel stride)",
                ("mismatch", "RACE"), _v_desc_lbo, protocol=False),
    PtxMutation("qk_kstep_panel_jump", _SM100, "QK k-steps 4-7 do not jump to the second 64-column panel",
                ("mismatch",), _sub(r"add\.s64 (%dak|%dbk), (%da|%db), 10(2[468]|24);",
                                    lambda m: f"add.s64 {m.group(1)}, {m.group(2)}, {int(m.group(0).split(', ')[-1][:-1]) - 1024};",
                                    count=0), protocol=False),
    PtxMutation("expect_tx_bytes", _SM100, "K/V expect_tx announces half the bytes the TMA delivers",
                ("RACE", "TX_COUNT", "mismatch", "DEADLOCK"),
                _sub(r"(mbarrier\.arrive\.expect_tx\.shared::cta\.b64 _, \[%qb\+\d+\]), 32768;", r"\1, 16384;", nth=0)),
    PtxMutation("dropped_commit_s_ready", _SM100, "tcgen05.commit to s_ready dropped", ("DEADLOCK",),
                _commit_to("s_ready")),
    PtxMutation("dropped_wait_ld", _SM100, "softmax tcgen05.wait::ld dropped after loading S", ("REG_RACE",),
                _drop_line(r"tcgen05\.wait::ld\.sync\.aligned;", nth=2)),
    PtxMutation("dropped_wait_st", _SM100, "softmax tcgen05.wait::st dropped before the P hand-off",
                ("RACE", "mismatch"), _drop_line(r"tcgen05\.wait::st\.sync\.aligned;", nth=0)),
    PtxMutation("dropped_arrive_p_ready_2", _SM100, "softmax0 never arrives on p_ready_2", ("DEADLOCK",),
                _arrive_on("p_ready_2")),
    PtxMutation("wait_parity_flipped", _SM100, "the MMA warp's first Q wait uses the wrong parity",
                ("RACE", "mismatch"), _sub(r"selp\.u32 %qp, 1, 0, %p_q;", "selp.u32 %qp, 0, 1, %p_q;", nth=0)),
    PtxMutation("wait_on_wrong_barrier", _SM100, "the MMA warp waits q_full where kv_full is due",
                ("RACE", "mismatch", "DEADLOCK"), _wait_on_other_barrier("kv_full", "q_full")),
    PtxMutation("duplicated_scale", _SM100, "two output columns normalised twice (O / row_sum^2)",
                ("mismatch",), _duplicate_line(r"mul\.rn\.f32x2 %op2, %op2, %k_i2;", nth=0), protocol=False),
    PtxMutation("dropped_normalisation", _SM100, "O tile 0's first 32 columns never divided by row_sum",
                ("mismatch",), _sub(r"^\s*mul\.rn\.f32x2 %op(\d+), %op\1, %k_i2;\n", "", count=16), protocol=False),
    PtxMutation("duplicated_rescale", _SM100C, "the correction rescales two O columns twice per rescale",
                ("mismatch",), _duplicate_line(r"mul\.rn\.f32x2 %op1, %op1, %k_a2;", nth=0), protocol=False),
    PtxMutation("exp2_round_to_nearest", _SM100, "packed exp2 emulation splits with add.rn (not .rm): the fraction "
                "leaves [0, 1) and the cubic is extrapolated", ("mismatch",),
                _sub(r"add\.rm\.f32x2", "add.rn.f32x2", count=0), protocol=False),
    PtxMutation("exp2_pair_halves_swapped", _SM100, "one emulated pair unpacks its cubic with the halves swapped "
                "(columns 44 and 45 exchange P)", ("mismatch",),
                _sub(r"mov\.b64 \{%eb44, %eb45\}", "mov.b64 {%eb45, %eb44}", nth=0), protocol=False),
    PtxMutation("mask_word_off_by_one", _SM100C, "the causal mask's first column word is built one column short "
                "(the diagonal key masked)", ("mismatch",),
                _sub(r"sub\.s32 %mw0, %lim, 0;", "sub.s32 %mw0, %lim, 1;", count=0), protocol=False),
    PtxMutation("sm90_mask_off_by_one", _SM90C, "sm_90a: the causal mask compares col < lim with le->lt on the "
                "diagonal column of row 0's fragment (one visible key masked)", ("mismatch",),
                _sub(r"setp\.le\.s32 %pp6, %lim0, 0;", "setp.lt.s32 %pp6, %lim0, 0;", count=0), protocol=False),
    PtxMutation("sm90_swap_kv_full_barriers", _SM90, "steady state ($L_consumer_kv loop): the K wait polls "
                "v_full[%st_consumer_k] and the V wait k_full[%st_consumer_v] (the [%qb+OFF] offsets swapped)",
                ("RACE", "mismatch", "DEADLOCK", "ARRIVAL_OVERFLOW"), _sm90_swap_full_waits),
    PtxMutation("sm90_wait_group_shallow", _SM90, "the first block's S wait (op MmaWait after the QK wgmma) is "
                "wgmma.wait_group 1 where 0 is due (S read while the QK wgmma still writes it)",
                ("REG_RACE",), _sub(r"wgmma\.wait_group\.sync\.aligned 0;", "wgmma.wait_group.sync.aligned 1;", nth=0)),
    PtxMutation("sm90_dropped_wgmma_fence", _SM90, "the first wgmma.fence dropped", ("WGMMA_FENCE",),
                _drop_line(r"wgmma\.fence\.sync\.aligned;", nth=0), protocol=False),
    PtxMutation("sm90_named_count", _SM90, "ping-pong named barrier counts 128 threads instead of 256 (the "
                "first bar.sync %nb_sched_0: a consumer's turn wait)",
                ("NAMED_BARRIER", "DEADLOCK"), _sub(r"bar\.sync %nb_sched_0, 256;", "bar.sync %nb_sched_0, 128;", nth=0)),
    PtxMutation("sm90_expect_tx", _SM90, "Q expect_tx (q_full) announces half the bytes",
                ("RACE", "mismatch", "DEADLOCK"), _sm90_q_tx(32768, 16384)),
)


def _release_k_early(text, man):
    """Steady state ($L_consumer_kv loop): move the k_empty release (op Arrive after `wgmma.wait_group 1`,
    once S = Q K^T is done) to just after the ping-pong turn wait (bar.sync %nb_sched_0), before the QK
    wgmma that reads K is even issued."""
    ke = _sm90_bar(text, "k_empty")

    def edit(sec, man, whole):
        rel = re.compile(rf"\n(\s*mad\.lo\.u32 %qb, %st_consumer_k, 8, %bar;\n\s*"
                         rf"@%p_lead mbarrier\.arrive\.shared::cta\.b64 _, \[%qb\+{ke}\];[^\n]*)\n")
        m = rel.search(sec)
        sync = re.compile(r"\n\s*bar\.sync %nb_sched_0, 256;\n").search(sec)
        if not m or not sync or sync.start() > m.start():
            raise MutationMiss("the steady-state k_empty release after the ping-pong sync")
        body = m.group(1)
        sec = sec[:m.start()] + "\n" + sec[m.end():]
        return sec[:sync.end()] + body + "\n" + sec[sync.end():]
    return _sm90_section(r"^\$L_consumer_kv\d+:", r"^\$L_consumer_kv_done\d+:")(edit)(text, man)


def _drop_fence_after_wait(bar_name):
    """Drop the tcgen05.fence::after_thread_sync that follows the MMA warp's wait on `bar_name`."""
    def edit(text, man):
        off = _bar_off(man, bar_name)
        pat = (rf"(mbarrier\.try_wait\.parity\.shared::cta\.b64 %p_w, \[%(?:bar|qb)\+{off}\][^\n]*\n"
               rf"[^\n]*\n)\s*tcgen05\.fence::after_thread_sync;\n")
        return _sub(pat, r"\1", nth=0)(text, man)
    return edit


def _drop_fence_before_arrive(bar_name):
    """Drop the tcgen05.fence::before_thread_sync between a tcgen05.wait::st and the arrive on `bar_name`."""
    def edit(text, man):
        off = _bar_off(man, bar_name)
        pat = (rf"(tcgen05\.wait::st\.sync\.aligned;\n\s*// op \d+ Arrive\n)\s*tcgen05\.fence::before_thread_sync;\n"
               rf"(\s*mbarrier\.arrive\.shared::cta\.b64 _, \[%(?:bar|qb)\+{off}\];)")
        return _sub(pat, r"\1\2", nth=0)(text, man)
    return edit


PTX_MUTATIONS = PTX_MUTATIONS + (
    PtxMutation("dropped_fence_after_p_wait", _SM100, "the MMA warp reads P from TMEM without "
                "tcgen05.fence::after_thread_sync after its p_o_rescale wait", ("RACE",),
                _drop_fence_after_wait("p_o_rescale")),
    PtxMutation("dropped_fence_before_p_arrive", _SM100, "softmax hands P over (p_o_rescale) without "
                "tcgen05.fence::before_thread_sync after its wait::st", ("RACE",),
                _drop_fence_before_arrive("p_o_rescale")),
    PtxMutation("dropped_store_wait_read", _SM100, "the store warp frees O_smem (corr_epi_empty) without "
                "cp.async.bulk.wait_group.read: the TMA store may still be reading it", ("RACE",),
                _drop_line(r"cp\.async\.bulk\.wait_group\.read 0;", nth=0)),
    PtxMutation("sscale_overwritten_early", _SM100, "softmax0 rewrites its sScale slot without waiting "
                "softmax_corr_empty (the correction may not have read it yet)", ("RACE", "mismatch"),
                lambda t, m: _sub(rf"\$Lwait\d+:\n\s*mbarrier\.try_wait\.parity\.shared::cta\.b64 %p_w, "
                                  rf"\[%bar\+{_bar_off(m, 'softmax_corr_empty')}\], %q_softmax0_ce;[^\n]*\n\s*@!%p_w bra \$Lwait\d+;\n",
                                  "", nth=0)(t, m)),
    PtxMutation("dropped_setup_sync", _SM100, "no bar.sync between mbarrier.init / tcgen05.alloc and the roles",
                ("RACE", "MBARRIER"), _sub(r"(\$L_alloc_done:\n\s*tcgen05\.fence::before_thread_sync;\n)\s*bar\.sync 0;\n",
                                            r"\1", nth=0)),
    PtxMutation("softmax_budget_off", _SM100, "softmax warpgroups ask setmaxnreg.inc 192 where the plan gives 200",
                ("SETMAXNREG",), _sub(r"setmaxnreg\.inc\.sync\.aligned\.u32 200;", "setmaxnreg.inc.sync.aligned.u32 192;")),
    PtxMutation("scheduler_stride_one", _SM100, "every role steps its persistent task loop by 1, not by the grid "
                "size: CTAs compute the same tiles twice", ("WRITTEN_TWICE",),
                _sub(r"add\.u32 %task, %task, %nctas;", "add.u32 %task, %task, 1;", count=0), protocol=False),
    PtxMutation("causal_correction_no_task_wait", _SM100C, "the causal correction does not wait for the task's "
                "o_ready before its next-task early p_o_rescale arrivals (the bug the emulator found)",
                ("RACE", "mismatch"),
                _sub(r"\$Lwait\d+:\n\s*mbarrier\.try_wait\.parity\.shared::cta\.b64 %p_w, \[%bar\+\d+\], "
                     r"%q_correction_or(\d);[^\n]*\n\s*@!%p_w bra \$Lwait\d+;\n\s*tcgen05\.fence::after_thread_sync;\n", "",
                     count=2), persistent=True),
    PtxMutation("sm90_release_k_early", _SM90, "the consumers release K (k_empty) before their QK wgmma reads it",
                ("RACE", "mismatch"), _release_k_early),
)


def _task_mutations(prefix: str, cfg: dict) -> tuple:
    """The dynamic deal's hand-off broken three ways in the dynamically dealt kernel of `cfg` (varlen on
    either target, or sm_90a causal dense)."""
    return (
        PtxMutation(prefix + "task_read_before_full", cfg, "dynamic deal: the first reading role reads the task "
                    "index without waiting for task_full (its wait loop dropped)",
                    ("RACE", "mismatch", "WRITTEN_TWICE", "DEADLOCK"), lambda t, m: _sub(
                        rf"^\$Lwait\d+:\n[^\n]*mbarrier\.try_wait\.parity[^\n]*\[%qb\+{_bar_off(m, 'task_full')}\]"
                        r"[^\n]*\n[^\n]*bra[^\n]*\n", "", nth=0)(t, m)),
        PtxMutation(prefix + "task_index_not_read", cfg, "dynamic deal: the first reading role never loads the "
                    "published index (ld.shared of T dropped): it keeps the previous task's",
                    ("DEADLOCK", "STEP_LIMIT", "mismatch", "WRITTEN_TWICE", "RACE"),
                    _drop_line(r"^\s*ld\.shared\.u32 %task, ", nth=0), protocol=False),
        PtxMutation(prefix + "task_fetch_adds_two", cfg, "dynamic deal: the fetch adds 2 to the counter, so every "
                    "other task is never taken (its rows of O stay unwritten)", ("mismatch",),
                    _sub(r"atom\.global\.add\.u32 %task, \[%tctr\], 1;", "atom.global.add.u32 %task, [%tctr], 2;"),
                    protocol=False),
    )


# ---- varlen (packed sequences): offsets into the packed tensors, the row predicates of the threaded
# O copy, the per-sequence lengths. Each edit names the varlen instruction it changes exactly (the
# dense kernels have none of them); the default ragged shapes (harness.default_shapes) give sequences
# with offsets > 0, tiles that run past a sequence's end, and seqused_k.
_SM100V = dict(arch="sm_100a", head_dim=64, causal=False, gqa_ratio=1, dtype="bf16", varlen=True)
_SM100VC = dict(arch="sm_100a", head_dim=64, causal=True, gqa_ratio=4, dtype="bf16", varlen=True)
_SM90V = dict(arch="sm_90a", head_dim=64, causal=False, gqa_ratio=1, dtype="bf16", varlen=True)
_SM90VC = dict(arch="sm_90a", head_dim=64, causal=True, gqa_ratio=4, dtype="bf16", varlen=True)

PTX_MUTATIONS = PTX_MUTATIONS + (
    PtxMutation("varlen_o_row_predicate", _SM100V, "varlen store warp: the first O copy writes every tile row, "
                "also the rows past the sequence's end (the next sequence's, or past total_q)",
                ("GMEM_OOB", "WRITTEN_TWICE", "mismatch"),
                _sub(r"@%p_row st\.global\.v4\.b32 ", "st.global.v4.b32 ", nth=0)),
    PtxMutation("varlen_k_row_offset", _SM100V, "varlen load warp: the first K block's TMA row lacks the "
                "sequence's first key row (%koff)", ("mismatch",),
                _drop_line(r"^\s*add\.u32 %c2, %c2, %koff;", nth=0), protocol=False),
    PtxMutation("varlen_q_row_offset", _SM100VC, "varlen load warp: Q tile 1's TMA row lacks the sequence's "
                "first row (%qoff)", ("mismatch",),
                _drop_line(r"^\s*add\.u32 %c3, %c3, %qoff;", nth=1), protocol=False),
    PtxMutation("varlen_lse_row_offset", _SM100V, "varlen softmax0: the LSE column is the position in the "
                "sequence, not the packed row (0 instead of %qoff)", ("WRITTEN_TWICE", "mismatch"),
                _sub(r"add\.u32 %lrow, %seq, %qoff;", "add.u32 %lrow, %seq, 0;", nth=0), protocol=False),
    PtxMutation("varlen_second_tile_position", _SM100VC, "varlen store warp: the pair's second O tile is "
                "copied to the first tile's positions", ("WRITTEN_TWICE", "mismatch"),
                _sub(r"(mad\.lo\.u32 %vpos, %mpair, \d+, )(\d+);", r"\g<1>0;", nth=1), protocol=False),
    PtxMutation("varlen_o_copy_swizzle", _SM100V, "varlen store warp: the O copy reads the staging buffer "
                "without the 128B swizzle (chunk c of row R at c, not c ^ R % 8)", ("mismatch",),
                _drop_line(r"^\s*xor\.b32 %tmp1, %tmp1, %vsw;", nth=0), protocol=False),
    PtxMutation("varlen_seqused_k_ignored", _SM100VC, "varlen decode: seqused_k never caps the sequence's keys "
                "(in every role)", ("mismatch",),
                _sub(r"^\s*min\.u32 %skv, %skv, %tmp1;\n", "", count=0), protocol=False),
    PtxMutation("sm90_varlen_o_row_predicate", _SM90V, "sm_90a varlen: the threads' O copy writes every row of "
                "the WG's 64, also those past the sequence's end", ("GMEM_OOB", "WRITTEN_TWICE", "mismatch"),
                _sub(r"@%pp3 st\.global\.v4\.b32 ", "st.global.v4.b32 ", count=0)),
    PtxMutation("sm90_varlen_k_row_offset", _SM90V, "sm_90a varlen producer: the first K block's TMA row lacks "
                "the sequence's first key row (%koff)", ("mismatch",),
                _drop_line(r"^\s*add\.u32 %c2, %c2, %koff;", nth=0), protocol=False),
    PtxMutation("sm90_varlen_lse_row_offset", _SM90V, "sm_90a varlen: the LSE column of the first row is the "
                "position in the sequence (0 instead of %qoff)", ("WRITTEN_TWICE", "mismatch"),
                _sub(r"add\.u32 %tmp1, %seq0, %qoff;", "add.u32 %tmp1, %seq0, 0;", nth=0), protocol=False),
    PtxMutation("sm90_varlen_q_row_offset", _SM90VC, "sm_90a varlen producer: the Q tile's TMA row lacks the "
                "sequence's first row (%qoff)", ("mismatch",),
                _sub(r"mad\.lo\.u32 %c3, %mb, (\d+), %qoff;", r"mul.lo.u32 %c3, %mb, \1;", nth=0), protocol=False),
    # the dynamic deal (plan.dynamic_tasks, both targets): the task index's hand-off to the other roles
    *(m for prefix, cfg in (("sm90_", _SM90VC), ("sm100_", _SM100VC)) for m in _task_mutations(prefix, cfg)),
)
# ... and in the sm_90a causal dense kernels, which deal the same way since 2026-12-04 (their L2 sections)
PTX_MUTATIONS = PTX_MUTATIONS + _task_mutations("sm90_causal_", _SM90C)


# ---- KV cache (decode over a contiguous or paged cache, split-KV, the combine entry): each edit names
# the KV-cache instruction it changes (plan "KV-cache rules"); the default decode batches
# (ptxemu/kvcache.py default_kv_shapes: a shuffled page table with out-of-range entries, a sequence
# past the capacity and one of negative length, 3 uneven splits, and one run of a single split)
# make each of them visible. All are data-path bugs below the IR: `fa4gen check` does not see them.
_SM90K = dict(arch="sm_90a", head_dim=128, causal=True, gqa_ratio=4, dtype="bf16", kvcache=True, page_size=16)
_SM90K0 = dict(arch="sm_90a", head_dim=128, causal=False, gqa_ratio=4, dtype="bf16", kvcache=True, page_size=0)
_SM90K256 = dict(arch="sm_90a", head_dim=64, causal=True, gqa_ratio=4, dtype="bf16", kvcache=True, page_size=256)


def _combine_sub(pattern, repl, **kw):
    """_sub restricted to the fa4_combine entry (the text from its .entry line on)."""
    def edit(text, man):
        at = text.index(".visible .entry fa4_combine(")
        return text[:at] + _sub(pattern, repl, **kw)(text[at:], man)
    return edit


PTX_MUTATIONS = PTX_MUTATIONS + (
    PtxMutation("kv_page_index_clamp", _SM90K, "paged K/V: the page-table index key / page_size is not clamped "
                "to max_pages - 1 (the last block of a sequence at the capacity reads past its table row)",
                ("GMEM_OOB", "mismatch"), _sub(r"^\s*min\.u32 %c3, %c3, %tmp6;\n", "", count=0), protocol=False),
    PtxMutation("kv_page_clamp", _SM90K, "paged K/V: a page-table entry is not clamped to num_pages - 1 (an "
                "out-of-range entry reads TMA zero fill, not the last page)", ("mismatch",),
                _sub(r"min\.u32 %c3, (%pg\d+), %tmp6;", r"mov.u32 %c3, \1;", count=0), protocol=False),
    PtxMutation("kv_page_table_row", _SM90K, "paged K/V: the page-table row offset b * page_table_stride is "
                "dropped (every sequence reads sequence 0's pages)", ("mismatch", "GMEM_OOB"),
                _sub(r"mul\.lo\.u32 %c0, %b, %c0;", "mov.u32 %c0, 0;", count=0), protocol=False),
    PtxMutation("kv_page_row_in_page", _SM90K256, "pages of 256 keys: the block's first row inside its page "
                "(key % page_size) is not taken (the second block of a page reads past the page)",
                ("mismatch",), _sub(r"^\s*and\.b32 %c2, %c2, 255;\n", "", count=0), protocol=False),
    PtxMutation("kv_seqlen_clamp", _SM90K0, "cache_seqlens is not clamped to the capacity (seqlen_k): a "
                "sequence past it attends to TMA zero fill beyond the cache", ("mismatch",),
                _sub(r"^\s*min\.u32 %skv, %skv, %cap;\n", "", count=0), protocol=False),
    PtxMutation("kv_seqlen_negative", _SM90K0, "a negative cache_seqlens is not clamped to 0 (read unsigned, "
                "the capacity's keys)", ("mismatch",),
                _sub(r"^\s*max\.s32 %skv, %skv, 0;\n", "", count=0), protocol=False),
    PtxMutation("kv_split_lo", _SM90K, "split-KV: every split starts at block 0 (blocks counted by several "
                "splits)", ("mismatch",),
                _sub(r"mul\.lo\.u32 %nlo, %split, %tmp0;", "mov.u32 %nlo, 0;", count=0), protocol=False),
    PtxMutation("kv_split_floor", _SM90K, "split-KV: blocks per split rounded down (%n / S, not ceil): the "
                "tile's last blocks belong to no split", ("mismatch",),
                _sub(r"add\.u32 %tmp0, %n, %nsplit;\n\s*sub\.u32 %tmp0, %tmp0, 1;\n(\s*div\.u32 %tmp0, %tmp0, %nsplit;)",
                     r"mov.u32 %tmp0, %n;\n\1", count=0), protocol=False),
    PtxMutation("kv_partial_row", _SM90K, "split-KV epilogue: the partial row (LSE and O partials, the "
                "num_splits > 1 branch only) lacks the batch term b * Sq (sequences share partial rows)",
                ("WRITTEN_TWICE", "PARTIALS", "mismatch"),
                _sm90_section(r"^\s*setp\.le\.u32 %p_c, %nsplit, 1;$", r"^\s*bra\.uni \$L_consumer_endif\d+;$")(
                    lambda sec, man, whole: _sub(r"mad\.lo\.u32 %tmp1, %b, %sq, (%seq[01]);", r"mov.u32 %tmp1, \1;",
                                                 count=0)(sec, man)), protocol=False),
    PtxMutation("kv_lse_partial", _SM90K, "split-KV epilogue: the first row of each thread's pair (row lane/4) "
                "stores the other row's (lane/4 + 8) LSE partial", ("mismatch",),
                _sub(r"@%pp3 st\.global\.f32 \[%db\], %lsev0;", "@%pp3 st.global.f32 [%db], %lsev1;"),
                protocol=False),
    PtxMutation("kv_single_split_branch", _SM90K, "num_splits == 1 also takes the partial path (the direct "
                "path's guard `num_splits <= 1` becomes `<= 0`; through the null partial pointers, O and LSE "
                "never written)", ("PARTIALS", "GMEM_OOB", "mismatch"),
                _sub(r"setp\.le\.u32 %p_c, %nsplit, 1;", "setp.le.u32 %p_c, %nsplit, 0;"), protocol=False),
    PtxMutation("kv_direct_o_row_predicate", _SM90K, "num_splits == 1: the O store from the registers writes every "
                "row of the tile, also those past Sq (the next sequence's rows, or past the tensor)",
                ("WRITTEN_TWICE", "GMEM_OOB", "mismatch"),
                _sub(r"@%pp3 st\.global\.b32 \[%db\+", "st.global.b32 [%db+", count=0), protocol=False),
    PtxMutation("kv_idle_wg_first_row", _SM90K, "sm_90a: the idle test of a consumer warpgroup takes its first "
                "row as cw * 128, not cw * 64 (the second warpgroup idles although P * 3 of its rows are real)",
                ("mismatch",), _sub(r"shl\.b32 %tmp0, %cw, 6;\n(\s*shr\.u32 %tmp0, %tmp0, \d+;\n\s*mad\.lo\.u32 %tmp0, %mb, \d+, "
                                    r"%tmp0;\n\s*setp\.ge\.u32 %p_idle)", r"shl.b32 %tmp0, %cw, 7;\n\1"), protocol=False),
    PtxMutation("combine_weight", _SM90K, "fa4_combine: the split weights exp(lse_s - max) are not divided by "
                "their sum", ("mismatch",), _combine_sub(r"^\s*mul\.f32 %cw, %cw, %cinv;\n", ""), protocol=False),
    PtxMutation("combine_max", _SM90K, "fa4_combine: the row maximum skips the last butterfly step (lanes "
                "disagree on it: a warp whose lanes see different maxima diverges at the all -inf test, and its "
                "shfl.sync runs on half the warp)", ("mismatch", "SHFL"),
                _combine_sub(r"(shfl\.sync\.bfly\.b32 %cx, %cmax, 1, 31, -1;\n\s*shfl\.sync\.bfly\.b32 %cy, %csum, 1, 31, "
                             r"-1;\n)\s*max\.f32 %cz, %cmax, %cx;\n", "\\1    mov.f32 %cz, %cmax;\n"),
                protocol=False),
    PtxMutation("combine_split_step", _SM90K, "fa4_combine: the second pass's pointer is not moved to the next "
                "split's O row after the first (splits 0 and 1 both read split 0's partial)", ("mismatch",),
                _combine_sub(r"^\s*add\.s64 %cad, %cad, %cstep;\n", "", count=1), protocol=False),
    PtxMutation("combine_weight_lane", _SM90K, "fa4_combine: the second split of each unrolled round takes its "
                "weight from the round's first lane (shfl.sync.idx of %cj, not of the split's index)", ("mismatch",),
                _combine_sub(r"shfl\.sync\.idx\.b32 %cu1, %cw, %cs, 31, -1;", "shfl.sync.idx.b32 %cu1, %cw, %cj, 31, -1;"),
                protocol=False),
    PtxMutation("combine_first_chunk_lse", _SM90K, "fa4_combine: pass 2's first chunk does not take the LSE pass 1 "
                "loaded for its lane's split (its weights come from -inf: O = 0)", ("mismatch",),
                _combine_sub(r"^\s*@%cp2 mov\.f32 %cx, %cfirst;\n", ""), protocol=False),
    PtxMutation("combine_store_offset", _SM90K, "fa4_combine: O rows are stored D bytes apart instead of 2 D "
                "(rows overlap)", ("WRITTEN_TWICE", "mismatch"),
                _combine_sub(r"mul\.wide\.u32 %cix, %crow, 256;", "mul.wide.u32 %cix, %crow, 128;"), protocol=False),
    PtxMutation("combine_lse_null", _SM90K, "fa4_combine: the LSE is stored although lse_ptr is 0 (the caller "
                "asked for no LSE)", ("GMEM_OOB",),
                _combine_sub(r"setp\.ne\.u64 %cp3, %cad, 0;", "setp.eq.u64 %cp3, %cad, %cad;"), protocol=False),
    PtxMutation("combine_lse_index", _SM90K, "fa4_combine: the LSE index drops the head ((b * Hq + head) * Sq "
                "+ pos -> b * Hq * Sq + pos)", ("WRITTEN_TWICE", "mismatch"),
                _combine_sub(r"mad\.lo\.u32 %cb3, %cb3, %ch1, %ch3;", "mul.lo.u32 %cb3, %cb3, %ch1;"), protocol=False),
)


def by_name(name: str, read_back: bool = False) -> PtxMutation:
    """The PTX mutation called `name`: of the emulated corpus (PTX_MUTATIONS), and with read_back also
    of the corpus only `fa4gen check` is held to (CHECK_MUTATIONS, defined below)."""
    corpus = PTX_MUTATIONS + (CHECK_MUTATIONS if read_back else ())
    for m in corpus:
        if m.name == name:
            return m
    raise KeyError(f"no PTX mutation {name!r}; known: {', '.join(m.name for m in corpus)}")


# ---- 192-row Q tiles (sm_90a D = 64: three consumer warpgroups, tiles.SM90_Q_ROWS): the edits put back
# a two-consumer number where the three-consumer kernel needs its own (ring of turns, arrival
# counts, Q tile bytes, each consumer's O rows).
_SM90W = dict(arch="sm_90a", head_dim=64, causal=True, gqa_ratio=4, dtype="bf16", block_m=192)
_SM90WN = dict(arch="sm_90a", head_dim=64, causal=False, gqa_ratio=1, dtype="bf16", block_m=192)

PTX_MUTATIONS = PTX_MUTATIONS + (
    PtxMutation("sm90w_ring_wrap", _SM90W, "ping-pong ring wraps after 2 consumers, not 3: the consumer setup's "
                "%nb_sched_1 = named_id + (cw + 1) mod C takes the mod 2 (consumer 1 hands its turn to consumer 0 "
                "and consumer 2 to consumer 1; consumer 2's own id is never arrived on)", ("DEADLOCK", "NAMED_BARRIER"),
                _sub(r"(add\.u32 %tmp0, %cw, 1;\n\s*)setp\.ge\.u32 %pp0, %tmp0, 3;\n(\s*)@%pp0 sub\.u32 %tmp0, %tmp0, 3;"
                     r"(\n\s*add\.u32 %nb_sched_1, %tmp0, \d+;)",
                     r"\1setp.ge.u32 %pp0, %tmp0, 2;\n\2@%pp0 sub.u32 %tmp0, %tmp0, 2;\3")),
    PtxMutation("sm90w_q_tx", _SM90WN, "Q expect_tx (q_full) announces a 128-row tile (16 KiB) where the TMA "
                "delivers 192 rows", ("RACE", "mismatch", "DEADLOCK"), _sm90_q_tx(24576, 16384)),
    PtxMutation("sm90w_sum_chain_skip", _SM90WN, "the row sum's chain (plan.sm90_row_reduction: chains on the "
                "192-row tile) takes its 6th add's accumulator from two links back: one score of every block "
                "of row 0's share left out of the row sum (O divided by too small a sum)", ("mismatch",),
                _sub(r"add\.f32 %sm0_5, %sm0_4,", "add.f32 %sm0_5, %sm0_3,", count=0), protocol=False),
    PtxMutation("sm90w_o_rows", _SM90W, "the O store box of consumer cw starts at row 0 of the tile for every "
                "consumer (rows 64-191 never stored, rows 0-63 stored three times: the first, small launch sees "
                "the triple store as WRITTEN_TWICE before a wrong row)", ("mismatch", "WRITTEN_TWICE"),
                _sub(r"mul\.lo\.u32 %c3, %cw, 16;", "mul.lo.u32 %c3, %cw, 0;"), protocol=False),
)

# ---- varlen over the 192-row tile (sm_90a D = 64 / 96): 192 positions per m unit, not a power of two.
# The decode once counted a sequence's m units with a shift by log2 of the unit's rows (bit_length - 1:
# 7 for 192): later sequences' tasks decoded to wrong (sequence, m) pairs, the last one never stored.
_SM90VW = dict(arch="sm_90a", head_dim=64, causal=True, gqa_ratio=1, dtype="bf16", varlen=True, block_m=192)

PTX_MUTATIONS = PTX_MUTATIONS + (
    PtxMutation("varlen192_unit_shift", _SM90VW, "varlen task decode of a 192-row tile: each sequence's m units "
                "as (len + 191) >> 7 in every role, a division by 128 where the tile holds 192 positions (the "
                "shift a power-of-two rule takes for 192)", ("mismatch", "WRITTEN_TWICE", "GMEM_OOB"),
                _sub(r"div\.u32 %nmb, %nmb, 192;", "shr.u32 %nmb, %nmb, 7;", count=0), protocol=False),
)

# ---- sm_90a conditional rescale (O *= acc after the PV wait, outside the tensor-core turn) ----
PTX_MUTATIONS = PTX_MUTATIONS + (
    PtxMutation("sm90_rescale_skipped", _SM90C, "O is never rescaled when a row's reference max moves "
                "(the vote's branch taken unconditionally)", ("mismatch",),
                _sub(r"@!%p_rescale bra\.uni (\$L_consumer_else\d+);", r"bra.uni \1;", count=0), protocol=False),
    PtxMutation("sm90w_rescale_under_pv", _SM90W, "steady state: the wait before the rescale and the P repack "
                "(op MmaWait after the %p_rescale vote) lets the PV wgmma stay in flight (wait_group 1), so O and "
                "P registers are touched while it reads them", ("REG_RACE",),
                _sub(r"(vote\.sync\.any\.pred %p_rescale, [^\n]*\n\s*// op \d+ MmaWait\n\s*)"
                     r"wgmma\.wait_group\.sync\.aligned 0;(\n(?:[^\n]*\n){0,12}?\s*@!%p_rescale bra\.uni)",
                     r"\1wgmma.wait_group.sync.aligned 1;\2")),
    # plan.sm90_pack_first: tree kernels pack P(t) before the rescale, right after the PV wait
    PtxMutation("sm90_pack_under_pv", _SM90, "steady state, P packed before the rescale (plan.sm90_pack_first): "
                "the wait before the pack (op MmaWait after the %p_rescale vote) lets the PV wgmma stay in flight "
                "(wait_group 1), so P(t) overwrites the registers PV(t-1) is still reading", ("REG_RACE",),
                _sub(r"(vote\.sync\.any\.pred %p_rescale, [^\n]*\n\s*// op \d+ MmaWait\n\s*)"
                     r"wgmma\.wait_group\.sync\.aligned 0;(\n(?:[^\n]*\n){0,12}?\s*cvt\.rn\.(?:bf16|f16)x2\.f32)",
                     r"\1wgmma.wait_group.sync.aligned 1;\2")),
)


# ---- work in flight when the CTA exits: the store's last wait dropped, so the TMA store may still read
# the O staging SMEM after the CTA has retired and its SMEM went to the next CTA. The emulator lets the
# store land either way; a warp that exits with bulk stores it never waited for (and a CTA that exits
# with any asynchronous operation in flight) is its finding ASYNC_AT_EXIT.
def _drop_final_store_waits(text, man):
    """Drop the store role's last read wait and the final full wait before its exit (sm_100a)."""
    reads = list(re.finditer(r"^[^\n]*cp\.async\.bulk\.wait_group\.read 0;[^\n]*\n", text, re.M))
    final = list(re.finditer(r"^[^\n]*cp\.async\.bulk\.wait_group 0;[^\n]*\n", text, re.M))
    if not reads or not final:
        raise MutationMiss("the store role's bulk waits are not there")
    out = text
    for m in sorted([reads[-1], final[-1]], key=lambda m: m.start(), reverse=True):
        out = out[:m.start()] + out[m.end():]
    return out


PTX_MUTATIONS = PTX_MUTATIONS + (
    PtxMutation("dropped_final_store_waits", _SM100, "the store warp exits without waiting for its last TMA "
                "store to read O_smem (last wait_group.read and the final wait_group dropped)",
                ("ASYNC_AT_EXIT", "RACE"), _drop_final_store_waits),
    PtxMutation("sm90_dropped_final_store_wait", _SM90, "the consumers exit without waiting for their last "
                "TMA store of O (the final TmaStoreWait after the task loop, cp.async.bulk.wait_group.read 0, "
                "dropped)", ("ASYNC_AT_EXIT",),
                # `fa4gen check` reads the sm_90a roles to ret (the walker's TmaStoreWait op is missing)
                _sub(r"(\$L_consumer_tasks_done\d+:\n[\s\S]*?)^[^\n]*cp\.async\.bulk\.wait_group\.read 0;[^\n]*\n"
                     r"(\$L_consumer_end:)", r"\1\2")),
)


# ---- the API's default launch: no LSE (lse_ptr = 0). The kernels skip the LSE store when the pointer
# is null; with the guard compared against 1 instead of 0 they store through address 0 + offset. Only a
# launch without LSE can see it (harness.default_shapes' last launch, default_kv_shapes' fourth).
def _lse_guard_off(op):
    pattern = rf"setp\.{op}\.u64 (%p_c|%p_lse), %lse, 0;"
    return _sub(pattern, rf"setp.{op}.u64 \1, %lse, 1;", count=0)


_SM100K = dict(arch="sm_100a", head_dim=128, causal=True, gqa_ratio=4, dtype="bf16", kvcache=True, page_size=64)
PTX_MUTATIONS = PTX_MUTATIONS + (
    PtxMutation("lse_null_guard_off", _SM100C, "the LSE store's null-pointer guard tests lse_ptr == 1: a "
                "launch without LSE stores through address 0", ("GMEM_OOB",), _lse_guard_off("eq"), protocol=False),
    PtxMutation("sm90_lse_null_guard_off", _SM90C, "the LSE store's null-pointer guard (skip when lse_ptr == 0) "
                "tests lse_ptr == 1", ("GMEM_OOB",), _lse_guard_off("eq"), protocol=False),
    PtxMutation("varlen_lse_null_guard_off", _SM100V, "varlen: the LSE store's null-pointer guard tests "
                "lse_ptr == 1", ("GMEM_OOB",), _lse_guard_off("eq"), protocol=False),
    PtxMutation("sm90_varlen_lse_null_guard_off", _SM90V, "varlen: the LSE store's null-pointer guard tests "
                "lse_ptr == 1", ("GMEM_OOB",), _lse_guard_off("eq"), protocol=False),
    PtxMutation("kvcache_lse_null_guard_off", _SM100K, "KV cache, one split: fa4_fwd's direct LSE store "
                "guard tests lse_ptr == 1", ("GMEM_OOB",), _lse_guard_off("eq"), protocol=False),
    PtxMutation("sm90_kvcache_lse_null_guard_off", _SM90K, "KV cache, one split: fa4_fwd's direct LSE store "
                "guard tests lse_ptr == 1", ("GMEM_OOB",), _lse_guard_off("eq"), protocol=False),
)


# ---- sm_90a score modifiers: a sliding window's left side (the unmasked block range) and the sinks'
# units (plan.SINKS_ABI_PARAMS: natural log, the kernel works in log2)
_SM90CWS = dict(arch="sm_90a", head_dim=128, causal=True, gqa_ratio=1, dtype="bf16", window=True, sinks=True)
PTX_MUTATIONS = PTX_MUTATIONS + (
    PtxMutation("sm90_window_unmasked_lo", _SM90CWS, "a window's masked-block test forgets the left side (block >= "
                "n_unmasked only, not `or block < unmasked_lo`): a block partly left of some row's window runs "
                "unmasked", ("mismatch",),
                _sub(r"^\s*setp\.lt\.or\.s32 %p_mask, %nb, %unlo, %p_mask;\n", "", count=0), protocol=False),
    PtxMutation("sm90_sink_units", _SM90CWS, "row 0's sink is not converted to log2 units (z used where z log2 e "
                "is due)", ("mismatch",),
                _sub(r"^\s*mul\.f32 %snk0, %snk0, 0f3FB8AA3B;\n", "", count=0), protocol=False),
)


# ---- score modifiers (sliding windows, sinks) on sm_100a: the window's left limit as mask words and as
# the block test (plan.BlockInfo.needs_mask: b < unmasked_lo), the sink in O's divisor. The default
# window shapes (harness.default_shapes) put keys left of the window into masked blocks of the first
# launch (window (0, 0)) and a block below unmasked_lo but below n_unmasked into the second (window
# (100, 30)); seed 0's sink dominates. The first launch reveals window_begin_word_dropped and
# sink_dropped_from_divisor, the second window_unmasked_lo_ignored.
_SM100WS = dict(arch="sm_100a", head_dim=64, causal=True, gqa_ratio=1, dtype="bf16", window=True, sinks=True)
PTX_MUTATIONS = PTX_MUTATIONS + (
    PtxMutation("window_begin_word_dropped", _SM100WS, "softmax0's window mask keeps the key_end word only for "
                "columns 0-31 (the key_begin word's AND dropped): keys left of the window count on masked blocks",
                ("mismatch",), _sub(r"^\s*and\.b32 %mw0, %mw0, %mbw;\n", "", nth=0), protocol=False),
    PtxMutation("window_unmasked_lo_ignored", _SM100WS, "the softmax roles mask only blocks >= %nunm (the "
                "b < %unmlo test dropped): a block the window's left edge cuts runs unmasked",
                ("mismatch",), _sub(r"^\s*setp\.lt\.or\.s32 %p_mask, %nb, %unmlo, %p_mask;\n", "", count=0),
                protocol=False),
    PtxMutation("sink_dropped_from_divisor", _SM100WS, "softmax0 stores the sink's LSE but normalises O without "
                "it (row_sum += 2^(z log2 e - m) dropped)", ("mismatch",),
                _sub(r"^\s*add\.f32 %sum, %sum, %snke;\n", "", nth=0), protocol=False),
)


# ---- classes the mutation sweep found (scripts/mutation_sweep.py, fa4gen/evidence/sweep.py): edits that
# passed both `fa4gen check` and `fa4gen emulate` until the evidence grew to see them
def _sm90_loop_wait_not_retried(text, man):
    """The consumer's steady-state K wait (k_full[%st_consumer_k] in $L_consumer_kv) without the
    `@!%p_w bra` back to its try_wait: one poll, then on whether or not K has landed."""
    kf = _sm90_bar(text, "k_full")

    def edit(sec, man, whole):
        pat = (rf"(mbarrier\.try_wait\.parity\.shared::cta\.b64 %p_w, \[%qb\+{kf}\], %ph_consumer_k;[^\n]*\n)"
               rf"\s*@!%p_w bra \$Lwait\d+;\n")
        if len(re.findall(pat, sec)) != 1:
            raise MutationMiss("the steady-state loop's one k_full wait")
        return re.sub(pat, r"\1", sec)
    return _sm90_section(r"^\$L_consumer_kv\d+:", r"^\$L_consumer_kv_done\d+:")(edit)(text, man)


def _sm90_slot_stride(text, man):
    """The producer's steady-state k_empty wait addresses its slot as %st_producer_k * 16 + %bar: slot 1
    polls the barrier two slots on (an mbarrier is 8 bytes)."""
    ke = _sm90_bar(text, "k_empty")
    return _sub(rf"mad\.lo\.u32 %qb, %st_producer_k, 8, %bar;(\n\$Lwait\d+:\n\s*mbarrier\.try_wait\.parity"
                rf"\.shared::cta\.b64 %p_w, \[%qb\+{ke}\])", r"mad.lo.u32 %qb, %st_producer_k, 16, %bar;\1", nth=1)(text, man)


def _sm90_mask_column(reg, col, nth):
    """One column of the causal mask off by one: `setp.le %limH, c` (column c hidden when the row sees
    at most c keys of the block) as `setp.lt`, the nth such compare (0: the first block's, 1: the loop's)."""
    return _sub(rf"setp\.le\.s32 (%pp\d+), %{reg}, {col};", rf"setp.lt.s32 \1, %{reg}, {col};", nth=nth)


SWEEP_MUTATIONS: tuple[PtxMutation, ...] = (
    PtxMutation("sm90_wait_not_retried", _SM90C, "the steady-state K wait is one try_wait without its retry "
                "branch: the consumer reads K whether or not it has landed (the emulator's try_wait now times "
                "out, and TMA loads have a long tail, so the consumer gets there first)", ("RACE",),
                _sm90_loop_wait_not_retried),
    PtxMutation("sm90_barrier_slot_stride", _SM90C, "the producer's steady-state k_empty wait steps 16 bytes per "
                "ring slot: slot 1 polls another barrier and K is refilled while a consumer may read it",
                ("RACE", "mismatch", "DEADLOCK", "UNWAITED_LOAD"), _sm90_slot_stride),
    PtxMutation("sm90_kv_loop_one_more", _SM90C, "the producer's K/V loop entry tests t > n where t >= n: a tile "
                "of one K/V block loads a second one (block -1) that no consumer waits for",
                ("UNWAITED_LOAD",), _sub(r"setp\.ge\.u32 %p_t, %t, %n;", "setp.gt.u32 %p_t, %t, %n;", nth=0),
                protocol=False),
    PtxMutation("sm90_mask_off_by_one_first", _SM90C, "the first block's causal mask shows column 120 to the row "
                "that sees exactly 120 keys of it (setp.le -> setp.lt): one future key", ("mismatch",),
                _sm90_mask_column("lim0", 120, 0), protocol=False),
    PtxMutation("sm90_mask_off_by_one_loop", _SM90C, "the K/V loop's causal mask shows column 57 to the row "
                "(of the second eight of its sixteen) that sees exactly 57 keys of the block", ("mismatch",),
                _sm90_mask_column("lim1", 57, 1), protocol=False),
    PtxMutation("sm90_decode_tile_sum_term", _SM90C, "the first block's unmasked path (a tile whose rows see every "
                "key of it: Sq = 1) adds one partial row sum twice and drops another",
                ("mismatch",), _sub(r"add\.f32 %sm0_20, %sm0_8, %sm0_9;", "add.f32 %sm0_20, %sm0_9, %sm0_9;", nth=0),
                protocol=False),
    PtxMutation("sm90_row_max_half_quad", _SM90C, "the K/V loop's row maximum skips its second butterfly step: "
                "each row's maximum over half its columns (huge rows overflow)", ("mismatch",),
                _sm90_section(r"^\$L_consumer_kv\d+:", r"^\$L_consumer_kv_done\d+:")(
                    lambda sec, man, whole: _sub(r"^\s*shfl\.sync\.bfly\.b32 %bmax0_s, %bmax0, 2, 0x1f, 0xffffffff;\n"
                                                 r"\s*max\.f32 %bmax0, %bmax0, %bmax0_s;\n", "", nth=0)(sec, man)),
                protocol=False),
    PtxMutation("sm90_shfl_membermask", _SM90C, "the row maximum's first butterfly names lanes 0-15 in its "
                "membermask while the whole warp executes it (undefined behaviour; the emulator ignored the "
                "mask)", ("SHFL",),
                _sub(r"(shfl\.sync\.bfly\.b32 %bmax0_s, %bmax0, 1, 0x1f,) 0xffffffff;", r"\1 0x0000ffff;", nth=0),
                protocol=False),
    PtxMutation("sm90_lse_row_guard", _SM90C, "the LSE store's row guard tests row <= Sq where row < Sq: the row "
                "after the last is written (into the next head's LSE, or past the end)",
                ("GMEM_OOB", "mismatch"),
                _sub(r"setp\.lt\.and\.u32 (%pp\d+), %seq1, %sq, %p_lse;", r"setp.le.and.u32 \1, %seq1, %sq, %p_lse;", nth=0),
                protocol=False),
)
PTX_MUTATIONS = PTX_MUTATIONS + SWEEP_MUTATIONS


# ---- read back only: protocol edits that `fa4gen check` must flag (tests/test_ptxemu.py), kept out of
# the emulated corpus above (each emulation is minutes of CI). They are the classes the sm_90a reader
# sees through the instance index and the predicates: a named-barrier id wrong for one consumer only, a
# branch on %cw that picks the wrong instance, an arrive whose predicate lets too many threads arrive,
# an mbarrier.init count the arrivals do not reach.
CHECK_MUTATIONS: tuple[PtxMutation, ...] = (
    # the emulator runs fa4_fwd to its end before fa4_combine (a launch's two kernels in order), so the
    # missing wait is a race only the device shows; the read-back checks the wait's place
    PtxMutation("combine_no_grid_wait", _SM90K, "fa4_combine, launched programmatically, reads the partials "
                "without griddepcontrol.wait (it may start before fa4_fwd has written them)", ("RACE",),
                _combine_sub(r"^\s*griddepcontrol\.wait;\n", "")),
    PtxMutation("sm90_named_id_consumer1", _SM90, "consumer 1 alone hands the tensor core to itself: after the "
                "setup's %nb_sched_1 = 1 + (cw + 1) mod 2, `@(cw == 1) mov %nb_sched_1, 2` (its bar.arrive on "
                "sched[1], where consumer 0's turn sched[0] is due)", ("DEADLOCK",),
                _sub(r"(\n(\s*)add\.u32 %nb_sched_1, %tmp0, 1;\n)",
                     r"\1\2setp.eq.u32 %pp0, %cw, 1;\n\2@%pp0 mov.u32 %nb_sched_1, 2;\n")),
    PtxMutation("sm90_last_handoff_wrong_instance", _SM90, "after the task loop consumer 1, not consumer 0, "
                "takes the last ping-pong hand-off (the FIRST_INSTANCE branch tests %cw against 1)",
                ("DEADLOCK",),
                _sub(r"(\$L_consumer_tasks_done\d+:\n\s*)setp\.ne\.u32 %p_c, %cw, 0;", r"\1setp.ne.u32 %p_c, %cw, 1;")),
    PtxMutation("sm90_arrive_predicate_dropped", _SM90, "the steady-state k_empty release is arrived by every "
                "thread of the consumer (its @%p_lead dropped): 128 arrivals per consumer where 4 are due",
                ("ARRIVAL_OVERFLOW", "RACE"),
                lambda t, m: _sub(rf"@%p_lead (mbarrier\.arrive\.shared::cta\.b64 _, \[%qb\+{_sm90_bar(t, 'k_empty')}\];)",
                                  r"\1", nth=1)(t, m)),
    PtxMutation("sm90_init_count_q_empty", _SM90, "mbarrier.init of q_empty[1] counts 4 arrivals (one "
                "consumer's warps) where the two consumers make 8", ("RACE", "mismatch"),
                _sm90_init_count("q_empty", 4, slot=1)),
    PtxMutation("sm90_epilogue_dropped_handoff", _SM90, "consumer 0's last ping-pong hand-off after the task "
                "loop (op NamedSync sched[0] before its final store wait) dropped", ("DEADLOCK",),
                _sub(r"(\$L_consumer_tasks_done\d+:\n\s*setp\.ne\.u32 %p_c, %cw, 0;\n\s*@%p_c bra\.uni \$L\w+;\n)"
                     r"\s*// op \d+ NamedSync\n\s*bar\.sync 1, 256;\n", r"\1")),
    # An init count below the arrivals per phase: the emulator sees the race only in interleavings where
    # a stage is refilled while the late consumer still reads it (seeds 1 and 5 of 0-5 on its default
    # shape, not seed 0); the reader's arrivals-per-phase count flags it on every run.
    # sm_100a keeps a ring's slot apart from its state (q in [0, 2 depth)); the sweep found its slot
    # reduction unread: q reaches depth at a given site only after depth + 1 advances there, which the
    # default shapes' few blocks per tile do not give every site, so the emulator never met it
    PtxMutation("sm100_ring_slot_off_by_one", _SM100C, "the MMA warp's K operand slot is reduced when q > 3 "
                "(setp.gt for setp.ge): at q = 3 it addresses a fourth slot, past the three-slot ring",
                ("RACE", "mismatch", "SMEM"),
                _sub(r"setp\.ge\.u32 (%p_q), %q_mma_k, 3;(\n\s*mov\.u32 %qs, %q_mma_k;\n\s*@%p_q sub\.u32 %qs, "
                     r"%q_mma_k, 3;\n\s*mad\.lo\.u32 %rdb)", r"setp.gt.u32 \1, %q_mma_k, 3;\2", nth=0)),
    PtxMutation("sm100_ring_slot_reduced_backwards", _SM100C, "the load warp's Q slot subtracts the depth when "
                "q < 2 (the reduction's guard negated): slot q - 2 wraps below the ring", ("RACE", "SMEM"),
                _sub(r"@%p_q (sub\.u32 %qs, %q_load_qa, 2;)", r"@!%p_q \1", nth=0)),
    PtxMutation("sm90w_empty_arrivals", _SM90WN, "k_empty[0] counts 8 arrivals (two consumers' warps), not 12: "
                "a K stage is refilled while the third consumer still reads it", ("RACE", "mismatch", "DEADLOCK"),
                _sm90_init_count("k_empty", 8)),
)
