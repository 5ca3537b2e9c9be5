"""The training command's console: log records as bare lines, libraries' chatter kept out, MegaTier's warnings
as one line, and every line clear of the progress bar.

- Log records go to stdout with the bar cleared (``tqdm.external_write_mode``): a line logged while the bar is
  drawn would otherwise be glued to the bar's last frame ("  5%|▌ | 1/20 [...]capture schedule: ...").
- botocore and its kin log at INFO what only matters when debugging them ("Found credentials in environment
  variables."): they print from WARNING on.
- A warning MegaTier raises (its category is defined in megatier) is one line on stderr, printed by global
  rank 0 only, as the same condition warns on every rank; Python's default adds the source line that raised it.
  Other libraries' warnings keep Python's format, whose location helps with their cause.
"""
from __future__ import annotations

import logging
import sys
import warnings

from megatier.training.outcome import is_rank0

QUIET_LIBRARIES = ("botocore", "boto3", "s3transfer", "urllib3")


class _ClearOfTheBar(logging.StreamHandler):
    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:  # flushed before the bar is redrawn: a pipe's buffer would otherwise put the line after the frame
            with tqdm.external_write_mode(file=self.stream):
                self.stream.write(self.format(record) + self.terminator)
                self.flush()
        except Exception:  # logging's contract: a failing handler reports, never raises
            self.handleError(record)


def set_up() -> None:
    """Install the console of the module docstring (the training command calls it once, first)."""
    handler = _ClearOfTheBar(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.showwarning = _shown(warnings.showwarning)


def _shown(python_default):
    def show(message, category, filename, lineno, file=None, line=None):
        if not category.__module__.startswith("megatier."):
            python_default(message, category, filename, lineno, file, line)
        elif is_rank0():
            print(f"{category.__name__}: {message}", file=sys.stderr, flush=True)

    return show
