"""Runnable examples (each is a module with ``main(argv) -> int``, run with ``python -m``).

* :mod:`examples.tensor_parallel`: split one attention layer by heads over ranks
  (``torchrun --nproc-per-node 2 -m examples.tensor_parallel``).
"""
