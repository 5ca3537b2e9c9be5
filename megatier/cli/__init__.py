"""User-facing commands (console scripts in setup.py; scripts/ keeps thin wrappers)."""
