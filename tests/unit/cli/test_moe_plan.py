"""megatier-inspect --plan for the Mixtral-8x7B preset (issue 51): total and active parameters, per-rank base
and diff sizes, and node memory."""
from megatier.cli.inspect import main as inspect_main


def test_the_mixtral_plan_prints_total_and_active_params_rank_sizes_and_node_memory(capsys):
    assert inspect_main(["--plan", "--nodes", "8", "--procs-per-node", "8", "--", "model=mixtral_8x7b",
                         "parallel.ep=8", "train.global_batch_size=256"]) == 0
    out = capsys.readouterr().out
    assert "(46702.8M parameters, 12879.9M active," in out
    assert "base     diff step" in out and "8.2 GiB  41.8 MiB" in out
    assert "node memory per node" in out and "node7  56-63" in out


def test_the_qwen_moe_plan_counts_the_shared_expert_and_qkv_biases_as_active(capsys):
    # Qwen1.5-MoE-A2.7B: 14.3B parameters, 2.7B active (4 of 60 experts, the shared expert and the biases always)
    assert inspect_main(["--plan", "--nodes", "2", "--procs-per-node", "8", "--", "model=qwen_moe_a2_7b",
                         "parallel.ep=4", "train.global_batch_size=64"]) == 0
    out = capsys.readouterr().out
    assert "(14315.8M parameters, 2689.2M active," in out and "node memory per node" in out
