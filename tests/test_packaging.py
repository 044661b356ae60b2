"""What the installed distribution puts into site-packages: one top-level name, ``isagi``.

The repository keeps ``app/`` and ``storage/`` at the top (the layout its users know); the
wheel installs them as ``isagi.app`` and ``isagi.storage`` (pyproject.toml's package-dir), so
no generic name such as ``app`` or ``storage`` collides with another project's. These tests
build the real wheel, install it into a fresh virtual environment and look.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"isagi": "isagi", "app": "isagi.app", "storage": "isagi.storage"}


def declared_packages() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"]


def folder_packages() -> list[str]:
    """Every folder with an ``__init__.py`` under the three source folders, by its installed name."""
    found = []
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.append(".".join([package, *rel]))
    return sorted(found)


def test_pyproject_lists_every_package_folder():
    """A new subpackage left out of pyproject.toml's list would be missing from the wheel."""
    assert sorted(declared_packages()) == folder_packages()


def test_the_wheel_installs_only_isagi_at_the_top(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "-w", str(dist), str(ROOT)], check=True, capture_output=True, timeout=600)
    (wheel,) = dist.glob("isagi-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"isagi", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                                                + ".dist-info"}
    # the front end, the storage and its migrations are inside isagi/
    for path in ("isagi/app/server.py", "isagi/app/handlers/chat.py", "isagi/storage/history.py",
                 "isagi/storage/miku/reader.py", "isagi/storage/alembic.ini",
                 "isagi/storage/migrations/env.py"):
        assert path in names, path
    assert any(n.startswith("isagi/storage/migrations/versions/") and n.endswith(".py") for n in names)

    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=600)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    tops = {p.name for p in site.iterdir() if not p.name.endswith((".dist-info", ".pth"))
            and p.name not in ("pip", "_distutils_hack", "setuptools", "pkg_resources", "__pycache__")}
    assert tops == {"isagi"}, f"the wheel put these at the top of site-packages: {sorted(tops)}"
    # the modules are found under their installed names (found, not imported: --no-deps)
    probe = ("import importlib.util as u; "
             "print(all(u.find_spec(m) for m in ('isagi.app.server', 'isagi.storage.history')), "
             "u.find_spec('app') is None and u.find_spec('storage') is None)")
    out = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.split() == ["True", "True"]
