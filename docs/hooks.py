"""MkDocs hooks: lay out the ``difftape`` package as it is installed, for the API reference,
and add the examples' pictures to the site.

The distribution maps three folders onto one import namespace (``kernels/`` is ``difftape``,
``client/`` is ``difftape.client``, ``server/`` is ``difftape.server``; see pyproject.toml),
which a static reader of the source such as griffe (mkdocstrings' Python handler) cannot follow
from the folders alone. When mkdocs starts, this hook makes ``build/api-src/difftape``: links to
the entries of ``kernels/`` plus ``client`` and ``server``, and mkdocs.yml points the handler
at ``build/api-src``. Nothing is imported, so building the docs runs no difftape code.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

LAYOUT = {"": "kernels", "client": "client", "server": "server"}


ROOT = Path(__file__).resolve().parents[1]


def on_startup(**kwargs) -> None:
    """Runs before any plugin reads its configuration (mkdocstrings looks for its ``paths``
    when it is configured, so the folder must exist by then)."""
    root = ROOT
    package = root / "build" / "api-src" / "difftape"
    shutil.rmtree(package.parent, ignore_errors=True)
    package.mkdir(parents=True)
    for entry in (root / LAYOUT[""]).iterdir():
        if entry.name != "__pycache__":
            os.symlink(entry, package / entry.name)
    for name, folder in LAYOUT.items():
        if name:
            os.symlink(root / folder, package / name)


def on_files(files, config, **kwargs):
    """The examples' pictures (``examples/images/``, the README's gallery) are the docs'
    ``images/`` too: one copy in the repository, shown by both."""
    from mkdocs.structure.files import File

    for path in sorted((ROOT / "examples" / "images").iterdir()):
        if path.is_file() and files.get_file_from_path(f"images/{path.name}") is None:
            files.append(File.generated(config, f"images/{path.name}", abs_src_path=str(path)))
    return files
