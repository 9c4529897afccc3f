"""Writing a picture's file (headwise.viz.files): the scratch file replaces the target only when complete."""

from __future__ import annotations

import os
import stat

import pytest

from headwise.viz.files import check_dpi, check_text, write_atomically


def test_a_failed_write_leaves_the_target_and_no_scratch_file(tmp_path) -> None:
    path = tmp_path / "picture.png"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="drawing failed"):
        with write_atomically(path) as tmp:
            assert tmp.parent == tmp_path and tmp.suffix == ".png" and tmp != path
            tmp.write_bytes(b"half")
            raise RuntimeError("drawing failed")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["picture.png"]


def test_a_finished_write_replaces_the_target_keeping_its_permissions(tmp_path) -> None:
    path = tmp_path / "page.html"
    path.write_bytes(b"old")
    os.chmod(path, 0o600)
    with write_atomically(path) as tmp:
        tmp.write_bytes(b"new")
    assert path.read_bytes() == b"new"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.html"]


def test_a_symlinked_target_is_written_through_the_link(tmp_path) -> None:
    real = tmp_path / "real.png"
    real.write_bytes(b"old")
    link = tmp_path / "link.png"
    link.symlink_to(real)
    with write_atomically(link) as tmp:
        tmp.write_bytes(b"new")
    assert link.is_symlink() and real.read_bytes() == b"new"


@pytest.mark.parametrize("value, error, match", [
    (5, TypeError, "title must be a str, got int 5"),
    (b"x", TypeError, "title must be a str, got bytes"),
    ("a\udcffb", ValueError, r"title must be valid Unicode .* got '\\udcff' at character 1, a lone surrogate"),
])
def test_check_text_refuses_what_a_file_cannot_hold(value, error, match) -> None:
    with pytest.raises(error, match=match):
        check_text("title", value)
    assert check_text("title", "caf\u00e9 \U0001f642") == "caf\u00e9 \U0001f642"


@pytest.mark.parametrize("dpi, error, match", [
    (100000, ValueError, r"dpi must be between 10 and 600 \(dots per inch\), got 100000"),
    (9.5, ValueError, r"dpi must be between 10 and 600 \(dots per inch\), got 9.5"),
    (0, ValueError, "dpi must be a positive finite number, got 0"),
    (float("inf"), ValueError, "dpi must be a positive finite number, got inf"),
    (True, TypeError, "dpi must be a number, got bool"),
])
def test_check_dpi_refuses_resolutions_outside_the_range(dpi, error, match) -> None:
    with pytest.raises(error, match=match):
        check_dpi(dpi)
    for ok in (10, 72, 100, 300.0, 600):
        check_dpi(ok)


def test_a_directory_that_cannot_take_the_file_is_named_with_the_target(tmp_path) -> None:
    target = tmp_path / "missing" / "heads.html"
    with pytest.raises(FileNotFoundError, match=r"cannot create files in '.*missing'") as info:
        with write_atomically(target):
            pass
    assert info.value.filename == str(target)  # not the scratch file's random name
