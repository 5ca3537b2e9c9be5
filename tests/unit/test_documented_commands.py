"""The commands README.md and docs/ show, so a documented command cannot rot.

Every training command in a ```bash block is composed and validated against the world size its launcher
gives (the layout and batch-size checks a launch makes first). The blocks marked ``<!-- runnable: OVERRIDES -->``
on the line before their fence are also run, each training command with OVERRIDES added (to keep it small) and
its directories moved under a temporary one, and must train to the end.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from typing import Optional

import pytest

from megatier.config import compose_config, validate
from tests.conftest import REPO

DOCUMENTS = ["README.md", *sorted(f"docs/{n}" for n in os.listdir(REPO / "docs") if n.endswith(".md"))]
_BLOCK = re.compile(r"(?:<!-- runnable: (?P<small>[^>]*?) -->\n)?```bash\n(?P<body>.*?)```", re.S)
# The options of each launcher that multiply into the world size, and whether the job follows "--".
_WORLD = {"megatier-run": ("--nnodes", "--nproc-per-node"), "megatier-launch": ("--nodes", "--procs-per-node"),
          "megatier-drill": ("--nodes", "--procs-per-node"), "megatier-inspect": ("--nodes", "--procs-per-node")}


@dataclass(frozen=True)
class Command:
    where: str  # file:line of the block
    text: str
    small: Optional[str]  # the runnable marker's overrides; None: not run

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def tool(self) -> str:
        argv = self.argv
        return "megatier-train" if argv[0].endswith("python") and argv[1:2] == ["pretrain_gpt.py"] \
            else os.path.basename(argv[0])


def _commands_of(body: str) -> list[str]:
    """A block's commands: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", "", body)
    lines = (line.split(" #")[0].strip() for line in joined.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def documented_commands() -> list[Command]:
    found = []
    for doc in DOCUMENTS:
        text = (REPO / doc).read_text()
        for block in _BLOCK.finditer(text):
            where = f"{doc}:{text[:block.start('body')].count(chr(10))}"
            found += [Command(where, c, block["small"]) for c in _commands_of(block["body"])]
    return found


def _option(argv: list[str], name: str) -> int:
    return int(argv[argv.index(name) + 1]) if name in argv else 1


def job_of(command: Command) -> Optional[tuple[list[str], int]]:
    """(the job's Hydra overrides, its world size) for a command that trains or plans a job; None otherwise."""
    argv, tool = command.argv, command.tool
    if tool == "megatier-train":
        return argv[2 if argv[1:2] == ["pretrain_gpt.py"] else 1:], 1
    if tool not in _WORLD or (tool == "megatier-inspect" and "--plan" not in argv):
        return None
    world = _option(argv, _WORLD[tool][0]) * _option(argv, _WORLD[tool][1])
    if tool == "megatier-run":
        return argv[argv.index("megatier.train") + 1:], world
    job = argv[argv.index("--") + 1:]
    if tool == "megatier-launch":  # the script, or -m module, before the overrides
        job = job[2:] if job[0] == "-m" else job[1:]
    return job, world


COMMANDS = documented_commands()
JOBS = [c for c in COMMANDS if job_of(c) is not None]


def test_the_documents_show_training_commands_and_runnable_blocks():
    assert len(JOBS) >= 15, [c.text for c in JOBS]
    assert any("--recovery inprocess" in c.text for c in COMMANDS if c.small is not None)


@pytest.mark.parametrize("command", JOBS, ids=[c.where for c in JOBS])
def test_every_documented_job_fits_its_world_size(command):
    overrides, world = job_of(command)
    # The reader's own data and checkpoints, not here.
    ours = [o for o in overrides if not o.startswith(("data.prefix=", "model.init_from="))]
    validate(compose_config(ours), world)


def _isolated(command: Command, tmp_path) -> list[str]:
    """The command with the marker's overrides, and every directory it writes moved under ``tmp_path``."""
    argv = command.argv
    if job_of(command) is None:
        return argv
    ours = [f"logging.run_dir={tmp_path}/run", "logging.wandb.mode=disabled", "logging.progress=false",
            f"checkpoint.local.root={tmp_path}/shm", f"checkpoint.remote.url={tmp_path}/remote"]
    return [*argv, *shlex.split(command.small), *ours]


RUNNABLE = [c for c in COMMANDS if c.small is not None]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("command", RUNNABLE, ids=[c.where for c in RUNNABLE])
def test_a_runnable_documented_command_runs(command, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "MEGATIER_NODE_NAME", "GROUP_RANK")}
    env.update(OMP_NUM_THREADS="1")
    proc = subprocess.run(_isolated(command, tmp_path), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=230)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    if job_of(command) is not None:
        iters = dict(o.split("=", 1) for o in shlex.split(command.small))["train.iters"]
        assert re.search(rf"^done: step {iters} loss ", proc.stdout, re.M), proc.stdout[-2000:]
