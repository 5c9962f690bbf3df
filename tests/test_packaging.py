"""CPU (CI): a wheel holds every commfuse package (the editable install CI uses would hide one missing)."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_in_pyproject():
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11+")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "commfuse").rglob("__init__.py")}
    assert found <= listed, f"packages missing from pyproject.toml's [tool.setuptools] packages: {sorted(found - listed)}"
    assert "commfuse.csrc" in listed  # the kernels' sources, from csrc/
