"""The tiers behind one interface, and the stores they write to (see megatier.checkpoint)."""
