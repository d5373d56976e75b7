"""bench/gpu_clocks.py: the clock / power sampler the benches open windows on (CPU: a fake nvidia-smi)."""
import stat
import sys
import textwrap
import time

from bench import gpu_clocks

# answers one-shot field probes (all but one field) and, with --loop-ms, prints a sample every 5 ms:
# the clock it prints is 1500 MHz, or what the file CLOCK beside it says when it exists
FAKE = textwrap.dedent("""\
    #!{py}
    import datetime, os, sys, time
    args = sys.argv[1:]
    query = next(a for a in args if a.startswith("--query-gpu="))[len("--query-gpu="):].split(",")
    if "power.draw.instant" in query and len(query) == 1:
        print("Field \\"power.draw.instant\\" is not a valid field to query."); sys.exit(2)
    here = os.path.dirname(os.path.abspath(__file__))
    def line():
        clock = open(os.path.join(here, "CLOCK")).read().strip() if os.path.exists(os.path.join(here, "CLOCK")) else "1500"
        vals = {{"timestamp": datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3], "clocks.sm": clock,
                "clocks.max.sm": "1980", "power.draw": "699.50", "enforced.power.limit": "700.00",
                "temperature.gpu": "61", "clocks_event_reasons.active": "0x0000000000000004"}}
        return ", ".join(vals.get(f, "[N/A]") for f in query)
    if not any(a.startswith("--loop-ms") for a in args):
        print(line()); sys.exit(0)
    while True:
        print(line(), flush=True); time.sleep(0.005)
""")


def _fake(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE.format(py=sys.executable))
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    return smi


def test_decode_reasons_names_the_bits():
    assert gpu_clocks.decode_reasons("0x0000000000000004") == ["sw_power_cap"]
    assert gpu_clocks.decode_reasons("0x24") == ["sw_power_cap", "sw_thermal_slowdown"]
    assert gpu_clocks.decode_reasons("0x1000") == ["0x1000"]
    assert gpu_clocks.decode_reasons("[N/A]") == []


def test_parse_line_takes_instant_power_else_the_average():
    f = ("timestamp", "clocks.sm", "power.draw.instant", "power.draw", "clocks_event_reasons.active")
    s = gpu_clocks.parse_line(f, "2026/12/04 18:30:01.250, 1755, [N/A], 650.25, 0x4")
    assert s["sm_mhz"] == 1755 and s["power_w"] == 650.25 and s["reasons"] == ["sw_power_cap"]
    assert gpu_clocks.parse_line(f, "2026/12/04 18:30:01.250, 1755, 640.0, 650.25, 0x0")["power_w"] == 640.0
    assert gpu_clocks.parse_line(f, "garbage") is None
    assert gpu_clocks.parse_line(f, "not a time, 1, 2, 3, 0x0") is None


def test_sampler_attributes_samples_to_windows(tmp_path):
    smi = _fake(tmp_path)
    with gpu_clocks.GpuSampler(interval_ms=5, smi=str(smi)) as s:
        assert s.why is None, s.why
        assert "power.draw.instant" not in s.fields and "clocks.sm" in s.fields  # the unsupported field is dropped
        time.sleep(0.3)  # the child's start-up
        with s.window("a"):
            time.sleep(0.3)
        (tmp_path / "CLOCK").write_text("1200")
        time.sleep(0.1)
        with s.window("b"):
            time.sleep(0.3)
    got = s.summary()
    assert got["a"]["samples"] >= 5 and got["b"]["samples"] >= 5, got
    assert got["a"]["sm_mhz"] == 1500 and got["b"]["sm_mhz"] == 1200
    assert got["a"]["power_w"] == 699.5 and got["a"]["power_limit_w"] == 700 and got["a"]["max_sm_mhz"] == 1980
    assert got["a"]["reasons"] == ["sw_power_cap"]


def test_sampler_without_nvidia_smi_says_why(tmp_path):
    s = gpu_clocks.GpuSampler(smi=str(tmp_path / "absent-smi"))
    assert s.start() is False and "not found" in s.why
    with s.window("x"):
        pass
    s.stop()
    assert s.summary() == {"x": {"samples": 0}}


def test_power_probe_tensor_share_and_help(capsys):
    import pytest

    from bench import power_probe

    assert power_probe.pipe_share(989.4, 1830, 132) == pytest.approx(1.0, abs=1e-3)
    assert power_probe.pipe_share(700, 1500, 132) == pytest.approx(700e12 / (1500e6 * 132 * 4096))
    assert power_probe.pipe_share(700, None, 132) is None
    assert power_probe.parse_shape("2,8192,16,16,128") == (2, 8192, 16, 16, 128, False)
    assert power_probe.parse_shape("1,16384,32,8,64,1") == (1, 16384, 32, 8, 64, True)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        power_probe.parse_shape("1,64,6,4,64")
    with pytest.raises(ValueError, match="B,S,Hq,Hkv,D"):
        power_probe.parse_shape("2,8k,16,16,128")
    with pytest.raises(SystemExit):  # a bad --shape is a usage error before any GPU work
        power_probe.main(["--shape", "2,8192"])
    with pytest.raises(SystemExit):
        power_probe.main(["--help"])
    assert "tensor peak per clock" in capsys.readouterr().out.replace("\n", " ")


def test_power_probe_without_a_gpu_says_so(monkeypatch, capsys):
    """On a machine without CUDA (CI) the probe measures nothing and says why, exit 2, no traceback."""
    import pytest

    torch = pytest.importorskip("torch")
    from bench import power_probe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert power_probe.main(["--seconds", "1"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
