"""Pre-train a GPT with MegaTier: compose config, build, train, close.

    megatier-train model=tiny train.iters=20                    (python pretrain_gpt.py ... is the same)
    megatier-run --nproc-per-node 4 -m megatier.train model=small parallel.tp=2 (torchrun, but exits as we do)

Arguments are Hydra overrides of the config groups in configs/ (docs/configuration.md); ``--cfg job`` prints
the config they compose to and exits, as Hydra's flag does. Exit statuses: :mod:`megatier.training.outcome`.
"""
from __future__ import annotations

import gc
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
    return run(overrides)


def cli() -> None:
    """The command (``megatier-train``, ``pretrain_gpt.py``, ``python -m megatier.train``): :func:`main`, then
    the process ends with its status without the interpreter's teardown. Everything the job keeps is closed by
    then; what is left are torch's C++ objects (process groups, stores, the groups of a world left in a
    recovery), whose destruction at exit can find a transport thread still joinable and abort a job that ended
    well (SIGABRT, exit 134)."""
    outcome.exit_skipping_teardown(main())


def run(overrides: list[str]) -> int:
    """Train the job of ``overrides`` on this process; its exit status."""
    console.set_up()
    # What the imports built lives as long as the process: later collections skip it, so the full collection an
    # in-process recovery makes to close the failed world's groups (megatier.training.reform) stays short.
    gc.freeze()
    stop = StopRequest(announce=is_rank0() and not inprocess.is_spare()).install()  # a waiting spare has no rank
    trainer = cfg = None
    try:
        inprocess.name_process()
        cfg = compose_config(overrides)
        stop.set_limits(cfg.train.exit_interval, cfg.train.exit_duration_in_mins)
        needed, membership = inprocess.wait_if_spare(cfg)  # a hot spare waits
        if not needed:
            return 0
        trainer = Trainer(cfg, stop=stop, membership=membership)
        trainer.train()
        summary = trainer.close()
    except inprocess.JobEnded:  # a survivor of a dropped replica, not needed again
        return 0
    except KeyboardInterrupt:  # a second Ctrl-C or SIGTERM: no drain
        return outcome.interrupted_twice(trainer, stop.signal)
    except outcome.DIVERGED as e:
        return outcome.diverged(trainer, e)
    except Exception as e:
        refused = outcome.refusal(e)
        if refused is None:
            raise
        return outcome.refuse(*refused, getattr(e, "announce", None))
    finally:
        inprocess.release_spares(trainer, cfg.recovery if cfg is not None else None)
        outcome.drop_process_group()
        stop.uninstall()
    return outcome.finished(trainer, summary)


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
    cli()
