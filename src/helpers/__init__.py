"""Helpers for the notebook series: each is taught in a notebook first, then imported from its module here.

The modules at this level are what the notebooks and ``python -m helpers.finetune`` use; ``helpers.memory`` is
the memory predictor, behind one front door. ``helpers.build`` makes the bundled model, ``helpers.checks`` checks
the series (``make gpu-check``, shared test runs); neither is imported from this level. This file imports nothing,
so ``import helpers.gpu`` loads only what gpu.py needs.
"""
