"""``headwise check MODULE:FACTORY``: run :func:`headwise.check` on your own attention layer.

``FACTORY`` names, in the importable ``MODULE``, either a layer (an ``nn.Module`` or a function
``f(x) -> y``) or something that returns one when called without arguments (a class or a function with no
required parameters). The current directory is importable, as with ``python -m``. This imports and runs
that code, with your privileges: check only code you would run yourself.

Exit codes: 0 every property asked for ran or was rightly skipped and passed, 1 a property failed or a
core property could not run (one line on stderr says which), 2 bad input.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
from typing import Any

from ..checks import CORE_PROPERTIES, PROPERTY_NAMES
from ..checks.sizes import check_input_size
from . import CliError
from . import format as fmt
from ._progress import steps
from ._sizes import size

WARNING = "This imports MODULE and runs its code (and the layer's) with your privileges."


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="property-test an attention layer (is it really attention?)",
                       description=f"Run the seven attention properties on MODULE:FACTORY. {WARNING} Exit 0: "
                                   f"OK; 1: a property failed, or a core property ({', '.join(CORE_PROPERTIES)}) "
                                   f"could not run; 2: bad input.")
    p.add_argument("target", metavar="MODULE:FACTORY",
                   help="e.g. mypkg.layers:make_attention (a layer, or a callable returning one); imported and run")
    p.add_argument("--d-model", type=size, default=None, help="width of x; required for plain functions")
    causal = p.add_mutually_exclusive_group()
    causal.add_argument("--causal", dest="causal", action="store_true", default=None,
                        help="the layer claims causality (check it)")
    causal.add_argument("--not-causal", dest="causal", action="store_false", help="the layer is not causal")
    p.add_argument("--batch", type=size, default=3, help="samples (default 3)")
    p.add_argument("--seq", type=size, default=8, help="tokens, at least 2 (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of every input and perturbation, in [0, 2**63 - 1] "
                                                        "(default 0)")
    p.add_argument("--property", action="append", dest="properties", metavar="NAME", choices=PROPERTY_NAMES,
                   help=f"run only this property (repeatable; each runs once): {', '.join(PROPERTY_NAMES)}")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run)


def check_args(args: argparse.Namespace) -> None:
    """Everything that can be judged before importing torch or the user's module."""
    module_name, sep, attr = args.target.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"expected MODULE:FACTORY (e.g. mypkg.layers:make_attention), got {args.target!r}")
    if args.seq < 2:
        raise CliError(f"--seq must be at least 2, got {args.seq}")
    if not 0 <= args.seed <= 2 ** 63 - 1:  # headwise.check's range, judged before importing torch
        raise CliError(f"--seed must be an int in [0, 2**63 - 1], got {args.seed}")
    # the (b, h, s, s) probabilities grow with seq_len squared whatever the width: judged even without --d-model
    check_input_size(args.batch, args.seq, args.d_model)


def load_target(target: str) -> Any:
    """Import ``MODULE:NAME`` and return the layer it names (calling a factory)."""
    module_name, _, attr = target.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # any import-time failure of user code is bad input, not a crash
        raise CliError(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CliError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if _is_factory(obj):
        try:
            obj = obj()
        except (Exception, SystemExit) as exc:
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


def _as_option(message: str) -> str:
    """headwise.check asks for its keyword (``pass d_model=``); on the command line that is ``--d-model``. A value
    (``d_model=64 but ...``) stays as it is."""
    return re.sub(r"\bd_model=(?![\w-])", "--d-model", message)


def run(args: argparse.Namespace) -> int:
    check_args(args)
    with steps(3, enabled=not args.json) as step:
        step("importing torch")
        from ..checks import check

        step(f"importing {args.target}")
        layer = load_target(args.target)
        n_heads = getattr(layer, "n_heads", None)
        if isinstance(n_heads, int) and not isinstance(n_heads, bool) and n_heads >= 1:
            # the layer says how many heads its (b, h, s, s) probabilities have: judge them exactly now
            try:
                check_input_size(args.batch, args.seq, args.d_model, n_heads)
            except ValueError as exc:
                raise CliError(str(exc)) from None
        step("checking the properties")
        try:
            # a property named twice runs once, as `heads --heads 0,0` draws head 0 once
            properties = None if args.properties is None else list(dict.fromkeys(args.properties))
            report = check(layer, d_model=args.d_model, causal=args.causal, batch=args.batch, seq_len=args.seq,
                           seed=args.seed, properties=properties)
        except (ValueError, TypeError) as exc:
            raise CliError(_as_option(str(exc).splitlines()[0]) if str(exc) else type(exc).__name__) from None
    if args.json:
        fmt.emit_json(report.to_dict())
    else:
        fmt.line(f"headwise check {args.target}: {report.layer}, d_model={report.d_model}, {report.dtype}, "
                 f"seed {report.seed}")
        fmt.table("Properties", ["property", "verdict", "deviation / tolerance", "counterexample or note"],
                  report.rows(), optional=["deviation / tolerance"])
        fmt.line(f"{report.verdict}. {report.tally}; {report.seconds:.2f} s.")
    if not report.ok:
        sys.stdout.flush()
        print(f"headwise check: {' '.join(report.verdict.split())}", file=sys.stderr)
    return 0 if report.ok else 1
