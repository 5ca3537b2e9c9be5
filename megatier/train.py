"""Pre-train a GPT with MegaTier: compose config, build, train, close.

    megatier-train model=tiny train.iters=20                    (python pretrain_gpt.py ... is the same)
    megatier-run --nproc-per-node 4 -m megatier.train model=small parallel.tp=2 (torchrun, but exits as we do)

Arguments are Hydra overrides of the config groups in configs/ (docs/configuration.md); ``--cfg job`` prints
the config they compose to and exits, as Hydra's flag does. Exit statuses: :mod:`megatier.training.outcome`.
"""
from __future__ import annotations

import sys
from typing import Optional

from omegaconf import OmegaConf

from megatier.config import ConfigError, compose_config
from megatier.training import console, inprocess, outcome
from megatier.training.interrupt import StopRequest
from megatier.training.outcome import is_rank0, say
from megatier.training.trainer import Trainer


def main(argv: Optional[list[str]] = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(overrides):
        print(__doc__)
        return 0
    if {"--cfg", "-c"} & set(overrides):
        return print_config(overrides)
    status, trainer = run(overrides)
    if trainer is not None and trainer.membership_epoch:  # the failed worlds' groups are not torn down safely
        outcome.exit_skipping_teardown(status)
    return status


def run(overrides: list[str]) -> tuple[int, Optional[Trainer]]:
    """Train the job of ``overrides`` on this process: its exit status and the trainer, if one was built."""
    console.set_up()
    stop = StopRequest(announce=is_rank0() and not inprocess.is_spare()).install()  # a waiting spare has no rank
    trainer = cfg = None
    try:
        inprocess.name_process()
        cfg = compose_config(overrides)
        stop.set_limits(cfg.train.exit_interval, cfg.train.exit_duration_in_mins)
        needed, membership = inprocess.wait_if_spare(cfg)  # a hot spare waits
        if not needed:
            return 0, None
        trainer = Trainer(cfg, stop=stop, membership=membership)
        trainer.train()
        summary = trainer.close()
    except inprocess.JobEnded:  # a survivor of a dropped replica, not needed again
        return 0, trainer
    except KeyboardInterrupt:  # a second Ctrl-C or SIGTERM: no drain
        return outcome.interrupted_twice(trainer, stop.signal), trainer
    except outcome.DIVERGED as e:
        return outcome.diverged(trainer, e), trainer
    except Exception as e:
        refused = outcome.refusal(e)
        if refused is None:
            raise
        return outcome.refuse(*refused), trainer
    finally:
        inprocess.release_spares(trainer, cfg.recovery if cfg is not None else None)
        outcome.drop_process_group()
        stop.uninstall()
    return outcome.finished(trainer, summary), trainer


def print_config(argv: list[str]) -> int:
    """Hydra's ``--cfg job`` (or ``-c job``): print the composed config as YAML, train nothing. Hydra's own
    config (``--cfg hydra``, ``all``) is not the job's business here: one line, exit 2."""
    flag = "--cfg" if "--cfg" in argv else "-c"
    at = argv.index(flag)
    part = argv[at + 1] if at + 1 < len(argv) else None
    try:
        if part != "job":
            given = f"{flag} {part}" if part else flag
            raise ConfigError(f"{given} is not supported: {flag} job prints the job's config (Hydra's own config "
                              f"does not apply to megatier-train)")
        cfg = compose_config(argv[:at] + argv[at + 2:])
    except ConfigError as e:
        return outcome.refuse(outcome.EXIT_CONFIG, f"config error: {e}")
    say(OmegaConf.to_yaml(OmegaConf.structured(cfg)).rstrip("\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
