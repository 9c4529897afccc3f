"""How large the check's inputs may be, judged without torch (the CLI asks before importing it).

Shapes:
    x: (b, s, d), float64: batch, tokens, d_model.
"""

from __future__ import annotations

__all__ = ["MAX_INPUT_BYTES", "check_input_size"]

# The check's float64 input x (b, s, d) may take at most this much: the properties need only tiny inputs,
# and each holds a few copies of x and of the layer's (b, h, s, s) weights.
MAX_INPUT_BYTES = 256 * 2 ** 20


def check_input_size(batch: int, seq_len: int, d_model: int) -> None:
    """ValueError if the check's float64 input (batch, seq_len, d_model) would exceed :data:`MAX_INPUT_BYTES`.

    Shapes:
        x: (b, s, d), float64

    Example:
        >>> check_input_size(3, 8, 64)
        >>> check_input_size(3, 8, 10 ** 12)
        Traceback (most recent call last):
        ...
        ValueError: the check's input x (batch, seq_len, d_model) = (3, 8, 1000000000000) in float64 would take 1.9e+14 bytes, over the limit of 256 MiB; the properties need only small inputs
    """
    nbytes = batch * seq_len * d_model * 8
    if nbytes > MAX_INPUT_BYTES:
        raise ValueError(f"the check's input x (batch, seq_len, d_model) = {(batch, seq_len, d_model)} in float64 "
                         f"would take {nbytes:.1e} bytes, over the limit of {MAX_INPUT_BYTES // 2 ** 20} MiB; the "
                         f"properties need only small inputs")
