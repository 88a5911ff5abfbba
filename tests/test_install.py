"""The built wheel carries what an installed kvconvert needs (runtime sources, calibration text)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # Triton's interpreter / wheel builds: minutes; `make test-fast` skips them

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w",
         str(out), str(ROOT)], capture_output=True, text=True,
    )  # fmt: skip
    if built.returncode != 0:
        pytest.skip(f"cannot build a wheel here: {built.stderr.strip().splitlines()[-1:]}")
    return next(out.glob("kvconvert-*.whl"))


def test_wheel_holds_runtime_and_calibration_text(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "kvconvert/runtime/modeling_kvconvert.py" in names and "kvconvert/runtime/kvconvert_tokenlayout.py" in names
    calib = [n for n in names if n.startswith("kvconvert/calib_data/") and n.endswith(".txt")]
    assert len(calib) == len(list((ROOT / "kvconvert" / "calib_data").glob("*.txt"))) > 0


def test_installed_wheel_calibrates_with_the_default_text(wheel, tiny_model_dir, tmp_path):
    """A fresh venv (dependencies from this interpreter) with the wheel installed, run outside the source
    tree: `kvconvert zack` finds its default calibration text inside the installed package."""
    from tests.conftest import save_tiny_tokenizer

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    where = subprocess.run([str(python), "-c", "import kvconvert; print(kvconvert.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert str(venv) in where, f"the wheel is not what runs: {where}"
    src = tiny_model_dir("llama_gqa")
    model = tmp_path / "model"
    subprocess.run(["cp", "-r", str(src), str(model)], check=True)
    save_tiny_tokenizer(model)
    result = subprocess.run(
        [str(venv / "bin" / "kvconvert"), "zack", "--model", str(model), "--out", str(tmp_path / "z"),
         "--removal-rate", "0.1", "--calib-tokens", "2048", "--quiet"],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "calib_data" in (tmp_path / "z" / "kvconvert.json").read_text()
