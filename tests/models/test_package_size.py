"""The installable package stays under PyPI's default file limit (100 MB per wheel): the embedded weights are
most of it. Each file is deflated as a wheel's zip does (level 1 here, which compresses no better than the
wheel's default level, so the sum bounds the wheel from above up to its small metadata)."""
from __future__ import annotations

import zlib
from pathlib import Path

import leaplm

PYPI_LIMIT = 100 * 1000 * 1000
METADATA_MARGIN = 1 * 1000 * 1000        # RECORD, METADATA, zip headers: far below this


def deflated_size(path: Path) -> int:
    c = zlib.compressobj(1, zlib.DEFLATED, -15)
    n = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            n += len(c.compress(chunk))
    return n + len(c.flush())


def test_package_fits_pypis_default_file_limit():
    root = Path(leaplm.__file__).parent
    files = [p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    sizes = {p: deflated_size(p) for p in files}
    total = sum(sizes.values())
    largest = sorted(sizes, key=sizes.get, reverse=True)[:3]
    assert total + METADATA_MARGIN < PYPI_LIMIT, \
        f"{total / 1e6:.1f} MB deflated; largest: {[(str(p.relative_to(root)), round(sizes[p] / 1e6, 1)) for p in largest]}"
