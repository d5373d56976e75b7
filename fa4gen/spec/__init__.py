"""Stage 1 of the chain, what to build: the config (config.py), its tile rules (tiles.py), the plan both the
IR and the lowering read (plan.py), the host/device work order (schedule.py), the exp2 emulation (exp2.py).
Nothing here imports a later stage (tests/test_imports.py)."""
