"""Host-side rules of the KV-cache path, without torch or a GPU: validate.check_kvcache_problem /
check_kvcache_values on TensorMeta, schedule.choose_num_splits and the split / page / length rules."""

import pytest

from fa4gen.spec import schedule
from fa4gen.runtime.validate import (DeviceError, InputErrors, InputTypeError, InputValueError, TensorMeta,
                                     check_kvcache_problem, check_kvcache_values)


def meta(name, shape, dtype="bfloat16", device="cuda:0", ptr=1 << 20, elem=2, strides=None):
    if strides is None:
        strides, acc = [], 1
        for s in reversed(shape):
            strides.insert(0, acc)
            acc *= max(s, 1)
    return TensorMeta(name, tuple(shape), tuple(strides), dtype, device, ptr, elem)


def args(b=2, sq=1, hq=32, hkv=8, d=128, paged=16, num_pages=40, max_pages=10, seq_dev="cuda:0"):
    q = meta("q", (b, sq, hq, d))
    if paged:
        k = meta("k", (num_pages, paged, hkv, d))
        pt = meta("page_table", (b, max_pages), "int32", seq_dev, elem=4)
    else:
        k = meta("k", (b, 1000, hkv, d))
        pt = None
    v = meta("v", k.shape)
    sl = meta("cache_seqlens", (b,), "int32", seq_dev, elem=4)
    return q, k, v, sl, pt


def test_valid_paged_and_contiguous():
    p = check_kvcache_problem(*args())
    assert (p.batch, p.page_size, p.capacity, p.gqa_ratio, p.num_splits) == (2, 16, 160, 4, 0)
    assert p.out_shape == (2, 1, 32, 128) and p.lse_shape == (2, 32, 1) and not p.host_index
    p = check_kvcache_problem(*args(paged=0), num_splits=3)
    assert (p.page_size, p.capacity, p.num_splits) == (0, 1000, 3)


def test_every_problem_in_one_error():
    q, k, v, sl, pt = args()
    bad_sl = meta("cache_seqlens", (3,), "int64", "cuda:0", elem=8)
    with pytest.raises(InputErrors) as e:
        check_kvcache_problem(q, k, v, bad_sl, pt, num_splits=-1)
    text = str(e.value)
    assert "int32" in text and "num_splits" in text


@pytest.mark.parametrize("page", [8, 48, 512])
def test_page_sizes_outside_the_kernels_are_refused(page):
    with pytest.raises(InputValueError, match=f"page size {page}"):
        check_kvcache_problem(*args(paged=page))


def test_contiguous_cache_needs_one_row_per_sequence():
    q, k, v, sl, _ = args(paged=0)
    k3 = meta("k", (3, 1000, 8, 128))
    with pytest.raises(InputValueError, match="one row per sequence"):
        check_kvcache_problem(q, k3, meta("v", k3.shape), sl, None)


def test_index_tensors_on_another_gpu_are_refused_cpu_ones_accepted():
    with pytest.raises(InputErrors, match="cache_seqlens must be on cuda:0.*page_table must be on cuda:0"):
        check_kvcache_problem(*args(seq_dev="cuda:1"))
    q, k, v, sl, _ = args(paged=0, seq_dev="cuda:1")
    with pytest.raises(DeviceError, match="cache_seqlens"):
        check_kvcache_problem(q, k, v, sl, None)
    assert check_kvcache_problem(*args(seq_dev="cpu")).host_index


def test_page_table_needs_a_contiguous_last_dim():
    q, k, v, sl, _ = args()
    pt = meta("page_table", (2, 10), "int32", strides=(10, 2), elem=4)
    with pytest.raises(InputValueError, match="page_table's last dim"):
        check_kvcache_problem(q, k, v, sl, pt)


def test_bool_and_float_num_splits_are_refused():
    for bad in (True, 2.0):
        with pytest.raises(InputTypeError, match="num_splits"):
            check_kvcache_problem(*args(), num_splits=bad)


def test_host_values_checked():
    p = check_kvcache_problem(*args(seq_dev="cpu"))
    check_kvcache_values([160, 0], [[0] * 10, [39] * 10], p)  # in range
    with pytest.raises(InputValueError, match=r"cache_seqlens\[0\] = 161"):
        check_kvcache_values([161, 0], [[0] * 10, [0] * 10], p)
    with pytest.raises(InputValueError, match=r"page_table\[1, 2\] = 40"):
        check_kvcache_values([1, 40], [[0] * 10, [1, 2, 40] + [0] * 7], p)
    check_kvcache_values([1, 32], [[0] * 10, [1, 2, -1] + [0] * 7], p)  # entries past the length are not read


def test_choose_num_splits():
    assert schedule.choose_num_splits(512, 256, 132) == 1  # the tiles already fill the SMs
    assert schedule.choose_num_splits(8, 1, 132) == 1  # one block: nothing to split
    s = schedule.choose_num_splits(8, 1024, 132)
    assert 8 * s <= 132 and s == 16  # one wave of 128 tasks (measured best on the H200)
    assert schedule.choose_num_splits(64, 256, 132) == 2
    for base, blocks in ((1, 4), (3, 7), (8, 33), (100, 2000)):
        s = schedule.choose_num_splits(base, blocks, 132)
        assert 1 <= s <= max(1, blocks // schedule.KV_MIN_SPLIT_BLOCKS)


def test_split_ranges_cover_every_block_once():
    for nblk in (0, 1, 5, 64, 1000):
        for S in (1, 2, 3, 7, 33):
            got = []
            for s in range(S):
                lo, hi = schedule.kvcache_split(nblk, s, S)
                assert 0 <= lo <= hi <= nblk
                got += range(lo, hi)
            assert got == list(range(nblk))


def test_lengths_and_pages_clamped_like_the_kernels():
    assert schedule.kvcache_k_len(-5, 100) == 0
    assert schedule.kvcache_k_len(0xFFFFFFFF, 100) == 0  # -1 as the device's int32
    assert schedule.kvcache_k_len(10 ** 6, 100) == 100
    row = [3, 9, -1, 10 ** 9]
    assert schedule.kvcache_page(row, 17, 16, 4, 10) == (9, 1)
    assert schedule.kvcache_page(row, 40, 16, 4, 10) == (9, 8)  # -1 -> unsigned huge -> the last page
    assert schedule.kvcache_page(row, 16 * 9, 16, 4, 10) == (9, 0)  # index past max_pages -> the last entry
    assert schedule.kvcache_task(7, 3, 2, 4) == (1, 0, 0, 1)


def test_api_metas_collect_every_bad_argument():
    """launch.varlen_metas / _kvcache_metas (torch-free with a fake meta): an absent optional tensor is
    None, every argument that is not a tensor is reported in one error."""
    from fa4gen.runtime import launch

    def fake(t, name):
        if not isinstance(t, tuple):
            raise InputTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        return meta(name, t)

    q, kc = (2, 1, 8, 64), (2, 100, 2, 64)
    got = launch.kvcache_metas(q, kc, kc, (2,), None, meta=fake)
    assert [m.name if m else None for m in got] == ["q", "k", "v", "cache_seqlens", None]
    with pytest.raises(InputErrors, match="k must be a torch.Tensor.*cache_seqlens must be a torch.Tensor"):
        launch.kvcache_metas(q, [1], kc, 3, None, meta=fake)
    got = launch.varlen_metas((10, 8, 64), (10, 2, 64), (10, 2, 64), (3,), (3,), None, meta=fake)
    assert got[-1] is None and got[0].name == "q"
    with pytest.raises(InputTypeError, match="seqused_k must be a torch.Tensor"):
        launch.varlen_metas((10, 8, 64), (10, 2, 64), (10, 2, 64), (3,), (3,), "x", meta=fake)
