"""A simulated multi-node cluster on one host: one torchrun agent per node (``megatier-launch``, the drills).

Agent i runs ``python -m megatier.cli.run --nnodes N --nproc-per-node M`` (torchrun's agent)
with a c10d rendezvous on 127.0.0.1 at a free port and MEGATIER_NODE_NAME=node{i},
so its processes believe they share node{i} (and its node memory). The c10d
rendezvous is what lets a failure drill kill one agent (a node failure) while
the others re-rendezvous.

Global ranks are handed to agents by the rendezvous, so node{i} need not hold
ranks i*M..; ParallelState orders nodes by name, which is what the ring uses.

Once one agent fails, the others get ``fail_grace_s`` seconds to finish before
they are stopped, so a job whose peer died cannot hang on a rendezvous or
collective. The exit status is the worst of the agents' (a signal death counts
as 128 + signal; in process, an agent killed by a signal is a lost node and only
counts when no agent ran to its end).

With ``recovery="inprocess"`` each node runs ``megatier-agent`` instead
(:mod:`megatier.launcher.agent`): ranks are node-major, a failed process is
reported to the membership store (served by this process, so no node failure
takes it down) and its node's other processes keep running; ``spares_per_node``
idle spares wait on every node and ``spare_nodes`` more nodes hold only spares.
An agent that fails then stops nobody: the survivors re-form the job.
"""
from __future__ import annotations

import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

from megatier.launcher.agent import exit_status, serve_store
from megatier.launcher.watchdog import StoppedWatch


def _ephemeral_floor(default: int = 32768) -> int:
    """The lowest port the kernel hands out to bind(0) and to outgoing connections (Linux; ``default`` elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port(span: int = 12000) -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, drawn from just below the ephemeral range.

    A port from bind(0) lies in the ephemeral range, where the kernel may give it to any outgoing connection
    (gloo opens many) before the agent listens on it: the rendezvous then fails with EADDRINUSE. Below that
    range only another listener can take it.
    """
    floor = _ephemeral_floor()
    low = max(1024, floor - span)
    candidates = list(range(low, floor)) if floor > low else []
    random.SystemRandom().shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(script_args: list[str], *, nodes: int, procs_per_node: int, node_rank: int, port: int,
                  run_id: str, max_restarts: int) -> list[str]:
    """The torchrun command line of simulated node ``node_rank`` (``megatier-run``: torchrun's agent, ending
    with its workers' exit status rather than torchrun's 1)."""
    return [
        sys.executable, "-m", "megatier.cli.run",
        "--nnodes", str(nodes), "--nproc-per-node", str(procs_per_node),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
        # Exactly one agent hosts the rendezvous store; the others are clients of it.
        "--rdzv-conf", f"is_host={'true' if node_rank == 0 else 'false'}",
        "--local-addr", "127.0.0.1", "--max-restarts", str(max_restarts),
        *script_args,
    ]


def inprocess_agent_command(script_args: list[str], *, nodes: int, procs_per_node: int, spares: int, node_rank: int,
                            store: str, run_id: str, respawn: bool = False,
                            hang_timeout_s: Optional[float] = None) -> list[str]:
    """The ``megatier-agent`` command line of simulated node ``node_rank`` (a node of spares when it is past the
    ``nodes`` that run ranks); ``hang_timeout_s`` None keeps the agent's default."""
    ranks = procs_per_node if node_rank < nodes else 0
    return [sys.executable, "-m", "megatier.cli.agent", "--nodes", str(nodes), "--node-rank", str(node_rank),
            "--nproc-per-node", str(ranks), "--spares-per-node", str(spares), "--store", store, "--run-id", run_id,
            *(["--respawn"] if respawn else []),
            *(["--hang-timeout-s", f"{hang_timeout_s:g}"] if hang_timeout_s is not None else []), "--", *script_args]


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc; empty elsewhere)."""
    out = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # pid (comm) state ppid ...; comm may hold spaces, so split after the last ')'.
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            out.append(int(entry))
    return out


def _file_limit(size: int):
    """A preexec function: files larger than ``size`` cannot be written (EFBIG instead of the default SIGXFSZ
    kill), which the checkpoint tiers see as a full disk."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return apply


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class LocalCluster:
    """N torchrun agents on this host, each in its own session so signals reach it only through us."""

    def __init__(self, nodes: int, procs_per_node: int, script_args: list[str], *, port: Optional[int] = None,
                 max_restarts: int = 0, node_env: Optional[dict[int, dict[str, str]]] = None,
                 node_file_limit: Optional[dict[int, int]] = None, recovery: str = "relaunch",
                 spares_per_node: int = 0, spare_nodes: int = 0, respawn: bool = False,
                 hang_timeout_s: Optional[float] = None):
        if nodes < 1 or procs_per_node < 1:
            raise ValueError(f"--nodes {nodes} and --procs-per-node {procs_per_node} must be >= 1")
        if not script_args:
            raise ValueError("nothing to run: put the training script and its overrides after --")
        self.nodes, self.procs_per_node = nodes, procs_per_node
        self.script_args = script_args
        self.port = port or free_port()
        self.run_id = f"megatier-{os.getpid()}-{self.port}"
        self.max_restarts = max_restarts
        self.node_env = node_env or {}  # extra environment of node i's agent and workers (fault drills)
        # Largest file node i's processes may write, in bytes: a full disk for drills (writes fail with EFBIG).
        self.node_file_limit = node_file_limit or {}
        self.agents: list[subprocess.Popen] = []
        self.inprocess = recovery == "inprocess"
        self.spares_per_node, self.spare_nodes = spares_per_node, spare_nodes
        if not self.inprocess and (spares_per_node or spare_nodes or respawn or hang_timeout_s is not None):
            raise ValueError("hot spares, --respawn and --hang-timeout-s need --recovery inprocess (torchrun's agent "
                             "restarts every process)")
        self.respawn = respawn  # agents start a new spare in place of each failed process
        if hang_timeout_s is not None:
            StoppedWatch(hang_timeout_s)  # refused here, in one line, rather than by every agent it starts
        self.hang_timeout_s = hang_timeout_s  # agents kill a process stopped this long (None: their default)
        self.store = None  # in-process recovery's membership store, served here
        self.stopping = False  # a Ctrl-C or SIGTERM was forwarded to every agent

    def _command(self, i: int) -> list[str]:
        if not self.inprocess:
            return agent_command(self.script_args, nodes=self.nodes, procs_per_node=self.procs_per_node, node_rank=i,
                                 port=self.port, run_id=self.run_id, max_restarts=self.max_restarts)
        spares = self.spares_per_node if i < self.nodes else self.procs_per_node
        return inprocess_agent_command(self.script_args, nodes=self.nodes, procs_per_node=self.procs_per_node,
                                       spares=spares, node_rank=i, store=f"127.0.0.1:{self.store.port}",
                                       run_id=self.run_id, respawn=self.respawn, hang_timeout_s=self.hang_timeout_s)

    def start(self) -> None:
        if self.inprocess:
            self.store = serve_store(self.port)
        for _ in range(self.nodes + self.spare_nodes):
            self.add_node()

    def add_node(self) -> int:
        """Start the next simulated node's agent (past the first ``nodes``, a node of spares: a machine that
        joins a running in-process job, as a replacement for a lost one); its index."""
        i = len(self.agents)
        env = dict(os.environ, **self.node_env.get(i, {}), MEGATIER_NODE_NAME=f"node{i}")
        limit = self.node_file_limit.get(i)
        self.agents.append(subprocess.Popen(self._command(i), env=env, start_new_session=True,
                                            preexec_fn=None if limit is None else _file_limit(limit)))
        return i

    def workers(self, node: int) -> list[int]:
        """The training processes of simulated node ``node`` (children of its agent)."""
        return _children(self.agents[node].pid)

    def wait(self, *, fail_grace_s: float, poll_s: float = 0.2, timeout_s: Optional[float] = None) -> int:
        """Wait for every agent; returns the worst exit status (124 if ``timeout_s`` ran out first)."""
        failed_at = None
        deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        while True:
            codes = [a.poll() for a in self.agents]
            if all(c is not None for c in codes):
                return self._status(codes)
            if deadline is not None and time.monotonic() > deadline:
                print(f"launch_local_cluster: still running after {timeout_s:.0f}s; stopping every node",
                      file=sys.stderr)
                self.stop()
                return 124
            # After a forwarded stop the agents end with 130 or 143 as their drains finish: not a failure to cut short.
            if failed_at is None and any(c not in (None, 0) for c in codes) and not (self.inprocess or self.stopping):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > fail_grace_s:
                print(f"launch_local_cluster: an agent failed; stopping the rest after {fail_grace_s:.0f}s",
                      file=sys.stderr)
                self.stop()
            time.sleep(poll_s)

    def _status(self, codes: list[int]) -> int:
        """The launch's exit status: the worst agent's. In process, an agent killed by a signal is a lost node
        whose ranks the others' rounds took over, so the job's status is what the agents that ran to their end
        say (each counts a process a later round replaced as recovered); only if none did, the worst."""
        if self.inprocess:
            codes = [c for c in codes if c >= 0] or codes
        return max(exit_status(c) for c in codes)

    def forward(self, sig: signal.Signals) -> None:
        """Send ``sig`` to every live agent, which passes it on to its workers: the job's own clean stop on SIGINT
        or SIGTERM (the workers finish their step and drain), where :meth:`stop` ends it from outside."""
        self.stopping = True
        for a in self.agents:
            if a.poll() is None:
                _signal_group(a.pid, sig)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every agent (torchrun then stops its workers); SIGKILL whatever is left after ``grace_s``."""
        live = [a for a in self.agents if a.poll() is None]
        # Workers run in sessions of their own: remember them now, while their agent can still be asked.
        workers = [w for a in live for w in _children(a.pid)]
        for a in live:
            _signal_group(a.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(a.poll() is None for a in live):
            time.sleep(0.1)
        for pid in [a.pid for a in live] + workers:
            _signal_group(pid, signal.SIGKILL)
        for a in live:
            a.wait()
