"""``headwise check MODULE:FACTORY``: run :func:`headwise.check` on your own attention layer.

``FACTORY`` names, in the importable ``MODULE``, either a layer (an ``nn.Module`` or a function
``f(x) -> y``) or something that returns one when called without arguments (a class or a function with no
required parameters). The current directory is importable, as with ``python -m``.
Exit codes: 0 every applicable property passed, 1 a property failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from typing import Any

from . import CliError
from . import _format as fmt


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="property-test an attention layer (is it really attention?)",
                       description="Run the seven attention properties on MODULE:FACTORY. Exit 1 if any fails.")
    p.add_argument("target", metavar="MODULE:FACTORY",
                   help="e.g. mypkg.layers:make_attention (a layer, or a callable returning one)")
    p.add_argument("--d-model", type=int, default=None, help="width of x; required for plain functions")
    causal = p.add_mutually_exclusive_group()
    causal.add_argument("--causal", dest="causal", action="store_true", default=None,
                        help="the layer claims causality (check it)")
    causal.add_argument("--not-causal", dest="causal", action="store_false", help="the layer is not causal")
    p.add_argument("--batch", type=int, default=3)
    p.add_argument("--seq", type=int, default=8, help="tokens (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--property", action="append", dest="properties", metavar="NAME",
                   help="run only this property (repeatable)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run)


def load_target(target: str) -> Any:
    """Import ``MODULE:NAME`` and return the layer it names (calling a factory)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"expected MODULE:FACTORY (e.g. mypkg.layers:make_attention), got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is bad input, not a crash
        raise CliError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CliError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if _is_factory(obj):
        try:
            obj = obj()
        except Exception as exc:
            raise CliError(f"{target}() raised {type(exc).__name__}: {exc}") from None
    if not callable(obj):
        raise CliError(f"{target} is a {type(obj).__name__}, not a layer or a factory returning one")
    return obj


def _is_factory(obj: Any) -> bool:
    import torch

    if isinstance(obj, torch.nn.Module):
        return False
    if inspect.isclass(obj):
        return True
    if not callable(obj):
        return False
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return not required


def run(args: argparse.Namespace) -> int:
    from ..checks import check

    layer = load_target(args.target)
    try:
        report = check(layer, d_model=args.d_model, causal=args.causal, batch=args.batch, seq_len=args.seq,
                       seed=args.seed, properties=args.properties)
    except (ValueError, TypeError) as exc:
        raise CliError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    if args.json:
        fmt.emit_json(report.to_dict())
    else:
        verdict = "OK" if report.ok else ("FAILED: " + ", ".join(report.failed) if report.failed else
                                          "nothing applicable was checked")
        fmt.line(f"headwise check {args.target}: {report.layer}, d_model={report.d_model}, {report.dtype}, "
                 f"seed {report.seed}")
        fmt.table("Properties", ["property", "verdict", "deviation / tolerance", "counterexample or note"],
                  report.rows())
        fmt.line(f"{verdict} ({report.seconds:.2f} s)")
    return 0 if report.ok else 1
