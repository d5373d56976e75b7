"""bench/attention.py's CPU-side logic: the shape table, the FA4-CuTe peer loader (on fake site
folders) and the markdown table. Needs neither torch nor a GPU."""

import sys

import pytest

from bench import attention as bench


@pytest.fixture
def clean_import_state(monkeypatch):
    """The loader edits sys.path and imports flash_attn.*: undo both after each test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("flash_attn", "fake_dsl_marker"):
            del sys.modules[name]


def _fake_site(root, *, body="def flash_attn_func(q, k, v, causal=False):\n    return q, None\n"):
    site = root / "site"
    (site / "flash_attn" / "cute").mkdir(parents=True)  # namespace package flash_attn, as the wheel ships it
    (site / "flash_attn" / "cute" / "__init__.py").write_text("")
    (site / "flash_attn" / "cute" / "interface.py").write_text(body)
    for name, version in (("flash_attn_4", "4.0.0b36"), ("nvidia_cutlass_dsl", "4.8.1")):
        d = site / f"{name}-{version}.dist-info"
        d.mkdir()
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
    # the DSL's .pth puts a folder on sys.path; the fake one proves addsitedir ran it
    (site / "dsl_packages").mkdir()
    (site / "dsl_packages" / "fake_dsl_marker.py").write_text("")
    (site / "fake.pth").write_text(f"import sys; sys.path.insert(0, {str(site / 'dsl_packages')!r})\n")
    return site


def test_shapes_include_the_tracker_rows_and_per_row_dtype():
    assert (1, 32768, 16, 16, 128, True) in bench.SHAPES
    assert (2, 8192, 16, 16, 128, False, "fp16") in bench.SHAPES
    assert (4, 4096, 32, 32, 64, False) in bench.SHAPES and (4, 4096, 32, 32, 64, True) in bench.SHAPES
    # the first ten rows (BASELINES.md's) keep their --only indices
    assert bench.SHAPES[0] == (16, 1024, 16, 16, 128, False) and bench.SHAPES[9] == (4, 4096, 32, 32, 64, True)
    for shape in bench.SHAPES:
        assert len(shape) in (6, 7)
        assert bench.shape_dtype(shape, "bf16") in ("bf16", "fp16")
    assert bench.shape_dtype((1, 2, 3, 3, 64, False), "fp16") == "fp16"
    assert bench.shape_dtype((1, 2, 3, 3, 64, False, "fp16"), "bf16") == "fp16"


def test_fa4cute_missing_site_says_why(tmp_path, monkeypatch, clean_import_state):
    monkeypatch.delenv("FA4_PEER_SITE", raising=False)
    fn, info = bench.load_fa4cute(str(tmp_path / "nowhere"))
    assert fn is None and info["status"].startswith("not installed: no ")
    assert "fa4_peer.sh" in info["status"] and "\n" not in info["status"]
    assert info["flash-attn-4"] is None and info["nvidia-cutlass-dsl"] is None


def test_fa4cute_loads_from_env_site(tmp_path, monkeypatch, clean_import_state):
    site = _fake_site(tmp_path)
    monkeypatch.setenv("FA4_PEER_SITE", str(site))
    fn, info = bench.load_fa4cute()
    assert info["status"] == "ok", info
    assert fn is not None and fn("q", "k", "v", causal=True) == ("q", None)
    assert info["site"] == str(site) and info["flash-attn-4"] == "4.0.0b36" and info["nvidia-cutlass-dsl"] == "4.8.1"
    assert info["module"].startswith(str(site)) and info["import_s"] >= 0
    assert str(site / "dsl_packages") in sys.path  # the .pth file ran


def test_fa4cute_broken_import_is_one_line(tmp_path, clean_import_state):
    site = _fake_site(tmp_path, body="raise ImportError('libcuda.so.1: cannot open\\nsecond line')\n")
    fn, info = bench.load_fa4cute(str(site))
    assert fn is None
    assert info["status"] == "import failed: ImportError: libcuda.so.1: cannot open"


def test_fa4cute_import_that_exits_does_not_end_the_run(tmp_path, clean_import_state):
    site = _fake_site(tmp_path, body="raise SystemExit('no GPU')\n")
    fn, info = bench.load_fa4cute(str(site))
    assert fn is None and info["status"] == "import failed: SystemExit: no GPU"


def _row(**tf):
    row = dict(B=2, Sq=8192, Skv=8192, Hq=16, Hkv=16, D=128, dtype="fp16", causal=False)
    for name in bench.IMPLS:
        row[f"{name}_tflops"] = tf.get(name)
    return row


def test_best_peer_and_markdown():
    row = _row(fa4gen=480, fa4gen_kernel=500, cudnn=450, flash=300, fa4cute=520)
    row["fa4gen_max_abs_diff_vs_cudnn"] = 0.0039
    row["fa4cute_max_abs_diff_vs_cudnn"] = 0.002
    assert bench.best_peer(row) == ("fa4cute", 520)
    no_peer = _row(fa4gen=480, fa4gen_kernel=500)
    assert bench.best_peer(no_peer) == (None, None)
    no_fa4 = _row(fa4gen=480, fa4gen_kernel=500, cudnn=450, flash=300)
    assert bench.best_peer(no_fa4) == ("cudnn", 450)
    table = bench.markdown([row, no_peer, no_fa4]).splitlines()
    assert "FA4-CuTe" in table[0] and "fa4gen/best peer" in table[0]
    assert table[0].count("|") == table[1].count("|") == table[2].count("|")
    assert "| 520 | 1.11 | 0.96 (fa4cute) | — | 0.0039 / 0.002 |" in table[2]
    assert "| — | — | — | — | — / — |" in table[3]
    with_prev = _row(fa4gen=480, fa4gen_kernel=500, previous=520, cudnn=450)
    assert "| 500 | — | 520 | 450 |" in bench.markdown([with_prev]) and "| 0.96 |" in bench.markdown([with_prev])
    # a 192-row default names its tile and shows the 128-row kernel beside it
    wide = {**_row(fa4gen=480, fa4gen_kernel=500, fa4gen_m128=450, cudnn=455), "fa4gen_block_m": 192}
    assert "| no | 192 | 480 | 500 | 450 | — | 455 |" in bench.markdown([wide])
    assert "| — | 1.11 | 1.11 (cudnn) |" in table[4]
    assert "| fp16 | no |" in table[2]


def test_fa4cute_call_takes_a_tuple_or_a_tensor(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    q = torch.randn(1, 8, 2, 64)
    calls = []

    def returns_tuple(q, k, v, causal=False):
        calls.append(causal)
        return q * 2, torch.zeros(1, 2, 8)

    fn, out, first_s = bench._fa4cute(returns_tuple, q, q, q, True)
    assert torch.equal(out, q * 2) and torch.equal(fn(), q * 2) and first_s >= 0
    assert calls == [True, True, True]  # the compile call, one more untimed call, then fn()
    fn, out, _ = bench._fa4cute(lambda q, k, v, causal=False: q + 1, q, q, q, False)
    assert torch.equal(out, q + 1)


def test_main_dry_run_on_cpu(tmp_path, monkeypatch, clean_import_state, capsys):
    """The whole main() on CPU tensors with the GPU parts stubbed: fa4gen cannot launch on CPU (its
    columns say why), SDPA runs where its CPU backends exist, the fake peer (returning (out, lse))
    runs, the JSON and the table come out, and --budget-s skips what is left."""
    torch = pytest.importorskip("torch")
    import json

    site = _fake_site(tmp_path, body="def flash_attn_func(q, k, v, causal=False):\n    return q * 1, None\n")
    monkeypatch.setenv("FA4_PEER_SITE", str(site))
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "SHAPES", ((1, 64, 2, 2, 64, False), (1, 64, 4, 2, 64, True, "fp16"),
                                          (1, 32, 2, 2, 64, False)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "environment", lambda argv: {"gpu": "Fake GPU", "command": " ".join(argv)})
    monkeypatch.setattr(bench, "_median_ms", lambda fn, warmup_ms, rep_ms: (fn(), 1.0)[1])
    now = [0.0]  # a fake clock: each shape takes 60 s, so --budget-s 100 runs two of the three
    monkeypatch.setattr("time.perf_counter", lambda: now[0])
    real_run_shape = bench.run_shape

    def run_shape(*a, **kw):
        now[0] += 60.0
        return real_run_shape(*a, **kw)

    monkeypatch.setattr(bench, "run_shape", run_shape)
    assert bench.main(["--out-dir", str(tmp_path / "results"), "--budget-s", "100"]) == 0
    out = capsys.readouterr().out
    files = list((tmp_path / "results").glob("*_Fake-GPU.json"))
    assert len(files) == 1
    result = json.loads(files[0].read_text())
    assert result["fa4cute"]["status"] == "ok" and result["fa4cute"]["flash-attn-4"] == "4.0.0b36"
    rows = result["results"]
    assert len(rows) == 2 and result["complete"] is False and result["skipped"] == [[1, 32, 2, 2, 64, False]]
    assert [r["dtype"] for r in rows] == ["bf16", "fp16"]
    for r in rows:
        assert r["fa4cute_tflops"] is not None and r["fa4gen_tflops"] is None
        assert "fa4gen" in r["notes"] and "\n" not in r["notes"]["fa4gen"]
        assert "fa4cute" not in r.get("notes", {})
    assert "| FA4-CuTe |" in out and "budget spent" in out and "FA4-CuTe column empty" not in out


def test_write_into_out_itself_does_not_copy_onto_itself(tmp_path, monkeypatch):
    """`--out-dir $OUT` (the device tool's folder): the result is written there once, no SameFileError."""
    monkeypatch.setenv("OUT", str(tmp_path))
    path = tmp_path / "r.json"
    bench._write(path, {"a": 1})
    assert path.read_text().strip().startswith("{")
    other = tmp_path / "sub"
    other.mkdir()
    bench._write(other / "r2.json", {"b": 2})  # a different folder: copied into $OUT too
    assert (tmp_path / "r2.json").exists()


def test_interleaved_ms_alternates_and_reports_median_and_spread():
    calls = []
    times = iter([1.0, 10.0, 3.0, 30.0, 2.0, 20.0])

    def timer(fn, warmup_ms, rep_ms):
        calls.append((fn, warmup_ms, rep_ms))
        return next(times)

    out = bench.interleaved_ms({"a": "A", "b": "B"}, 3, 5, 50, timer=timer, rotate=False)
    assert [c[0] for c in calls] == ["A", "B"] * 3 and {c[1:] for c in calls} == {(5, 50)}
    assert out["a"] == (2.0, (0.5, 1.5)) and out["b"] == (20.0, (0.5, 1.5))


def test_interleaved_ms_rotates_the_first_contender():
    calls = []

    def timer(fn, warmup_ms, rep_ms):
        calls.append(fn)
        return {"A": 1.0, "B": 2.0, "C": 3.0}[fn]

    out = bench.interleaved_ms({"a": "A", "b": "B", "c": "C"}, 4, 5, 50, timer=timer)  # rotation is the default
    assert calls == ["A", "B", "C", "B", "C", "A", "C", "A", "B", "A", "B", "C"]
    assert {k: v[0] for k, v in out.items()} == {"a": 1.0, "b": 2.0, "c": 3.0}


def test_run_shape_makes_every_first_call_before_any_timing(monkeypatch, clean_import_state):
    """No contender is timed right after its own first call (a JIT compile leaves the GPU idle and
    cooler: the next timing runs faster): every first call comes first, then the interleaved rounds."""
    torch = pytest.importorskip("torch")
    events = []
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def sdpa(name, q, k, v, causal):
        events.append(f"first {name}")
        return (lambda: events.append(f"call {name}")), q * 1, ""

    def peer(q, k, v, causal=False):
        events.append("peer")
        return q * 1

    monkeypatch.setattr(bench, "_sdpa", sdpa)
    monkeypatch.setattr(bench, "_median_ms", lambda fn, warmup_ms, rep_ms: (events.append("time"), fn(), 1.0)[-1])
    row = bench.run_shape((1, 64, 2, 2, 64, False), "bf16", 5, 50, fa4cute=peer, rounds=2)
    first_time = events.index("time")
    assert {"first cudnn", "first flash"} <= set(events[:first_time]) and events[:first_time].count("peer") == 2
    assert "first cudnn" not in events[first_time:] and events.count("time") == 2 * 3  # 3 contenders x 2 rounds
    assert row["cudnn_ms"] == 1.0 and row["fa4cute_round_spread"] == (1.0, 1.0)


def test_tree_commit_says_when_the_files_are_not_the_commits(tmp_path, monkeypatch):
    """A bench JSON names the commit only when the tree is that commit's: a copy whose .git is older
    than its files (the GPU machine's) is marked, and no checkout gives None, never another repo's HEAD."""
    import subprocess

    assert bench.tree_commit() is None or bench.tree_commit().split("+")[0]  # this checkout (or none)
    repo = tmp_path / "r"
    repo.mkdir()
    for cmd in (["init", "-q"], ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "x"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True, capture_output=True)
    (repo / "f").write_text("1")
    subprocess.run(["git", "-C", str(repo), "add", "f"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "-m", "f"],
                   check=True)
    monkeypatch.setattr(bench, "ROOT", repo)
    clean = bench.tree_commit()
    assert clean and "+" not in clean
    (repo / "f").write_text("2")
    assert bench.tree_commit() == clean + "+modified"
    inner = repo / "sub"
    inner.mkdir()
    monkeypatch.setattr(bench, "ROOT", inner)  # inside another checkout: not ours
    assert bench.tree_commit() is None


def test_run_shape_survives_a_contender_failing_while_timed(monkeypatch, clean_import_state):
    """A contender that raises during the timed rounds loses its column (with a note), not the run."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "_sdpa", lambda name, q, k, v, causal: ((lambda: q * 1), q * 1, ""))
    calls = {"n": 0}

    def peer(q, k, v, causal=False):
        calls["n"] += 1
        if calls["n"] > 2:  # the two untimed calls pass, the timed ones fail
            raise RuntimeError("peer broke\nsecond line")
        return q * 1

    monkeypatch.setattr(bench, "_median_ms", lambda fn, warmup_ms, rep_ms: (fn(), 1.0)[-1])
    row = bench.run_shape((1, 64, 2, 2, 64, False), "bf16", 5, 50, fa4cute=peer, rounds=2)
    assert row["fa4cute_ms"] is None and row["notes"]["fa4cute"] == "RuntimeError: peer broke"
    assert row["cudnn_ms"] == 1.0 and row["flash_ms"] == 1.0


def test_head_dims_shapes_flops_and_help(capsys):
    """bench/head_dims.py's CPU side: its pairs, shape list, FLOP count, cuDNN refusal text and --help."""
    from bench import head_dims as hd

    assert (192, 128) in hd.default_pairs(quick=True) and (128, 128) not in hd.default_pairs(quick=True)
    assert hd.default_pairs(quick=False) == hd.PAIRS
    full = hd.shapes([(192, 128)])
    assert len(full) == 14 and {r[6] for r in full} == {False, True}
    assert {(r[0] * r[1], r[2], r[3]) for r in full[:12]} == {(16384, 16, 16), (32768, 16, 16)}  # B 1 at S 32k
    assert full[12:] == [(4, 4096, 128, 128, 192, 128, False), (4, 4096, 128, 128, 192, 128, True)]
    assert hd.shapes([(192, 128)], quick=True) == [(4, 4096, 16, 16, 192, 128, False), (1, 16384, 16, 16, 192, 128, True),
                                                   (4, 4096, 128, 128, 192, 128, True)]
    assert {r[2:4] for r in hd.shapes([(256, 256)])} == {(16, 2)}
    # 2 * B * H * S * S * (D + DV) / 2 for causal, at 1 ms: 2 * 16 * 16384^2 * 320 / 2 = 1.37438953472e15 FLOP
    assert hd.shape_tflops((1, 16384, 16, 16, 192, 128, True), 1.0) == pytest.approx(1374.38953472)
    assert hd.shape_tflops((1, 16384, 16, 16, 192, 128, False), 2.0) == pytest.approx(1374.38953472)
    warned = ["Flash attention kernel not used because:", "Flash attention has been runtime disabled.",
              "CuDNN attention kernel not used because:", "head_dim_qk != head_dim_v\nmore", "Memory efficient "
              "kernel not used because:", "Memory Efficient attention has been runtime disabled."]
    assert hd.cudnn_reasons(warned) == ["head_dim_qk != head_dim_v"]
    with pytest.raises(SystemExit) as e:
        hd.main(["--help"])
    assert e.value.code == 0 and "--pairs" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        hd.main(["--pairs", "192"])
    assert e.value.code == 2 and "expected D,DV" in capsys.readouterr().err


def test_run_shape_gives_each_contender_its_clock_window(monkeypatch, clean_import_state):
    """With a sampler, every timing of a contender is one window under that shape's tag, and the row's
    `clocks` holds this shape's summary per contender (not another shape's windows)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "_sdpa", lambda name, q, k, v, causal: ((lambda: q * 1), q * 1, ""))
    monkeypatch.setattr(bench, "_median_ms", lambda fn, warmup_ms, rep_ms: (fn(), 1.0)[-1])
    monkeypatch.setattr("time.sleep", lambda s: None)  # run_shape's wait for the sampler's last lines

    class Sampler:
        def __init__(self):
            self.windows = [("other shape:cudnn", 0, 0)]

        def window(self, name):
            import contextlib
            self.windows.append((name, 0, 0))
            return contextlib.nullcontext()

        def summary(self):
            return {n: {"samples": sum(w[0] == n for w in self.windows)} for n, _, _ in self.windows}

    s = Sampler()
    row = bench.run_shape((1, 64, 2, 2, 64, False), "bf16", 5, 50, fa4cute=lambda q, k, v, causal=False: q * 1,
                          rounds=3, sampler=s)
    assert set(row["clocks"]) == {"cudnn", "flash", "fa4cute"}
    assert all(c == {"samples": 3} for c in row["clocks"].values())  # one window per round
    # the share of each contender's timing its calls kept the GPU busy: calls counted through the timer
    assert all(row[f"{n}_busy_share"] > 0 for n in ("cudnn", "flash", "fa4cute"))


def test_kvcache_times_in_interleaved_rounds_and_subtracts_the_flushes(monkeypatch):
    """bench.kvcache: the eager timings and the graph replays are both interleaved rounds (rotated), and
    the flush-only graph, timed in the same rounds, is subtracted per call; a contender whose capture
    fails keeps its eager figure and says why."""
    from bench import kvcache

    class Graph:
        def __init__(self, label):
            self.label = label

        def replay(self):
            return self.label

    def capture(torch, fn, calls, flush):
        if fn is None:
            return Graph("flush"), None
        if fn == "bad":
            return None, "RuntimeError: capture refused"
        return Graph(f"g:{fn}"), None

    monkeypatch.setattr(kvcache, "_capture", capture)
    order = []
    ms = {"a": 1.0, "b": 2.0, "bad": 3.0, "g:a": 30.0, "g:b": 50.0, "flush": 10.0}

    def timer(fn, warmup, rep):
        label = fn() if callable(fn) else fn
        order.append(label)
        return ms[label]

    eager, graph, notes = kvcache.timed_rounds(None, {"a": "a", "b": "b", "bad": "bad"}, 10, object(), 2, 1, 1,
                                               timer, bench.interleaved_ms)
    assert eager == {"a": 1.0, "b": 2.0, "bad": 3.0}
    assert graph == {"a": pytest.approx(2.0), "b": pytest.approx(4.0)}  # (30 - 10) / 10, (50 - 10) / 10
    assert notes == {"bad": "RuntimeError: capture refused"}
    assert order[:6] == ["a", "b", "bad", "b", "bad", "a"]  # rotated eager rounds
    assert order[6:] == ["g:a", "g:b", "flush", "g:b", "flush", "g:a"]  # then rotated graph rounds


def test_run_shape_sustained_times_each_contender_back_to_back(monkeypatch, clean_import_state):
    """--sustained: every timing goes through sustained_ms (the span's seconds passed on), none through
    do_bench; without it, do_bench only."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "_sdpa", lambda name, q, k, v, causal: ((lambda: q * 1), q * 1, ""))
    used = []
    monkeypatch.setattr(bench, "_median_ms", lambda fn, w, r: (used.append("do_bench"), fn(), 2.0)[-1])
    monkeypatch.setattr(bench, "sustained_ms", lambda fn, s: (used.append(("sustained", s)), fn(), 1.0)[-1])
    row = bench.run_shape((1, 64, 2, 2, 64, False), "bf16", 5, 50, rounds=2, sustained_s=1.5)
    assert used and set(used) == {("sustained", 1.5)} and row["cudnn_ms"] == 1.0
    used.clear()
    row = bench.run_shape((1, 64, 2, 2, 64, False), "bf16", 5, 50, rounds=2)
    assert set(used) == {"do_bench"} and row["cudnn_ms"] == 2.0


def test_run_shape_times_only_the_contenders_named(monkeypatch, clean_import_state, capsys):
    """--time NAMES: the others still make their first call (outputs checked), none is timed, and
    their columns stay empty; an unknown name is a usage error (exit 2) before any GPU work."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    firsts, timed = [], []

    def sdpa(name, q, k, v, causal):
        firsts.append(name)
        return (lambda: timed.append(name)), q * 1, ""

    monkeypatch.setattr(bench, "_sdpa", sdpa)
    monkeypatch.setattr(bench, "_median_ms", lambda fn, w, r: (fn(), 1.0)[-1])
    row = bench.run_shape((1, 64, 2, 2, 64, False), "bf16", 5, 50, rounds=2, timed={"cudnn"})
    assert firsts == ["cudnn", "flash"] and set(timed) == {"cudnn"} and len(timed) == 2
    assert row["cudnn_ms"] == 1.0 and row["flash_ms"] is None
    assert bench.main(["--time", "fa4gen,nosuch"]) == 2
    assert "nosuch" in capsys.readouterr().err


def test_capture_graph_warms_up_captures_and_replays_once():
    """bench.attention.capture_graph (the one CUDA-graph capture of bench.kvcache, bench.ab and
    bench.decode_combine): fn once on a side stream, then `calls` x (flush, fn) inside the capture, one
    replay; fn None captures the flushes alone; a capture that raises reaches kvcache._capture's why."""
    import contextlib
    import types

    from bench import kvcache

    log = []

    class Graph:
        def replay(self):
            log.append("replay")

    class Stream:
        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def graph(g):
        log.append("capture{")
        yield
        log.append("}")

    cuda = types.SimpleNamespace(Stream=Stream, current_stream=Stream, stream=lambda s: contextlib.nullcontext(),
                                 synchronize=lambda: None, CUDAGraph=Graph, graph=graph)
    fake = types.SimpleNamespace(cuda=cuda)
    g = bench.capture_graph(fake, lambda: log.append("fn"), 2, flush=lambda: log.append("flush"))
    assert isinstance(g, Graph)
    assert log == ["fn", "capture{", "flush", "fn", "flush", "fn", "}", "replay"]
    log.clear()
    bench.capture_graph(fake, None, 2, flush=lambda: log.append("flush"))
    assert log == ["capture{", "flush", "flush", "}", "replay"]

    def broken():
        raise RuntimeError("operation not permitted when stream is capturing")
    g, why = kvcache._capture(fake, broken, 2, None)
    assert g is None and why.startswith("RuntimeError: operation not permitted")


def test_varlen_tile_bound_counts_part_filled_tiles(capsys):
    """bench.varlen.tile_bound: whole tiles waste nothing; a varlen batch of part-filled tiles against
    a dense shape of whole ones is bounded below 1 by the tiles alone (the heavy D 128 mix: 0.975)."""
    from bench import varlen

    # whole 128-row tiles and 128-key blocks, non-causal: every computed pair is real
    assert varlen.computed_pairs([256, 384], 128, 128, False) == 256 ** 2 + 384 ** 2
    # one part-filled tile: 130 rows compute 2 tiles x 2 blocks of 128 x 128
    assert varlen.computed_pairs([130], 128, 128, False) == 4 * 128 * 128
    # causal, one 128-row tile on its diagonal block: the whole block is computed, half of it real
    assert varlen.computed_pairs([128], 128, 128, True) == 128 * 128
    same = varlen.tile_bound([4864] * 7, 128, False)  # the batch is its own equal-work dense shape
    assert same["bound"] == 1.0 and same["varlen_useful"] == same["dense_useful"] == 1.0
    heavy = varlen.tile_bound(varlen.mix_lengths("heavy"), 128, False)
    assert heavy["varlen_tile"] == heavy["dense_tile"] == 128 and 0.95 < heavy["bound"] < 0.98
    assert varlen.main(["--model", "--only", "4,5"]) == 0  # no GPU needed
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and out[0].startswith("heavy") and "bound 0.975" in out[0] and "most loaded CTA" in out[0]


def test_varlen_deal_balance_model():
    """bench.varlen.deal_balance: the dynamic deal's most loaded CTA over the ideal. One CTA per task
    (as many SMs as tasks of equal cost) is balanced; one CTA takes everything; a batch whose long
    sequence comes last leaves its heavy tasks to the end, and sorting the sequences longest first
    brings it back near balance."""
    from bench import varlen

    # 4 sequences of 128 rows x 16 heads = 64 tasks of 1 block + 1: 64 SMs, one task each
    assert varlen.deal_balance([128] * 4, 128, False, sms=64) == 1.0
    assert varlen.deal_balance([128] * 4 + [1000], 128, True, sms=1) == 1.0
    late = [256] * 30 + [8192]  # the long causal sequence last: its 64-block tiles start at the end
    batch, first = varlen.deal_balance(late, 128, True, sms=512), varlen.deal_balance(late, 128, True, True, 512)
    assert batch > 1.08 and first < 1.05 and first < batch


def test_result_path_names_every_bench_file_alike(tmp_path):
    """bench.attention.result_path: <UTC stamp>_<GPU>[_<suffix>].json, the one naming of bench/results
    (attention, varlen, head_dims and ring write through it), its folder made if missing."""
    import re as _re

    p = bench.result_path(tmp_path / "new", {"gpu": "NVIDIA H200 (x)"}, "varlen")
    assert p.parent.is_dir() and _re.fullmatch(r"\d{4}-\d\d-\d\dT\d{6}Z_NVIDIA-H200-x_varlen\.json", p.name)
    assert bench.result_path(tmp_path, {"gpu": "NVIDIA H200"}).name.endswith("Z_NVIDIA-H200.json")


def test_ab_build_into_builds_from_a_revision_with_a_patch(tmp_path, capsys):
    """bench.ab --build-into: the suite's kernels built by the tree they come from: this checkout, or a
    temporary worktree of a revision with a patch applied (the patch reaches the PTX; the worktree is
    gone afterwards); the misuses are refused with a message."""
    import difflib
    import subprocess

    from bench import ab

    if not (ab.ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    rel = "templates/sm90/fa4_fwd.ptx.j2"
    old = subprocess.run(["git", "show", f"HEAD:{rel}"], cwd=ab.ROOT, capture_output=True, text=True,
                         check=True).stdout.splitlines(keepends=True)
    new = old[:5] + ["// ab-build-into marker\n"] + old[5:]
    patch = tmp_path / "marker.patch"
    patch.write_text("".join(difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}")))
    match = "d64_bf16_noncausal_gqa1_m192"
    assert ab.build_into(tmp_path / "here", "d64", match=match, log=lambda *a, **k: None) == [f"fa4_sm90a_{match}"]
    ab.build_into(tmp_path / "patched", "d64", rev="HEAD", patch=patch, env={"FA4GEN_UNUSED": "1"}, match=match,
                  log=lambda *a, **k: None)
    here = (tmp_path / "here" / f"fa4_sm90a_{match}.ptx").read_text()
    patched = (tmp_path / "patched" / f"fa4_sm90a_{match}.ptx").read_text()
    assert "ab-build-into marker" in patched and "ab-build-into marker" not in here
    assert (tmp_path / "patched" / f"fa4_sm90a_{match}.cubin").stat().st_size > 0
    trees = subprocess.run(["git", "worktree", "list"], cwd=ab.ROOT, capture_output=True, text=True).stdout
    assert str(tmp_path) not in trees and "fa4gen-ab-" not in trees
    with pytest.raises(RuntimeError, match="--patch needs --rev"):
        ab.build_into(tmp_path / "x", "d64", patch=patch)
    with pytest.raises(RuntimeError, match="no kernel"):
        ab.build_into(tmp_path / "x", "d64", match="no-such-kernel")
    with pytest.raises(SystemExit):
        ab.main(["--build-into", str(tmp_path / "x"), "--env", "NOEQUALS"])
    with pytest.raises(SystemExit):
        ab.main(["--baseline", str(tmp_path), "--rev", "HEAD"])
    capsys.readouterr()
