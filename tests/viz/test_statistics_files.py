"""The statistics pictures' files: a title a file cannot hold, a resolution that cannot fit in memory, or a
failure while writing is refused with the existing file left as it was."""

from __future__ import annotations

import pytest
import torch

from headwise.viz.statistics import HeadStatistics
from headwise.viz.stats_html import render_statistics_html, save_statistics_html
from headwise.viz.stats_png import save_statistics_png


def _stats() -> HeadStatistics:
    return HeadStatistics(["a", "b"], torch.zeros(1, 2, 2), torch.ones(1, 2, 2), torch.ones(1, 2, 2),
                          torch.ones(2, dtype=torch.bool), "toy")


@pytest.mark.parametrize("save, name", [(save_statistics_html, "old.html"), (save_statistics_png, "old.png")])
@pytest.mark.parametrize("kw, error, match", [
    (dict(title="bad \udcff title"), ValueError, r"title must be valid Unicode .* got '\\udcff' at character 4"),
    (dict(title=5), TypeError, "title must be a str, got int 5"),
])
def test_a_refused_title_leaves_an_existing_file_as_it_was(tmp_path, save, name, kw, error, match) -> None:
    if save is save_statistics_png:
        pytest.importorskip("matplotlib")
    path = tmp_path / name
    path.write_bytes(b"PREVIOUS")
    with pytest.raises(error, match=match):
        save(_stats(), path, **kw)
    assert path.read_bytes() == b"PREVIOUS"
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_the_statistics_page_refuses_a_title_that_is_not_text() -> None:
    with pytest.raises(TypeError, match="title must be a str, got int 5"):
        render_statistics_html(_stats(), title=5)


def test_the_statistics_png_refuses_a_resolution_that_cannot_fit_in_memory(tmp_path) -> None:
    path = tmp_path / "old.png"
    path.write_bytes(b"PREVIOUS")
    with pytest.raises(ValueError, match=r"dpi must be between 10 and 600 \(dots per inch\), got 100000"):
        save_statistics_png(_stats(), path, dpi=100000)
    assert path.read_bytes() == b"PREVIOUS"


def test_a_statistics_png_that_fails_while_being_written_leaves_the_old_file(tmp_path, savefig_fails_halfway) -> None:
    path = tmp_path / "old.png"
    path.write_bytes(b"PREVIOUS")
    with pytest.raises(OSError, match="No space left"):
        save_statistics_png(_stats(), path)
    assert path.read_bytes() == b"PREVIOUS"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.png"]
