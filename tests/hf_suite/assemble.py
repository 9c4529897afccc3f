"""Assemble Hugging Face's test suite for the installed transformers in ``build/hf_suite``.

Two sources, nothing rewritten:

* the common test files (``tests/test_modeling_common.py``, ``test_configuration_common.py``,
  ``test_training_mixin.py``, ...) come from the PyPI sdist of the *installed* transformers version, fetched with
  ``pip download`` (a package registry, so CI may do it) and cached in ``build/hf_suite/sdist``;
* the per-family files and the generation / causal-LM testers, which the sdist does not ship, are vendored in
  ``tests/hf_suite/upstream`` (see its README for the source commit and the licence).

The result is a directory whose ``tests`` package is transformers' own layout, plus a ``pytest.ini`` that loads
:mod:`hf_plugin`. Run ``python tests/hf_suite/assemble.py`` to build it (idempotent; :mod:`tests.hf_suite.run`
calls :func:`assemble` itself).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UPSTREAM = Path(__file__).resolve().parent / "upstream"
BUILD = REPO / "build" / "hf_suite"

PYTEST_INI = """[pytest]
# written by tests/hf_suite/assemble.py: transformers' own tests, with headwise's plugin
addopts = -p hf_plugin -p no:cacheprovider
python_files = test_modeling_*.py
filterwarnings = ignore
"""


def sdist(version: str, cache: Path) -> Path:
    """The transformers sdist of ``version`` in ``cache``, downloaded from the package index when missing."""
    name = f"transformers-{version}.tar.gz"
    target = cache / name
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", f"transformers=={version}", "--no-binary",
                        ":all:", "--no-deps", "--quiet", "-d", str(cache)], check=True)
    if not target.exists():
        raise FileNotFoundError(f"pip download did not produce {target}")
    return target


def common_tests(archive: Path, into: Path) -> list[str]:
    """Extract the sdist's top-level ``tests/*.py`` into ``into``; return their names."""
    names = []
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if len(parts) == 3 and parts[1] == "tests" and parts[2].endswith(".py") and member.isfile():
                data = tar.extractfile(member)
                assert data is not None
                (into / parts[2]).write_bytes(data.read())
                names.append(parts[2])
    if "test_modeling_common.py" not in names:
        raise FileNotFoundError(f"{archive.name} ships no tests/test_modeling_common.py")
    return sorted(names)


def _stamp(archive: Path) -> str:
    """What the tree is built from: the sdist and a digest of every vendored file and of this script."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + PYTEST_INI.encode())
    for path in sorted(UPSTREAM.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(UPSTREAM)).encode() + path.read_bytes())
    return f"{archive.name} {digest.hexdigest()}"


def assemble(build: Path = BUILD) -> Path:
    """Build the suite in ``build`` (the vendored files, then the sdist's common files); return ``build``."""
    import transformers

    cache = build / "sdist"
    archive = sdist(transformers.__version__, cache)
    tree = build / "tree"
    stamp = _stamp(archive)
    if (tree / ".stamp").exists() and (tree / ".stamp").read_text() == stamp:
        return tree  # already built from the same sources (and maybe in use by another run)
    if tree.exists():
        shutil.rmtree(tree)
    shutil.copytree(UPSTREAM, tree, ignore=shutil.ignore_patterns("README.md", "LICENSE", "__pycache__"))
    common_tests(archive, tree / "tests")
    (tree / "pytest.ini").write_text(PYTEST_INI)
    # test_pipeline_mixin reads the sources of a transformers checkout at <root>/src/transformers
    (tree / "src").mkdir()
    (tree / "src" / "transformers").symlink_to(Path(transformers.__file__).parent, target_is_directory=True)
    (tree / ".stamp").write_text(stamp)  # last: a tree cut off half-built is rebuilt
    return tree


if __name__ == "__main__":
    print(assemble())
