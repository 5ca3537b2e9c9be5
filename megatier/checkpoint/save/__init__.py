"""The save path: the differential and base streams, serialized off the loop (see megatier.checkpoint)."""
