"""Optimizer: flat buffers, ZeRO-1 AdamW, LR schedule, loss scaling."""
