"""Pre-train a GPT with MegaTier: compose config, build, train, close.

    python pretrain_gpt.py model=tiny train.iters=20
    torchrun --nproc-per-node 4 pretrain_gpt.py model=small parallel.tp=2
"""
from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from megatier.config import Config, ConfigError, register_configs
from megatier.training.trainer import Trainer

register_configs()


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(dict_cfg: DictConfig) -> None:
    cfg: Config = OmegaConf.to_object(dict_cfg)
    try:
        trainer = Trainer(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    trainer.train()
    summary = trainer.close()
    if trainer.ps.rank == 0:
        print(f"done: step {summary['step']} loss {summary.get('loss', float('nan')):.4f} "
              f"state_digest {summary['state_digest']}")
        print(f"metrics: {trainer.logger.path}")
        if trainer.logger.wandb_dir:
            print(f"wandb ({cfg.logging.wandb.mode}): {trainer.logger.wandb_dir}")


if __name__ == "__main__":
    main()
