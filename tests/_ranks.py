"""Run one process per rank (spawn) and fail with every rank's traceback: the multi-process tests of
fa4gen.distributed (gloo on CPUs, NCCL on GPUs) share it. A worker writes `rank{r}.err` in out_dir
when it raises; `target(rank, world, init_file, out_dir)` must be importable (a module-level function)."""

from __future__ import annotations

from pathlib import Path


def run_ranks(target, world: int, out_dir, timeout: float) -> None:
    import torch.multiprocessing as mp

    out = Path(out_dir)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, str(out / "init"), str(out))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    errs = "\n".join((out / f"rank{r}.err").read_text() for r in range(world) if (out / f"rank{r}.err").exists())
    assert not alive and not errs and all(p.exitcode == 0 for p in procs), (
        f"{len(alive)} rank(s) hung; exit codes {[p.exitcode for p in procs]}\n{errs}")
