"""The repository's doors: a short README, and no pointer to files a clone does not have."""
from __future__ import annotations

import re
import subprocess

from tests.conftest import REPO

# Source documents are cited by title and arXiv id (docs/references.md), never by the file names of a
# working copy's neighbour folder.
OUTSIDE = re.compile(r"\.\./shared|shared/seeds|DESIGN\.md|\b00\d_[0-9a-f*]+\.txt")


def test_readme_is_a_short_guide():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_no_file_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    found = []
    for name in files:
        path = REPO / name
        if path.suffix in (".png", ".whl", ".so") or not path.is_file() or name == "tests/unit/test_repository.py":
            continue
        text = path.read_text(errors="replace")
        found += [f"{name}: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    assert not found, found
