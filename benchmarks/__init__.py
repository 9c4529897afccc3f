"""The benchmark suite: headwise against the practical limit and its peers, side by side in one run.

``python -m benchmarks`` (``make bench`` adds ``--processes 3``) times every group, checks that every peer
computes what headwise computes, prints a table per group and the goal rows (met / missed), and writes
``benchmarks/RESULTS.md``. ``--quick`` runs the same machinery at tiny sizes (its RESULTS.md goes to a
temporary folder); ``--only forward,decode`` runs a subset. What is measured and how: docs/benchmarks.md.

This package imports nothing at import time: ``python -m benchmarks`` sets ``THP_MEM_ALLOC_ENABLE=1``
before torch is imported (:mod:`benchmarks.__main__`).
"""
