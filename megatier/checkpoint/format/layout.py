"""ShardLayout: which slice of the training state a payload holds, named by its 3D coordinates.

Stamped on every payload, so a copy separated from its run still says which
layout and rank wrote it. The rank follows the job's one rank formula
(:func:`megatier.parallel.state.rank_of`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatier.parallel.state import rank_of


@dataclass(frozen=True)
class ShardLayout:
    """The 3D layout (degrees) and this rank's coordinates in it."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    def __post_init__(self) -> None:
        for degree, coord in ((self.tp, self.tp_rank), (self.pp, self.pp_rank), (self.dp, self.dp_rank)):
            if degree < 1 or not 0 <= coord < degree:
                raise ValueError(f"invalid layout {self.to_dict()}: each coordinate must lie in [0, degree)")

    @property
    def rank(self) -> int:
        return rank_of(self.tp_rank, self.dp_rank, self.pp_rank, tp=self.tp, dp=self.dp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def degrees(self) -> tuple[int, int, int]:
        return self.tp, self.pp, self.dp

    @classmethod
    def from_parallel_state(cls, ps: Any) -> "ShardLayout":
        return cls(ps.tp, ps.pp, ps.dp, ps.tp_rank, ps.pp_rank, ps.dp_rank)

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp,
                "tp_rank": self.tp_rank, "pp_rank": self.pp_rank, "dp_rank": self.dp_rank}

    @classmethod
    def from_dict(cls, d: dict) -> "ShardLayout":
        return cls(*(int(d[k]) for k in ("tp", "pp", "dp", "tp_rank", "pp_rank", "dp_rank")))

    def __str__(self) -> str:
        return (f"tp={self.tp_rank}/{self.tp} pp={self.pp_rank}/{self.pp} dp={self.dp_rank}/{self.dp} "
                f"(rank {self.rank})")


def layout_str(degrees: tuple[int, int, int]) -> str:
    """``tp=2 pp=1 dp=2``: a layout's degrees for messages."""
    return "tp={} pp={} dp={}".format(*degrees)
