"""Importing leaplm bounds how long torch's OpenMP threads spin after a parallel operation (GOMP_SPINCOUNT, read by
libgomp when torch loads), unless the user chose a wait policy or a spin count."""
from __future__ import annotations

import os
import subprocess
import sys

SHOW = "import leaplm, os; print(os.environ.get('GOMP_SPINCOUNT'))"


def spin_after_import(**env) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", SHOW], env={**clean, **env}, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def test_the_spin_is_bounded_unless_the_user_chose():
    assert spin_after_import() == "10000"
    assert spin_after_import(GOMP_SPINCOUNT="5") == "5"                 # the user's count is kept
    assert spin_after_import(OMP_WAIT_POLICY="ACTIVE") == "None"        # so is the user's policy
