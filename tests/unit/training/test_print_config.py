"""megatier-train --cfg job, Hydra's flag: the composed config as YAML, nothing trained; other parts refused."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(60)


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / ".venv" / "bin" / "megatier-train"), *args], capture_output=True, text=True,
                          cwd=REPO, timeout=50)


@pytest.mark.parametrize("flag", ["--cfg", "-c"])
def test_cfg_job_prints_the_composed_config(flag, tmp_path):
    proc = _train("model=tiny", flag, "job", "train.iters=7", f"logging.run_dir={tmp_path}/run")
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert (cfg["model"]["name"], cfg["train"]["iters"], cfg["checkpoint"]["enabled"]) == ("tiny", 7, False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args,given", [(["--cfg", "hydra"], "--cfg hydra"), (["model=tiny", "--cfg"], "--cfg")])
def test_another_cfg_part_is_one_line_and_exit_2(args, given):
    proc = _train(*args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"config error: {given} is not supported: --cfg job prints the job's config "
                                   f"(Hydra's own config does not apply to megatier-train)")
