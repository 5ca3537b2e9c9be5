"""Fixtures of the checkpoint unit tests."""
from __future__ import annotations

import pytest

from megatier.checkpoint.commit.uploader import Uploader
from megatier.checkpoint.storage.store import ObjectStore
from tests.checkpoint_fakes import FAST, JOB


@pytest.fixture
def upload_all():
    """upload_all(store, {rank: [payloads]}, {rank: uploader kwargs}, incarnation) -> {rank: Uploader}.

    One uploader per rank, as each rank runs its own; all are closed at teardown.
    """
    made: list[Uploader] = []

    def start(store: ObjectStore, payloads_by_rank: dict[int, list], options: dict[int, dict] | None = None,
              incarnation: str = "launch0") -> dict[int, Uploader]:
        options = options or {}
        uploaders = {r: Uploader(store, JOB, r, incarnation=incarnation, backoff=FAST, **options.get(r, {}))
                     for r in payloads_by_rank}
        made.extend(uploaders.values())
        for r, payloads in payloads_by_rank.items():
            for p in payloads:
                uploaders[r].submit(p)
        return uploaders

    yield start
    for u in made:
        u.close(timeout=1.0)


