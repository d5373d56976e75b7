"""The assembler's environment (issue 10, item 10): an explicit FA4GEN_PTXAS that is not there is an
error naming it (no silent nvJitLink fallback), and a hung ptxas times out (default 120 s,
FA4GEN_PTXAS_TIMEOUT) with a message saying what timed out."""
import time

import pytest

import fa4gen.assemble.assemble as asm
from fa4gen.assemble.assemble import AssembleError, BackendUnavailableError, FailureKind

PTX = """.version 8.5
.target sm_90a
.address_size 64
.visible .entry k() { ret; }
"""


@pytest.mark.parametrize("kind", ["missing", "not executable", "a directory"])
def test_explicit_ptxas_that_is_not_usable_is_an_error(tmp_path, monkeypatch, kind):
    p = tmp_path / "ptxas"
    if kind == "not executable":
        p.write_text("#!/bin/sh\n")
        p.chmod(0o644)
    elif kind == "a directory":
        p.mkdir()
    monkeypatch.setenv("FA4GEN_PTXAS", str(p))
    monkeypatch.setattr(asm, "nvjitlink_available", lambda: True)  # a fallback would be there
    for call in (asm.find_ptxas, lambda: asm.resolve_backend("auto"), lambda: asm.resolve_backend("ptxas"),
                 lambda: asm.assemble(PTX, "sm_90a", name="k")):
        with pytest.raises(BackendUnavailableError) as ei:
            call()
        assert str(p) in str(ei.value) and "FA4GEN_PTXAS" in str(ei.value)
        assert len(str(ei.value).splitlines()) == 1


def test_default_timeout_is_120s_and_env_configurable(monkeypatch):
    monkeypatch.delenv("FA4GEN_PTXAS_TIMEOUT", raising=False)
    assert asm.ptxas_timeout_s() == 120.0
    monkeypatch.setenv("FA4GEN_PTXAS_TIMEOUT", "7.5")
    assert asm.ptxas_timeout_s() == 7.5
    for bad in ("soon", "-1", "0", "nan"):
        monkeypatch.setenv("FA4GEN_PTXAS_TIMEOUT", bad)
        with pytest.raises(ValueError, match="FA4GEN_PTXAS_TIMEOUT"):
            asm.ptxas_timeout_s()


def test_hung_ptxas_times_out_and_says_what(tmp_path, monkeypatch):
    hung = tmp_path / "hung-ptxas"
    hung.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "Cuda compilation tools, release 13.0, '
                    'V13.0.88"; exit 0; fi\nsleep 6\n')
    hung.chmod(0o755)
    monkeypatch.setenv("FA4GEN_PTXAS", str(hung))
    monkeypatch.setenv("FA4GEN_PTXAS_TIMEOUT", "1")
    t0 = time.monotonic()
    with pytest.raises(AssembleError) as ei:
        asm.assemble(PTX, "sm_90a", name="k", backend="ptxas")
    assert time.monotonic() - t0 < 4.5  # the child (and the shell's own child) were killed
    e = ei.value
    assert e.kind is FailureKind.TIMEOUT
    first = str(e).splitlines()[0]
    assert str(hung) in first and "1 s" in first and "FA4GEN_PTXAS_TIMEOUT" in first
