"""What the GPU's clocks and power did while each contender was timed: a background `nvidia-smi`
sampling the SM clock, the power draw and the active clock-event (throttle) reasons, and windows
(contender name, start, end) that the benches open around each timing. A summary per name gives the
median SM clock and power over the samples inside that name's windows, so a TFLOP/s figure can be
read against the clock it ran at (TFLOP/s / (SM MHz x SMs x dense FLOP per clock per SM) is the
tensor pipe's share of the time, whatever the clock).

    with GpuSampler() as s:            # nothing happens (s.why says why) without nvidia-smi
        with s.window("fa4gen"):
            ...time it...
    s.summary()  # {"fa4gen": {"samples": 37, "sm_mhz": 1530, "power_w": 698.2, "reasons": ["sw_power_cap"]}}

The clock-event reason bits are NVML's (nvmlClocksEventReason*): a set bit means that reason held
the clocks down at that sample.
"""
from __future__ import annotations

import datetime as _dt
import shutil
import statistics
import subprocess
import threading
import time
from contextlib import contextmanager

# the fields asked for, in order; a driver that lacks one (older names) loses only that field
FIELDS = ("timestamp", "clocks.sm", "clocks.max.sm", "power.draw.instant", "power.draw", "enforced.power.limit",
          "temperature.gpu", "utilization.gpu", "clocks_event_reasons.active")
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
           0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}
_TS_FORMAT = "%Y/%m/%d %H:%M:%S.%f"


def decode_reasons(text: str) -> list[str]:
    """The names of the bits set in nvidia-smi's clocks_event_reasons.active ("0x...4"); unknown bits
    by their value."""
    try:
        mask = int(text.strip(), 16)
    except ValueError:
        return []
    names = [name for bit, name in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    return names + ([hex(rest)] if rest else [])


def _number(text: str) -> float | None:
    try:
        return float(text.strip().split()[0])
    except (ValueError, IndexError):
        return None  # "[N/A]", "[Not Supported]"


def parse_line(fields: tuple[str, ...], line: str) -> dict | None:
    """One CSV line (noheader, nounits) of the fields -> a sample, None if it is not one."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(fields):
        return None
    got = dict(zip(fields, parts))
    try:
        ts = _dt.datetime.strptime(got["timestamp"], _TS_FORMAT).timestamp()
    except (KeyError, ValueError):
        return None
    power = _number(got.get("power.draw.instant", "")) or _number(got.get("power.draw", ""))
    return {"t": ts, "sm_mhz": _number(got.get("clocks.sm", "")), "max_sm_mhz": _number(got.get("clocks.max.sm", "")),
            "power_w": power, "power_limit_w": _number(got.get("enforced.power.limit", "")),
            "temp_c": _number(got.get("temperature.gpu", "")), "util_pct": _number(got.get("utilization.gpu", "")),
            "reasons": decode_reasons(got.get("clocks_event_reasons.active", ""))}


class GpuSampler:
    """Samples one GPU every `interval_ms` with nvidia-smi (a child process, so no GPU work and no
    Python thread on the timed path); `window(name)` marks the wall-clock spans to attribute."""

    def __init__(self, interval_ms: int = 20, gpu: str = "0", smi: str = "nvidia-smi"):
        self.interval_ms, self.gpu, self.smi = interval_ms, gpu, smi
        self.samples: list[dict] = []
        self.windows: list[tuple[str, float, float]] = []
        self.fields: tuple[str, ...] = ()
        self.why: str | None = None
        self._proc = None
        self._reader = None

    def _supported_fields(self) -> tuple[str, ...]:
        keep = []
        for f in FIELDS:
            r = subprocess.run([self.smi, f"--query-gpu={f}", "--format=csv,noheader,nounits", "-i", self.gpu],
                               capture_output=True, text=True, timeout=30)
            if r.returncode == 0 and r.stdout.strip():
                keep.append(f)
        return tuple(keep)

    def start(self) -> bool:
        if shutil.which(self.smi) is None:
            self.why = f"{self.smi} not found: no clock samples"
            return False
        try:
            self.fields = self._supported_fields()
        except (OSError, subprocess.SubprocessError) as e:
            self.why = f"{self.smi} failed: {type(e).__name__}: {e}"
            return False
        if "timestamp" not in self.fields or "clocks.sm" not in self.fields:
            self.why = f"{self.smi} answers neither timestamp nor clocks.sm for GPU {self.gpu}"
            return False
        cmd = [self.smi, f"--query-gpu={','.join(self.fields)}", "--format=csv,noheader,nounits", "-i", self.gpu,
               f"--loop-ms={self.interval_ms}"]
        if shutil.which("stdbuf"):  # line-buffered through the pipe: stop() loses no sample to a full buffer
            cmd = ["stdbuf", "-oL", *cmd]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return True

    def _read(self):
        for line in self._proc.stdout:
            s = parse_line(self.fields, line)
            if s is not None:
                self.samples.append(s)

    def stop(self):
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._reader.join(timeout=10)
            self._proc = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    @contextmanager
    def window(self, name: str):
        t0 = time.time()
        try:
            yield
        finally:
            self.windows.append((name, t0, time.time()))

    def summary(self) -> dict:
        """name -> samples inside its windows, median SM clock (MHz), median power (W), the reasons seen
        in at least half of those samples, and the power limit and max SM clock reported."""
        out = {}
        for name in dict.fromkeys(w[0] for w in self.windows):
            spans = [(a, b) for n, a, b in self.windows if n == name]
            inside = [s for s in self.samples if any(a <= s["t"] <= b for a, b in spans)]
            if not inside:
                out[name] = {"samples": 0}
                continue
            med = {}
            for key in ("sm_mhz", "power_w", "temp_c", "util_pct", "power_limit_w", "max_sm_mhz"):
                vals = [s[key] for s in inside if s[key] is not None]
                med[key] = round(statistics.median(vals), 1) if vals else None
            counts: dict[str, int] = {}
            for s in inside:
                for r in s["reasons"]:
                    counts[r] = counts.get(r, 0) + 1
            out[name] = {"samples": len(inside), **med,
                         "reasons": sorted(r for r, c in counts.items() if 2 * c >= len(inside))}
        return out
