"""The CLI in a terminal: --help without torch, output within 80 columns (rich and plain text), a
progress line on stderr only when stderr is a terminal, and the `all` extra."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from headwise.cli import SUBCOMMANDS, main

ROOT = Path(__file__).resolve().parents[2]
GALLERY = "tests.checks.check_gallery"
ENV = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}


@pytest.mark.parametrize("argv", [["--help"], *[[name, "--help"] for name in SUBCOMMANDS]],
                         ids=lambda a: " ".join(a))
def test_help_imports_no_torch(argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "headwise", *argv], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "usage: headwise" in proc.stdout, proc.stderr
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")}
    heavy = {m for m in imported if m.split(".")[0] in ("torch", "transformers", "matplotlib", "rich", "numpy")}
    assert not heavy, sorted(heavy)
    assert "headwise.cli" in imported  # the measurement did see the CLI's own imports


def test_check_help_says_it_runs_user_code(capsys) -> None:
    assert main(["check", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "imports MODULE and runs its code" in out and "with your privileges" in out


COMMANDS = [
    ["tour", "--preset", "gpt2-small", "--seq", "16"],
    ["tour", "--d-model", "64", "--n-heads", "8", "--n-kv-heads", "2", "--seq", "4"],
    ["explain", "--preset", "llama-3-8b", "--seq", "4096"],
    ["explain", "--d-model", "768", "--n-heads", "12", "--seq", "64"],
    ["compare", "llama-2-7b", "llama-3-8b", "mistral-7b", "gpt3-175b", "--seq", "1024"],
    ["compare", "--list"],
    ["check", f"{GALLERY}:reference"],
    ["check", f"{GALLERY}:flatten_bug"],
]


def _block_rich(monkeypatch) -> None:
    for name in [m for m in sys.modules if m == "rich" or m.startswith("rich.")] + ["rich"]:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("rich", [True, False], ids=["rich", "plain"])
@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_output_fits_80_columns(capsys, monkeypatch, argv: list[str], rich: bool) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("COLUMNS", "80")
    if rich:
        pytest.importorskip("rich")
    else:
        _block_rich(monkeypatch)
    code = main(argv)
    out = capsys.readouterr().out
    assert code in (0, 1), out
    lines = out.splitlines()
    assert len(lines) > 5
    too_wide = [ln for ln in lines if len(ln) > 80]
    assert not too_wide, "\n".join(too_wide)
    # the narrow layout keeps what matters: every shape of the walk, every figure, every verdict
    if argv[0] in ("tour", "explain"):
        assert main([*argv, "--json"]) in (0, 1)
        steps = json.loads(capsys.readouterr().out)["steps"]
        for step in steps:  # every shape, unbroken, on the row of its step
            shape = str(tuple(step["shape"]))
            assert any(shape in ln and ln.split()[0] == step["name"].split()[0] for ln in lines), shape
        assert "columns left out to fit 80 columns: note, code" in " ".join(out.split())
    if argv[0] == "compare" and "--list" not in argv:
        assert all(name in out for name in argv[1:5]) and "KV cache" in out
    if argv[0] == "check":
        assert "head_independence" in out and "properties:" in out


def test_wide_terminal_keeps_every_column(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["tour", "--d-model", "64", "--n-heads", "8", "--seq", "4"]) == 0
    out = capsys.readouterr().out
    assert "q.transpose(1, 2)" in out and "columns left out" not in out


def _run_with_tty_stderr(argv: list[str]) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal (stdout a pipe); returns (code, stdout, terminal text)."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "headwise", *argv], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=slave, text=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    out = proc.stdout.read()
    code = proc.wait(timeout=120)
    os.close(master)
    return code, out, b"".join(chunks).decode(errors="replace")


@pytest.mark.timeout(240)
def test_progress_only_on_a_terminal_and_never_with_json() -> None:
    argv = ["tour", "--d-model", "64", "--n-heads", "8", "--seq", "4"]
    code, out, tty = _run_with_tty_stderr(argv)
    assert code == 0 and "[1/4] importing torch" in tty and "running every head alone" in tty
    assert "importing torch" not in out and "Shape walk" in out  # stdout has the result only
    assert tty.endswith("\r\x1b[K")  # the progress line is erased at the end
    code, out, tty = _run_with_tty_stderr([*argv, "--json"])
    assert code == 0 and tty == "" and out.lstrip().startswith("{")
    # stderr not a terminal: no progress (tests/cli/test_failures.py sees exactly one line on stderr)


def test_all_extra_is_the_union_of_the_others() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert sorted(extras["all"]) == sorted({*extras["hf"], *extras["cli"], *extras["viz"]})


def test_version(capsys) -> None:
    import tomllib
    from pathlib import Path

    from headwise.cli import main

    version = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["version"]
    assert main(["--version"]) == 0
    out, err = capsys.readouterr()
    assert out == f"headwise {version}\n" and err == ""


def test_a_terminal_narrower_than_the_minimum_gets_the_minimum_width_the_docs_name(capsys, monkeypatch) -> None:
    from headwise.cli.format import MIN_WIDTH

    docs = " ".join((ROOT / "docs" / "cli.md").read_text().split())
    assert f"never less than {MIN_WIDTH} (" in docs and f"`COLUMNS=20` gets {MIN_WIDTH}-column output" in docs
    monkeypatch.setenv("COLUMNS", "20")
    _block_rich(monkeypatch)
    assert main(["explain", "--d-model", "64", "--n-heads", "4", "--seq", "8"]) == 0
    widths = [len(ln) for ln in capsys.readouterr().out.splitlines()]
    assert max(widths) <= MIN_WIDTH and max(widths) > 20


@pytest.mark.parametrize("rich", [True, False], ids=["rich", "plain"])
@pytest.mark.parametrize("columns", [40, 60, 80, 100])
def test_a_table_too_wide_for_its_columns_is_split_and_loses_none(capsys, monkeypatch, columns: int,
                                                                     rich: bool) -> None:
    from headwise.cli.format import MIN_COLUMN
    from headwise.presets import PRESETS

    if rich:
        pytest.importorskip("rich")
    else:
        _block_rich(monkeypatch)
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["compare", *PRESETS]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= columns
    # every preset's figures, in order, across the parts: none lost, no line cut
    row = lambda label: [cell for ln in lines if ln.split()[:1] == [label] for cell in ln.split()[1:]]  # noqa: E731
    assert row("kind") == [p.config.kind for p in PRESETS.values()]
    assert row("d_model") == [str(p.config.d_model) for p in PRESETS.values()]
    parts = [ln for ln in lines if "(part " in ln]
    assert len(parts) > 1 and f"(part {len(parts)} of {len(parts)})" in parts[-1]
    docs = " ".join((ROOT / "docs" / "cli.md").read_text().split())
    assert f"narrower than {MIN_COLUMN} characters" in docs


def test_a_table_that_fits_is_not_split(capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["compare", "llama-2-7b", "llama-3-8b", "mistral-7b", "gpt3-175b"]) == 0
    assert "(part " not in capsys.readouterr().out


# A command with bad input (answered before torch loads), and valid ones.
BAD = ["explain", "--d-model", "8", "--n-heads", "3"]
BAD_MESSAGE = "headwise explain: error: n_heads=3 does not divide d_model=8"


@pytest.mark.parametrize("fd", [1, 2], ids=["stdout", "stderr"])
def test_a_closed_stream_changes_nothing_but_where_the_text_goes(fd: int) -> None:
    def run(argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "headwise", *argv], cwd=ROOT, env=ENV, capture_output=True,
                              text=True, timeout=60, preexec_fn=lambda: os.close(fd))  # as `>&-` / `2>&-`

    bad, listing = run(BAD), run(["compare", "--list"])
    assert (bad.returncode, listing.returncode) == (2, 0), (bad.stderr, listing.stderr)
    assert "Traceback" not in bad.stdout + bad.stderr + listing.stdout + listing.stderr
    if fd == 1:  # the one-line error still reaches stderr
        assert bad.stderr.startswith(BAD_MESSAGE) and len(bad.stderr.splitlines()) == 1
        assert listing.stderr == ""
    else:  # nothing of the error leaks onto stdout
        assert bad.stdout == "" and listing.stdout.startswith("Presets")


def test_commands_that_show_progress_run_with_stderr_closed(capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stderr", None)  # what Python makes of `2>&-`
    assert main(["explain", "--d-model", "8", "--n-heads", "2", "--seq", "2"]) == 0
    assert "Shape walk" in capsys.readouterr().out
    assert main(BAD) == 2  # the message has nowhere to go, and goes nowhere (not onto stdout)
    assert capsys.readouterr().out == "" and sys.stderr is None


def test_commands_run_with_stdout_closed(capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdout", None)  # what Python makes of `>&-`
    assert main(["explain", "--d-model", "8", "--n-heads", "2", "--seq", "2"]) == 0
    assert main(BAD) == 2 and sys.stdout is None
    assert capsys.readouterr().err.startswith(BAD_MESSAGE)


def test_progress_is_off_without_a_stderr(monkeypatch) -> None:
    from headwise.cli._progress import steps

    monkeypatch.setattr(sys, "stderr", None)  # closed, and main() not there to stand in for it
    with steps(2) as step:
        step("importing torch")
