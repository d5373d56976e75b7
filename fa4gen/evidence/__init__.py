"""Beside the chain, what shows a kernel right: the NumPy reference (reference.py), the pipeline simulator
(simulate.py), the PTX checker (check.py) and the PTX emulator (ptxemu/). Any stage's module may be read
here; no stage imports this package."""
