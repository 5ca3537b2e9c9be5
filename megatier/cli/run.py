r"""megatier-run: torchrun for MegaTier jobs, ending with the workers' own exit status.

    megatier-run --nproc-per-node 4 -m megatier.train model=tiny parallel.tp=2 train.iters=20
    megatier-run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host0:29400 \
        -m megatier.train model=small parallel.tp=2 train.micro_batch_size=1

It takes exactly torchrun's arguments and runs torchrun's elastic agent. What differs is how a launch ends.
torchrun turns any worker failure into its own status 1 and a traceback of its launcher, and a Ctrl-C into a
traceback too, after the workers already said why in one line (a refusal, a divergence stop, "interrupted at
step N"). Here the launch exits with the status of the first worker that failed (docs/operations.md lists
them) and adds nothing when that status is one the training command explains itself; a crash still gets
torchrun's summary of which rank failed, without the launcher's own traceback. A Ctrl-C or a scheduler's SIGTERM
ends with the workers' statuses once they have finished their step and drained (130 after Ctrl-C, 0 after
SIGTERM), as ``megatier-train`` does; torchrun's agent forgets them, so each worker leaves its own in a folder
of this launch's (:func:`megatier.training.outcome.record_status`).
"""
from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from typing import Optional

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from megatier.drill.cluster import exit_status
from megatier.training import outcome

# Statuses whose worker printed the reason in one line (rank 0): the launcher adds nothing to them.
EXPLAINED = frozenset({outcome.EXIT_CONFIG, outcome.EXIT_TIER3_BEHIND, outcome.EXIT_RECOVERY_REFUSED,
                       outcome.EXIT_DIVERGED, outcome.EXIT_RESTORE_LOOP, outcome.EXIT_REFORM_FAILED,
                       outcome.EXIT_INTERRUPTED, outcome.EXIT_TERMINATED})
_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\)")
_CLOSING = re.compile(r"Sending process \d+ closing signal")


class _QuietForExplained(logging.Filter):
    """Drops the agent's "failed (exitcode: N)" line for a status the worker has already explained, and its
    lines about signalling the other workers to stop (its mechanics, said once per worker)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if _CLOSING.search(message):
            return False
        found = _FAILED.search(message)
        return found is None or exit_status(int(found.group(1))) not in EXPLAINED


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    quiet = _QuietForExplained()
    logging.getLogger(_AGENT_LOGGER).addFilter(quiet)
    statuses = tempfile.TemporaryDirectory(prefix="megatier-run-")
    os.environ[outcome.STATUS_DIR] = statuses.name  # the workers inherit it
    try:
        run(args)
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        status = exit_status(failure.exitcode)
        if status not in EXPLAINED:
            print(e.format_msg(), file=sys.stderr)
        return status
    except SignalException as e:
        # The agent has sent the signal on to its workers and waited for them: they finished their step, drained
        # and printed where to resume. A worker that did not end on its own makes it the signal's death.
        return _stopped_status(statuses.name, args.nproc_per_node, int(e.sigval))
    finally:
        logging.getLogger(_AGENT_LOGGER).removeFilter(quiet)
        del os.environ[outcome.STATUS_DIR]
        statuses.cleanup()
    return 0


def _stopped_status(directory: str, nproc_per_node: str, sig: int) -> int:
    """The launch's status after a signal stopped it: the worst its workers recorded, when each of them did."""
    found = outcome.recorded_statuses(directory, int(nproc_per_node)) if nproc_per_node.isdigit() else None
    return max(found) if found else 128 + sig


if __name__ == "__main__":
    sys.exit(main())
