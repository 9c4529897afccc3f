"""How large the check's tensors may be, judged without torch (the CLI asks before importing it).

Shapes:
    x: (b, s, d), float64: batch, tokens, d_model.
    weights: (b, h, s, s), float64: the attention probabilities the properties materialise.
"""

from __future__ import annotations

__all__ = ["MAX_INPUT_BYTES", "check_input_size"]

# The largest float64 tensor the check materialises, the input x (b, s, d) or the layer's (b, h, s, s)
# probabilities, may take at most this much: the properties need only tiny inputs, and each holds a few
# copies of both, so a bound on x alone let a long --seq run for hours on s x s weights.
MAX_INPUT_BYTES = 256 * 2 ** 20


def check_input_size(batch: int, seq_len: int, d_model: int | None = None, n_heads: int | None = None) -> None:
    """ValueError if the check's float64 input x (batch, seq_len, d_model) or its attention probabilities
    (batch, n_heads, seq_len, seq_len) would exceed :data:`MAX_INPUT_BYTES`.

    ``d_model=None``: x is not judged (its width is not known yet). ``n_heads=None``: the layer's head count
    is not known yet, and one head is counted, the least any attention layer materialises.

    Shapes:
        x: (b, s, d), float64
        weights: (b, h, s, s), float64

    Example:
        >>> check_input_size(3, 8, 64)
        >>> check_input_size(3, 8, 10 ** 12)
        Traceback (most recent call last):
        ...
        ValueError: the check's input x (batch, seq_len, d_model) = (3, 8, 1000000000000) in float64 would take 1.9e+14 bytes, over the limit of 256 MiB; the properties need only small inputs
        >>> check_input_size(1, 100_000, 32)
        Traceback (most recent call last):
        ...
        ValueError: the check's attention probabilities (batch, heads, seq_len, seq_len) = (1, 1, 100000, 100000) in float64 would take 8.0e+10 bytes (counting at least 1 head), over the limit of 256 MiB; the properties need only small inputs
    """
    heads = 1 if n_heads is None else n_heads
    x_bytes = 0 if d_model is None else batch * seq_len * d_model * 8
    weight_bytes = batch * heads * seq_len * seq_len * 8
    limit = f"over the limit of {MAX_INPUT_BYTES // 2 ** 20} MiB; the properties need only small inputs"
    if x_bytes > MAX_INPUT_BYTES and x_bytes >= weight_bytes:
        raise ValueError(f"the check's input x (batch, seq_len, d_model) = {(batch, seq_len, d_model)} in float64 "
                         f"would take {x_bytes:.1e} bytes, {limit}")
    if weight_bytes > MAX_INPUT_BYTES:
        counted = " (counting at least 1 head)" if n_heads is None else ""
        raise ValueError(f"the check's attention probabilities (batch, heads, seq_len, seq_len) = "
                         f"{(batch, heads, seq_len, seq_len)} in float64 would take {weight_bytes:.1e} bytes"
                         f"{counted}, {limit}")
