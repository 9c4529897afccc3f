"""A float64 per-head reference of one headwise layer, written from the formula, with per-site edits: the
reference of tests/trace/test_sites.py and tests/trace/test_sweep_sites.py.

Shapes:
    x (b, s, d); mask (b, 1, s_q, s_kv) bool; one head's slices: q, k, v, z (b, s, d_h), pattern (b, s_q, s_kv)
"""

from __future__ import annotations


def per_head_reference(attn, x, mask, edits, patterns=None):
    """float64, head by head: ``edits[(head, site)]`` maps that head's slice (b, s, n) to its replacement;
    each head's probabilities (after its edit) are appended to ``patterns`` if given."""
    h, h_kv, d_h = attn.n_heads, attn.n_kv_heads, attn.d_head
    g = h // h_kv
    w = {n: (getattr(attn, n).weight.double(), getattr(attn, n).bias.double()) for n in ("q_proj", "k_proj",
                                                                                          "v_proj", "out_proj")}
    x = x.double()
    y = w["out_proj"][1].expand(*x.shape[:2], -1).clone()
    for i in range(h):
        j = i // g
        rows = {"q": slice(i * d_h, (i + 1) * d_h), "k": slice(j * d_h, (j + 1) * d_h), "v": slice(j * d_h, (j + 1) * d_h)}
        part = {s: x @ w[f"{s}_proj"][0][rows[s]].T + w[f"{s}_proj"][1][rows[s]] for s in "qkv"}  # (b, s, d_h)
        for s in "qkv":
            if (i, s) in edits:
                part[s] = edits[(i, s)](part[s])
        scores = part["q"] @ part["k"].transpose(-1, -2) / d_h ** 0.5
        scores = scores.masked_fill(~mask[:, 0], float("-inf"))  # mask (b, 1, s_q, s_kv)
        p = scores.softmax(-1)
        if (i, "pattern") in edits:
            p = edits[(i, "pattern")](p)
        if patterns is not None:
            patterns.append(p)
        z = p @ part["v"]
        if (i, "z") in edits:
            z = edits[(i, "z")](z)
        y = y + z @ w["out_proj"][0][:, i * d_h:(i + 1) * d_h].T
    return y
