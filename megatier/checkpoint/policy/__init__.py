"""When a base is taken and where it goes: the interval, base_interval=auto, Tier-3's cadence, the config rules."""
