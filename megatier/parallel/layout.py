"""Layout: the 3D parallel layout (degrees) and one rank's coordinates in it.

The one place of the rank formula: tp fastest, then dp, then pp::

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

so a tensor-parallel group is a run of consecutive ranks and stays inside a
node whenever tp divides the processes per node. :class:`ParallelState` is a
Layout with process groups; checkpoint payloads are stamped with the plain
Layout that wrote them, so a copy separated from its run still says whose it is.
"""
from __future__ import annotations

from dataclasses import dataclass


def rank_of(tp_rank: int, dp_rank: int, pp_rank: int, *, tp: int, dp: int) -> int:
    """The global rank at coordinates (tp_rank, dp_rank, pp_rank)."""
    return pp_rank * (dp * tp) + dp_rank * tp + tp_rank


def coordinates_of(rank: int, *, tp: int, dp: int) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of ``rank``: the inverse of :func:`rank_of`."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


@dataclass(frozen=True)
class Layout:
    """The 3D layout (degrees) and a rank's coordinates in it."""

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

    def plain(self) -> "Layout":
        """Just the layout (a ParallelState without its process groups: picklable, comparable)."""
        return Layout(self.tp, self.pp, self.dp, self.tp_rank, self.pp_rank, self.dp_rank)

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp,
                "tp_rank": self.tp_rank, "pp_rank": self.pp_rank, "dp_rank": self.dp_rank}

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        return cls(*(int(d[k]) for k in ("tp", "pp", "dp", "tp_rank", "pp_rank", "dp_rank")))

    def __str__(self) -> str:
        return (f"tp={self.tp_rank}/{self.tp} pp={self.pp_rank}/{self.pp} dp={self.dp_rank}/{self.dp} "
                f"(rank {self.rank})")


def layout_str(degrees: tuple[int, int, int]) -> str:
    """``tp=2 pp=1 dp=2``: a layout's degrees for messages."""
    return "tp={} pp={} dp={}".format(*degrees)
