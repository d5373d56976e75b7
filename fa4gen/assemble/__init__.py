"""Stage 6 of the chain: PTX -> cubin (assemble.py), reading a cubin's problem back (cubin.py), the on-disk
cubin cache (cache.py) and its file helpers (fsutil.py)."""
