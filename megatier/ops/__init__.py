"""Python face of MegaTier's native ops (compiled in megatier/csrc).

Uses the compiled extension ``megatier._C`` when it is importable and falls
back to the pure-torch reference in :mod:`megatier.ops.reference` otherwise.
"""
from megatier.ops.reference import adamw_scalars, adamw_step

__all__ = ["adamw_scalars", "adamw_step"]
