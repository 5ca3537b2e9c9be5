"""megatier-plot draws a mixture of experts' router figure (issue 51, metrics item 5) and skips it, with the
reason, for a dense run."""
import json
import os

from megatier.observe.plot import moe_router_figure, write_plots
from megatier.observe.run_history import RunHistory

ROUTER = {"moe_aux_loss": 0.02, "moe_z_loss": 0.001, "moe_tokens_per_expert_min": 200,
          "moe_tokens_per_expert_max": 312, "moe_dropped_tokens": 0}


def _run(tmp_path, moe: bool) -> str:
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({"step": s, "loss": 5.0 - 0.1 * s, "iter_time_s": 0.05, **(ROUTER if moe else {})})
                     + "\n" for s in range(1, 6))
    return str(tmp_path)


def test_a_moe_run_gets_the_router_figure_with_every_router_metric(tmp_path):
    run = _run(tmp_path, moe=True)
    labels = {line.get_label() for ax in moe_router_figure(RunHistory.read(run)).axes for line in ax.lines}
    assert labels == {"moe_aux_loss", "moe_z_loss", "tokens per expert (min)", "tokens per expert (max)",
                      "dropped tokens"}
    written = {os.path.basename(p) for p in write_plots(run).written}
    assert "moe_router.png" in written and (tmp_path / "moe_router.png").stat().st_size > 0


def test_a_dense_run_skips_the_router_figure_saying_why(tmp_path):
    result = write_plots(_run(tmp_path, moe=False))
    assert "moe_aux_loss" in result.skipped["moe_router.png"]
    assert not any(p.endswith("moe_router.png") for p in result.written)
