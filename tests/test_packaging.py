"""The distribution maps every source folder to an import package."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_folder_is_packaged():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages, dirs = set(cfg["packages"]), cfg["package-dir"]
    assert set(dirs) == packages
    for top in ("engine", "router", "operator"):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).as_posix()
            name = "pagefleet." + rel.replace("/", ".")
            assert name in packages, f"{rel}/ is not in [tool.setuptools] packages"
            assert dirs[name] == rel


def test_operator_folder_does_not_shadow_stdlib():
    """Running Python from the repo root puts operator/ first on sys.path."""
    code = "import operator, collections; assert operator.eq(1, 1); print(operator.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "site-packages" not in out.stdout and str(ROOT / "operator") not in out.stdout


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "pagefleet.operator.cli", "--help"], capture_output=True,
                         text=True, check=True)
    assert "pagefleet" in out.stdout and "generate" in out.stdout
