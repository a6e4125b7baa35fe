"""The picture-making examples (examples/*.py) at a small size: each one's loss goes down, and
its GIF and loss curve are written and are valid images of the size asked for.

The full-size runs made the README's gallery (examples/images/); these run the same code with
fewer steps, particles and iterations, a few seconds each.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.difftape_only  # difftape's examples (`import difftape as ti`)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str):
    """The example module, freshly imported (``pictures`` from the examples directory)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        sys.modules.pop(name, None)
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))


def run(name: str, argv: list[str]) -> list[float]:
    """``main(argv)`` of an example; ``ti.reset()`` afterwards whatever happens."""
    import difftape as ti

    try:
        return example(name).main(argv)
    finally:
        ti.reset()


def check_gif(path: Path, size: tuple[int, int], min_frames: int) -> None:
    """``path`` is a GIF of ``size`` with at least ``min_frames`` frames, not all the same."""
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "GIF" and im.size == size, (im.format, im.size)
        assert im.n_frames >= min_frames, im.n_frames
        frames = []
        for k in (0, im.n_frames - 1):
            im.seek(k)
            frames.append(np.asarray(im.convert("RGB")))
    assert not np.array_equal(frames[0], frames[1])
    with Image.open(path) as im:
        im.verify()


def check_png(path: Path) -> None:
    """``path`` is a 640x400 PNG with a drawn curve (more than the white background)."""
    from PIL import Image

    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == (640, 400), (im.format, im.size)
        rgb = np.asarray(im.convert("RGB")).astype(int)
    # the curve's blue: more blue than red by far
    assert ((rgb[..., 2] - rgb[..., 0]) > 100).sum() > 200


def test_mass_spring_robot_learns_to_move(tmp_path):
    losses = run("mass_spring", ["--iters", "5", "--steps", "150", "--width", "200",
                                 "--out", str(tmp_path)])
    assert len(losses) == 5 and np.all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.005, losses  # it moved at least 5 mm further right
    check_gif(tmp_path / "mass_spring.gif", (200, 100), 2 * 30)
    check_png(tmp_path / "mass_spring_loss.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mass_spring.gif",
                                                          "mass_spring_loss.png"]


def test_billiards_aims_through_collisions(tmp_path):
    losses = run("billiards", ["--iters", "4", "--steps", "256", "--res", "160",
                               "--out", str(tmp_path)])
    assert len(losses) == 4 and np.all(np.isfinite(losses))
    assert losses[-1] < 0.6 * losses[0], losses
    check_gif(tmp_path / "billiards.gif", (160, 160), 2 * 30)
    check_png(tmp_path / "billiards_loss.png")


def test_mpm_jelly_learns_to_crawl(tmp_path):
    losses = run("diffmpm", ["--iters", "4", "--steps", "256", "--grid", "32", "--width", "200",
                             "--out", str(tmp_path)])
    assert len(losses) == 4 and np.all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.001, losses  # the centre of mass moved 1 mm further
    check_gif(tmp_path / "diffmpm.gif", (200, 100), 2 * 30)
    check_png(tmp_path / "diffmpm_loss.png")


def test_hanging_arch_designs_loads_with_forward_mode(tmp_path):
    losses = run("hanging_arch", ["--iters", "4", "--beads", "7", "--res", "160",
                                  "--out", str(tmp_path)])
    assert len(losses) == 5 and np.all(np.isfinite(losses))
    assert losses[-1] < 1e-2 * losses[0], losses
    check_gif(tmp_path / "hanging_arch.gif", (160, 160), 5 + 2)  # repeats merge
    check_png(tmp_path / "hanging_arch_loss.png")


def test_tape_graph_draws_the_recording(tmp_path):
    """examples/tape_graph.py (the README's picture): the DOT always; the SVG, valid XML
    naming every launch, where Graphviz's dot is installed (refused, saying so, where not)."""
    import shutil
    from xml.etree import ElementTree

    import difftape as ti

    out = tmp_path / "tape.svg"
    if shutil.which("dot") is None:
        with pytest.raises(ti.MediaError, match="apt install graphviz"):
            run("tape_graph", ["--out", str(out)])
        assert (tmp_path / "tape.dot").exists()
        return
    files = run("tape_graph", ["--steps", "2", "--out", str(out)])
    assert files == [str(tmp_path / "tape.dot"), str(out)]
    root = ElementTree.parse(out).getroot()
    texts = {t.text for t in root.iter("{http://www.w3.org/2000/svg}text")}
    assert {"0: launch", "1: step", "2: step", "3: distance", "v0", "x (v2)"} <= texts, texts
