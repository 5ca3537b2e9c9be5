"""The fault campaign: a catalogue of faults, an S3 fault proxy and the runner."""
