"""Reclamation: what each tier may delete, and the one executor that deletes it (see megatier.checkpoint)."""
