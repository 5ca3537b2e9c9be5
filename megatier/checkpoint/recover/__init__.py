"""The recovery path: inventory, consensus, cascade, replay (see megatier.checkpoint)."""
