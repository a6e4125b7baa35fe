"""The distribution maps kernels/, server/ and client/ onto the one `difftape` namespace."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = {"kernels": "difftape", "server": "difftape.server", "client": "difftape.client"}


def test_every_package_folder_is_listed():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    assert conf["package-dir"] == {v: k for k, v in TOP.items()}
    found = set()
    for folder, name in TOP.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert found == listed, f"unlisted: {found - listed}, stale: {listed - found}"


def test_subpackages_import():
    import difftape
    import difftape.client
    import difftape.server

    assert difftape.server.__name__ == "difftape.server"
    assert difftape.client.__name__ == "difftape.client"
