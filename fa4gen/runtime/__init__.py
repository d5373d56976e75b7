"""Stage 7 of the chain, load: loading and launching kernels (runtime.py, launch.py), the input checks
(validate.py), the torch-facing API (api.py, torch_ops.py) and context parallelism (distributed.py)."""
