"""Stage 5 of the chain: the Jinja environment over templates/ (jinja.py) and the two kernels rendered from
their lowered contexts (kernels.py: build_sm90, build_sm100)."""
