"""The driver of :func:`headwise.check`: adapt the layer, draw seeded inputs, run each property, gather the
:class:`~headwise.checks.report.Report`.

Shapes:
    b: batch, s: tokens, d: d_model, h: heads, d_h: head width; the layer maps (b, s, d) -> (b, s, d).
"""

from __future__ import annotations

import time
from typing import Any, Iterable

import torch

from .adapters import Adapter, NotExposed
from .choose import adapt
from .properties import PROPERTIES, Probe
from .report import FAIL, SKIPPED, PropertyResult, Report
from .sizes import check_input_size

__all__ = ["check"]

# What a layer may raise on the check's inputs and still be reported, not crash the check: any error,
# and SystemExit (user code calling sys.exit must not end the caller's process with a success code).
_LAYER_ERRORS = (Exception, SystemExit)
# Each property seeds its generator with seed + 1 + its index: the largest seed keeps that within torch's range.
MAX_SEED = 2 ** 63 - 1


def _keep_mask(b: int, s: int, device: torch.device) -> torch.Tensor:
    """Sample 0 unpadded, sample 1 padded on the right, sample 2 on the left, the rest unpadded."""
    keep = torch.ones(b, s, dtype=torch.bool, device=device)
    if b > 1:
        keep[1, s - max(1, s // 3):] = False
    if b > 2:
        keep[2, :max(1, s // 4)] = False
    return keep  # (b, s)


def _refuse_meta(layer: Any) -> None:
    """A layer whose weights are on the meta device has no numbers to check: refused in one line."""
    if not isinstance(layer, torch.nn.Module):
        return
    meta = next((n for n, t in [*layer.named_parameters(), *layer.named_buffers()] if t.is_meta), None)
    if meta is not None:
        raise ValueError(f"headwise.check: {type(layer).__name__} has its weights on the meta device ({meta} holds no "
                         "data); load or materialise them first (from_pretrained, or to_empty + load_state_dict)")


def _working_adapter(adapter: Adapter, x64: torch.Tensor) -> tuple[Adapter, torch.Tensor]:
    """The adapter in float64 when the layer runs in it (else float32, else its own dtype), and x in that dtype."""
    errors, tried = [], set()
    for dtype in (torch.float64, torch.float32, None):
        # always a copy where the layer can be copied (its own dtype too, a user's Adapter too): the check writes
        # into the working module's weights and runs it in eval mode; the caller's module must stay as it was
        work = adapter.converted(dtype) or adapter
        dt = dtype or work.dtype
        if dt in tried:  # its own dtype is one already tried: running it again would only repeat the error
            continue
        tried.add(dt)
        x = x64.to(dt).to(work.device)
        try:
            with torch.no_grad():
                y = work.run(x)
        except _LAYER_ERRORS as exc:  # the layer's own error: try the next dtype, report all if none works
            errors.append(f"{dt}: {type(exc).__name__}: {exc}")
            continue
        # A layer whose W_O sits outside it (BERT's self-attention) returns the merged heads, h * d_h wide
        want, what = (tuple(x.shape), "d_model") if not work.d_out else ((*x.shape[:2], work.d_out), "h * d_h")
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != want:
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(f"{adapter.name}: expected an output of shape (b, s, {what}) = {want}, got {got}")
        with torch.no_grad():  # on the working copy (eval mode, the check's dtype), never on the caller's layer
            return work.confirm_keywords(x), x
    raise ValueError(f"{adapter.name} fails on x of shape (b, s, d_model) = {tuple(x64.shape)}: "
                     + " | ".join(errors))


def _computed_precision(adapter: Adapter, x: torch.Tensor, keep: torch.Tensor) -> torch.dtype | None:
    """float32 when a layer checked in float64 returns weights that are all float32 numbers: its softmax runs in
    float32 (``softmax(dtype=torch.float32)``), so its outputs carry float32 rounding and are judged with float32
    tolerances. None otherwise, or when the weights cannot be had."""
    if x.dtype != torch.float64 or not adapter.exposes_weights:
        return None
    try:
        with torch.no_grad():
            _, w = adapter.run_weights(x, keep=keep if adapter.accepts_mask else None)
    except _LAYER_ERRORS:  # the properties report the layer's own errors
        return None
    if not isinstance(w, torch.Tensor) or w.dtype != torch.float64:
        return None
    w = w[torch.isfinite(w)]
    inner = w[(w > 0) & (w < 1)]  # 0 and 1 are float32 numbers whatever computed them
    if inner.numel() < 8 or not torch.equal(inner.float().double(), inner):
        return None
    # lower still (a float16 / bfloat16 softmax) is more rounding than the check forgives: judged as float64
    lower = any(torch.equal(inner.to(dt).double(), inner) for dt in (torch.float16, torch.bfloat16))
    return None if lower else torch.float32


def _validate(causal: Any, seed: Any, properties: Any) -> list[str]:
    """The names of the properties to run; TypeError / ValueError for an argument of the wrong kind."""
    if causal is not None and not isinstance(causal, bool):
        raise TypeError(f"causal must be True, False or None, got {causal!r} ({type(causal).__name__})")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r} ({type(seed).__name__})")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an int in [0, 2**63 - 1], got {seed}")
    if properties is None:
        return list(PROPERTIES)
    if isinstance(properties, (str, bytes)):
        raise TypeError(f"properties must be a list of property names (e.g. [{properties!r}]), got the "
                        f"{type(properties).__name__} {properties!r}")
    try:
        names = list(properties)
    except TypeError:
        raise TypeError(f"properties must be a list of property names, got {type(properties).__name__}") from None
    if not names:
        raise ValueError(f"properties must name at least one property (from {list(PROPERTIES)}), or be None for "
                         f"all, got {properties!r}")
    unknown = [n for n in names if not isinstance(n, str) or n not in PROPERTIES]
    if unknown:
        raise ValueError(f"unknown properties {unknown}; choose from {list(PROPERTIES)}")
    if len(set(names)) < len(names):  # the report holds one result per name (report[name])
        raise ValueError(f"properties must name each property once, got {names!r}")
    return names


def check(layer: Any, *, d_model: int | None = None, causal: bool | None = None, batch: int = 3,
          seq_len: int = 8, seed: int = 0, properties: Iterable[str] | None = None) -> Report:
    """Check that ``layer`` behaves like attention; returns a :class:`Report` (``report.ok``, ``report.failed``).

    Args:
        layer: a headwise ``MultiHeadAttention``, ``nn.MultiheadAttention``, a Hugging Face BERT / GPT-2 /
            Llama-family attention module or any other on transformers' attention interface (patched or not,
            or its view from ``headwise.interop.layers``), any module or ``f(x) -> y`` (see
            :mod:`headwise.checks.adapters` for how mask/causal/weights/heads are found), or an
            :class:`Adapter`.
        d_model: width of ``x``; required for plain callables, checked against modules.
        causal: the layer claims causality (property 3 applies). None: the layer's own claim (Hugging
            Face decoders yes, everything else no).
        batch, seq_len: input size (batch >= 3 and seq_len >= 4 exercise left and right padding).
        seed: an int in [0, 2**63 - 1]; every input and perturbation is drawn from it; the report is deterministic.
        properties: a list of names to run, each once (default all, in order: ``PROPERTY_NAMES``).

    Raises ``TypeError`` / ``ValueError`` for an argument of the wrong kind or range (``causal`` must be a bool or
    None, ``seed`` an int, ``properties`` a non-empty list of names, not one string, without repeats), or inputs
    whose float64 x or (b, h, s, s) probabilities (at the layer's head count) would exceed 256 MiB.

    Modules are copied (float64 when they run in it, else their own dtype; eval mode; without the caller's
    hooks; parametrizations baked in), and so is an :class:`Adapter` passed in, with the modules it holds; the
    layer passed in is not changed, and one that cannot be deep-copied is refused with a ``TypeError``. The run
    uses a forked copy of torch's global RNG seeded from ``seed``.
    The check runs with one intra-op thread (its tensors are tiny), restoring the setting afterwards.

    Shapes:
        layer: (b, s, d) -> (b, s, d)

    Example:
        >>> import torch, headwise
        >>> headwise.check(headwise.MultiHeadAttention(16, 4, n_kv_heads=2), d_model=16, causal=True).ok
        True
        >>> bad = lambda x: x.cumsum(1)                  # causal, but not attention: order matters
        >>> rep = headwise.check(bad, d_model=16)
        >>> rep.failed
        ['permutation_equivariance']
        >>> rep["causality"].verdict                     # a plain f(x) claims nothing unless causal=True
        'skipped'
    """
    names = _validate(causal, seed, properties)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the inputs are tiny: extra intra-op threads only add contention
    # A layer drawing from torch's global RNG (dropout, noise) must neither advance the caller's generator nor
    # make the report depend on it: the run gets a forked RNG seeded from `seed`
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            # the CPU generator only: torch.manual_seed would also (lazily) seed every CUDA device, beyond the fork
            torch.random.default_generator.manual_seed(seed)
            return _check(layer, d_model=d_model, causal=causal, batch=batch, seq_len=seq_len, seed=seed,
                          names=names)
    finally:
        torch.set_num_threads(threads)


def _check(layer: Any, *, d_model: int | None, causal: bool | None, batch: int, seq_len: int, seed: int,
           names: list[str]) -> Report:
    start = time.perf_counter()
    for label, value, low in (("batch", batch, 1), ("seq_len", seq_len, 2), ("d_model", d_model, 1)):
        if label == "d_model" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{label} must be an int >= {low}, got {value!r}")
    if d_model is not None:
        check_input_size(batch, seq_len, d_model)
    _refuse_meta(layer)
    adapter = adapt(layer, d_model=d_model, causal=causal)
    _refuse_meta(getattr(adapter, "module", None))
    if d_model is not None and adapter.d_model != d_model:
        raise ValueError(f"d_model={d_model} but {adapter.name} has d_model={adapter.d_model}")
    # the (b, h, s, s) probabilities at the layer's own head count, as the command line judges them
    heads = adapter.n_heads if isinstance(adapter.n_heads, int) and adapter.n_heads >= 1 else None
    check_input_size(batch, seq_len, adapter.d_model, heads)
    generator = torch.Generator().manual_seed(seed)
    x64 = torch.randn(batch, seq_len, adapter.d_model, generator=generator, dtype=torch.float64)
    work, x = _working_adapter(adapter, x64)
    keep = _keep_mask(batch, seq_len, x.device)
    probe = Probe(work, x, keep, generator, seed, _computed_precision(work, x, keep))
    results = []
    for name in names:
        probe.generator.manual_seed(seed + 1 + list(PROPERTIES).index(name))  # each property alone is reproducible
        try:
            with torch.no_grad():
                results.append(PROPERTIES[name](probe))
        except NotExposed as exc:  # the check cannot read what the property needs: its limit, not the layer's fault
            results.append(PropertyResult(name, SKIPPED, str(exc)))
        except _LAYER_ERRORS as exc:  # a layer that breaks on the property's input fails it, with the reason
            results.append(PropertyResult(name, FAIL, f"the layer raised {type(exc).__name__}", {
                "summary": f"raised {type(exc).__name__}: {str(exc)[:160]}"}))
    return Report(adapter.name, adapter.d_model, str(x.dtype).replace("torch.", ""), seed, results,
                  time.perf_counter() - start)
