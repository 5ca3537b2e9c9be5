"""The simulated cluster's rendezvous port and its agents' command lines."""
import socket

import pytest

from megatier.drill import cluster


def test_free_port_lies_below_the_ephemeral_range_and_can_be_bound():
    floor = cluster._ephemeral_floor()
    ports = {cluster.free_port() for _ in range(20)}
    for port in ports:
        assert 1024 <= port < floor
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
    assert len(ports) > 1, "ports are drawn at random, so two tests beside each other rarely share one"


def test_free_port_skips_a_port_someone_listens_on(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        # A range of exactly one port, and that one taken: the fallback asks the kernel.
        monkeypatch.setattr(cluster, "_ephemeral_floor", lambda: busy + 1)
        assert cluster.free_port(span=1) != busy


def test_agent_command_hosts_the_rendezvous_on_node_0_only():
    host = cluster.agent_command(["train.py"], nodes=2, procs_per_node=1, node_rank=0, port=23456, run_id="r",
                                 max_restarts=0)
    client = cluster.agent_command(["train.py"], nodes=2, procs_per_node=1, node_rank=1, port=23456, run_id="r",
                                   max_restarts=0)
    assert "127.0.0.1:23456" in host and "is_host=true" in host and "is_host=false" in client
    assert host[-1] == "train.py"


def test_the_hang_timeout_reaches_the_in_process_agents_and_needs_them():
    command = cluster.inprocess_agent_command(["train.py"], nodes=2, procs_per_node=1, spares=1, node_rank=0,
                                              store="127.0.0.1:1", run_id="r", hang_timeout_s=4.5)
    assert command[command.index("--hang-timeout-s") + 1] == "4.5" and command[-1] == "train.py"
    default = cluster.inprocess_agent_command(["train.py"], nodes=2, procs_per_node=1, spares=1, node_rank=0,
                                              store="127.0.0.1:1", run_id="r")
    assert "--hang-timeout-s" not in default  # the agent's own default
    with pytest.raises(ValueError, match="--hang-timeout-s need --recovery inprocess"):
        cluster.LocalCluster(2, 1, ["train.py"], hang_timeout_s=5.0)


def test_a_negative_hang_timeout_is_refused_once_by_the_launch_and_by_the_agent(capsys):
    with pytest.raises(ValueError, match="--hang-timeout-s -1 must be >= 0"):
        cluster.LocalCluster(2, 1, ["train.py"], recovery="inprocess", hang_timeout_s=-1.0)
    from megatier.cli import agent
    assert agent.main(["--store", "127.0.0.1:1", "--hang-timeout-s", "-1", "--", "train.py"]) == 2
    assert capsys.readouterr().err.strip() == ("megatier-agent: --hang-timeout-s -1 must be >= 0 (0 turns the hang "
                                                "watchdog off)")
