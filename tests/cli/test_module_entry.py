"""`python -m leaplm` is the same interface as the `leaplm` console script."""
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def test_python_dash_m_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "leaplm", "--help"], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    for command in ("generate", "serve", "bench"):
        assert command in out.stdout
