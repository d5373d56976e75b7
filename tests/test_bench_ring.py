"""bench/ring.py's CPU side: the derived numbers and the refusal without GPUs."""

import pytest

from bench import ring


def test_metrics_of_a_row():
    s, h, d = 131072, 32, 128
    flop = 4.0 * h * s * s * d / 2
    m = ring.metrics(s, 2, h, d, ring_ms=100.0, compute_ms=95.0, comm_ms=20.0, single_ms=190.0)
    assert m["tflops_per_gpu"] == round(flop / 2 / 0.1 / 1e12, 1)
    assert m["single_tflops"] == round(flop / 0.19 / 1e12, 1)
    assert m["speedup_vs_single"] == 1.9 and m["scaling_efficiency"] == 0.95
    assert m["exposed_comm_ms"] == 5.0 and m["hidden_comm_fraction"] == 0.75
    assert m["comm_GBps_per_link"] == round(2 * (s // 2) * h * d * 2 / 0.02 / 1e9, 1)
    # ring faster than compute alone (noise): fully hidden, never above 1; one GPU: nothing to hide
    assert ring.metrics(s, 2, h, d, 90.0, 95.0, 20.0)["hidden_comm_fraction"] == 1.0
    one = ring.metrics(s, 1, h, d, 100.0, single_ms=100.0)
    assert one["hidden_comm_fraction"] is None and one["speedup_vs_single"] == 1.0
    assert ring.metrics(s, 2, h, d, 100.0)["speedup_vs_single"] is None


def test_no_gpu_is_refused(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert ring.main(["--seqlens", "1024"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
