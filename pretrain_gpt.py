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

# Exit statuses: 0 trained (every checkpoint durable), 2 config error, 3 trained but Tier-3 stayed behind
# (the newest checkpoints are only in node memory), anything else a failure.
EXIT_CONFIG_ERROR, EXIT_TIER3_BEHIND = 2, 3


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(dict_cfg: DictConfig) -> None:
    cfg: Config = OmegaConf.to_object(dict_cfg)
    try:
        trainer = Trainer(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    trainer.train()
    summary = trainer.close()
    if trainer.ps.rank == 0:
        print(f"done: step {summary['step']} loss {summary.get('loss', float('nan')):.4f} "
              f"state_digest {summary['state_digest']}")
        print(f"metrics: {trainer.logger.path}")
        if trainer.logger.wandb_dir:
            print(f"wandb ({cfg.logging.wandb.mode}): {trainer.logger.wandb_dir}")
    if summary.get("checkpoint_behind"):
        print(f"checkpoints: Tier-3 is {summary['checkpoint_units_behind']} units behind; the last durable version is "
              f"{summary['checkpoint_durable_step']} (see the warning above)", file=sys.stderr)
        sys.exit(EXIT_TIER3_BEHIND)


if __name__ == "__main__":
    main()
