"""Test tools (not part of MegaTier): fault injection for campaigns."""
