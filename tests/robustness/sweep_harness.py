"""The machinery of the adversarial sweep (tests/robustness/test_adversarial_sweep.py): one case, run with a
deadline, classified, with every watched piece of state compared bit for bit before and after a refusal.

A case is built fresh (``build(tmp) -> Setup``): ``call`` is the adversarial call, ``watch`` the objects whose
state a refusal must leave as it was (modules, caches, tensors, folders), ``check`` (cases that should simply
work) compares the answer with an independent reference and raises AssertionError when it differs.

Outcomes: ``refused`` (ValueError / TypeError / IndexError with a non-empty message), ``worked`` (returned,
and the check passed), ``silent`` (returned a wrong answer, or returned where it had to refuse),
``wrongly_refused`` (a clear refusal of an input that should simply work), ``hang`` (past the deadline) and
``traceback`` (any other exception, or a refusal without a message).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from headwise import KVCache

REFUSALS = (ValueError, TypeError, IndexError)
DEADLINE_S = 10.0
CATEGORIES = ("refused", "worked", "silent", "wrongly_refused", "hang", "traceback")


@dataclass
class Setup:
    call: Callable[[], Any]
    watch: list = field(default_factory=list)
    check: Callable[[Any], None] | None = None


@dataclass
class Case:
    id: str
    build: Callable[[Path], Setup]
    works: bool = False  # True: the input should simply work (and ``check`` says whether the answer is right)
    xfail: str | None = None  # what is wrong today, while a fix is on another branch


@dataclass
class Outcome:
    category: str
    detail: str
    state_ok: bool = True
    state_detail: str = ""

    @property
    def clean(self) -> bool:
        return self.category in ("refused", "worked") and self.state_ok


# -- snapshots ----------------------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> Any:
    """A tensor's dtype, shape, device and exact bits (NaN-safe); meta tensors by metadata only."""
    meta = (t.dtype, tuple(t.shape), str(t.device), t.requires_grad)
    if t.device.type == "meta":
        return meta
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    return meta, raw.clone()


def snapshot(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return ("tensor", _bits(obj))
    if isinstance(obj, KVCache):
        return ("cache", _bits(obj.keys), _bits(obj.values), obj.length, id(obj.owner), obj._resets)
    if isinstance(obj, nn.Module):
        tensors = {k: _bits(v) for k, v in obj.state_dict(keep_vars=True).items()}
        modules = {n: (type(m), m.training, m.__dict__.get("tracer"), _config(m)) for n, m in obj.named_modules()}
        params = {n: id(p) for n, p in obj.named_parameters(remove_duplicate=False)}
        return ("module", tensors, modules, params)
    if isinstance(obj, Path):
        if obj.is_dir():
            return ("dir", {str(p.relative_to(obj)): (p.read_bytes() if p.is_file() else p.is_dir())
                            for p in sorted(obj.rglob("*")) if not p.is_fifo()})
        return ("file", obj.read_bytes() if obj.exists() else None)
    raise TypeError(f"sweep: cannot snapshot {type(obj).__name__}")


def _config(module: nn.Module) -> Any:
    cfg = getattr(module, "config", None)
    return repr(cfg.to_dict()) if hasattr(cfg, "to_dict") and not hasattr(cfg, "kv_head_of") else cfg


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b or a == b


def _diff(watch: list, before: list) -> str:
    changed = []
    for i, (obj, old) in enumerate(zip(watch, before)):
        new = snapshot(obj)
        if not _same(old, new):
            if old[0] == "module":
                keys = [k for k in old[1] if k not in new[1] or not _same(old[1][k], new[1][k])]
                keys += [k for k in new[1] if k not in old[1]]
                extra = f" tensors {keys[:4]}" if keys else " (module classes, modes, tracer or config)"
            else:
                extra = ""
            changed.append(f"watched[{i}] {type(obj).__name__}{extra}")
    return ", ".join(changed)


# -- running one case ---------------------------------------------------------------------------------------
def _run_with_deadline(fn: Callable[[], Any], deadline: float) -> tuple[str, Any]:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # classified by the caller
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(deadline)
    if thread.is_alive():
        return "hang", None
    return ("error", box["error"]) if "error" in box else ("value", box.get("value"))


def run_case(case: Case, tmp: Path, deadline: float = DEADLINE_S) -> Outcome:
    try:
        setup = case.build(tmp)
    except BaseException as exc:  # a broken case is the sweep's own bug: say so loudly
        return Outcome("traceback", f"case set-up failed: {type(exc).__name__}: {exc}")
    before = [snapshot(o) for o in setup.watch]
    kind, value = _run_with_deadline(setup.call, deadline)
    if kind == "hang":
        return Outcome("hang", f"no answer within {deadline:.0f} s")
    if kind == "error":
        exc = value
        text = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, TimeoutError):  # a case that watches its own child process (the CLI) timed out
            return Outcome("hang", text[:500])
        if not isinstance(exc, REFUSALS) or not str(exc).strip():
            return Outcome("traceback", text[:500])
        diff = _diff(setup.watch, before)
        category = "wrongly_refused" if case.works else "refused"
        return Outcome(category, text[:500], not diff, diff)
    if not case.works:
        return Outcome("silent", f"returned {_short(value)} where a refusal was due")
    if setup.check is not None:
        kind, err = _run_with_deadline(lambda: setup.check(value), deadline)
        if kind == "hang":
            return Outcome("hang", "the reference check did not finish")
        if kind == "error":
            if isinstance(err, AssertionError):
                return Outcome("silent", f"wrong answer: {str(err)[:400]}")
            return Outcome("traceback", f"the check raised {type(err).__name__}: {err}"[:500])
    return Outcome("worked", _short(value))


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {value.dtype}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


# -- references shared by the case tables --------------------------------------------------------------------
def close(actual: Any, expected: torch.Tensor, *, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    """``actual`` is a tensor equal to the float64 ``expected`` within float32 tolerances (NaN/inf differ)."""
    assert isinstance(actual, torch.Tensor), f"expected a tensor, got {type(actual).__name__}"
    assert tuple(actual.shape) == tuple(expected.shape), f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert bool(torch.isfinite(actual).all()) or not bool(torch.isfinite(expected).all()), "non-finite output"
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


def summary(outcomes: dict[str, Outcome]) -> str:
    counts = {c: 0 for c in CATEGORIES}
    for o in outcomes.values():
        counts[o.category] += 1
    state = sum(1 for o in outcomes.values() if not o.state_ok)
    return (f"sweep: {len(outcomes)} cases, refused {counts['refused']}, worked {counts['worked']}, "
            f"silent {counts['silent']}, hangs {counts['hang']}, tracebacks {counts['traceback']}, "
            f"wrongly refused {counts['wrongly_refused']}, refusals that changed state {state}")

