"""Atomic file writes and the cleaning of temporary files that a killed writer left behind.

`atomic_write(path, data)` writes a temporary file in path's own directory, named
`.<name>.<pid>.<random>.tmp`, fsyncs it and renames it over path with os.replace (atomic on POSIX
file systems): a reader sees the old file or the new one, never a torn one. `clean_stale_tmp(dir)`
removes such temporaries whose writer process is gone or that are older than STALE_TMP_S.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from pathlib import Path

STALE_TMP_S = 600.0  # a live writer holds its temporary for milliseconds; 10 minutes is abandoned
_TMP_RE = re.compile(r"^\..+\.(\d+)\.[^.]+\.tmp$")


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Write data (bytes, or str as UTF-8) to path through a same-directory temporary + os.replace."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return False
    return True


def clean_stale_tmp(directory: str | os.PathLike, max_age_s: float = STALE_TMP_S) -> list[Path]:
    """Remove `.*.tmp` files in directory whose writer pid is dead (in the name since the pid was
    put there) or whose mtime is older than max_age_s. Returns what was removed; never raises."""
    removed = []
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for e in entries:
        if not (e.name.startswith(".") and e.name.endswith(".tmp")):
            continue
        try:
            if not e.is_file(follow_symlinks=False):
                continue
            m = _TMP_RE.match(e.name)
            dead = m is not None and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1)))
            old = now - e.stat(follow_symlinks=False).st_mtime > max_age_s
            if dead or old:
                os.unlink(e.path)
                removed.append(Path(e.path))
        except (OSError, ValueError):
            continue
    return removed


def env_seconds(name: str, default: float, *, allow_zero: bool = False) -> float:
    """A duration from the environment variable `name` (seconds, finite, > 0 or >= 0 with
    allow_zero), `default` when it is unset or empty; a ValueError naming the variable otherwise."""
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    ok = (value >= 0 if allow_zero else value > 0) and value != float("inf")
    if not ok:
        raise ValueError(f"{name}={raw!r}: expected a number of seconds {'>=' if allow_zero else '>'} 0")
    return value
