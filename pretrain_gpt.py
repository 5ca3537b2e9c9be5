"""Pre-train a GPT with MegaTier (the same as ``megatier-train``; see megatier/train.py).

    python pretrain_gpt.py model=tiny train.iters=20
    torchrun --nproc-per-node 4 pretrain_gpt.py model=small parallel.tp=2
"""
from megatier.train import cli

if __name__ == "__main__":
    cli()
