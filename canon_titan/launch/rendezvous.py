"""A multi-node launch's node ranks and rendezvous port, checked before torchrun starts on a node.

Under torchrun's static rendezvous (``--node_rank``, ``--master_addr``, ``--master_port``: what
``scripts/run_train.sh`` runs) a mistake in either shows as a silent wait or a traceback: a node
rank outside ``0 .. nnodes - 1`` makes every node wait until torchrun's 600 s timeout; two nodes
given the same non-zero rank count as two of the nodes awaited, so the job's ranks collide and
every node waits; a port already taken on node 0 (another job's store) is a 45-line
``DistNetworkError``. Each is one line instead (``problem``).
"""

from __future__ import annotations

import errno
import socket
from datetime import timedelta

CLAIM_WAIT = timedelta(seconds=600)
"""How long a node waits for node 0's store to answer (torchrun's static rendezvous timeout)."""


def _this_host(host: str) -> bool:
    """Whether ``host`` names one of this machine's addresses (only those bind)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)}
    except OSError:
        return False
    for address in addresses:
        try:
            with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
                probe.bind((address, 0))
            return True
        except OSError:
            continue
    return False


def port_taken(port: int) -> bool:
    """Whether a process of this machine listens on ``port`` (on any address): a store could not
    be started there. A socket left in TIME_WAIT does not count (the store reuses the address)."""
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((address, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
    return False


def _store_port_problem(host: str, port: int) -> str | None:
    if _this_host(host) and port_taken(port):
        return (
            f"port {port} on {host} (--master_port, MASTER_PORT) is taken by another process, "
            "so the rendezvous store cannot start there: pick a free port "
            "(scripts/run_train.sh: MASTER_PORT=...) for every node"
        )
    return None


def problem(launch, nodes: int) -> str | None:
    """One line naming what would keep a multi-node job of ``nodes`` under the static rendezvous
    from meeting (torchrun's parsed arguments ``launch``), or None: the node rank's range; on node
    0, its port; on another node, that no other node has its rank (a claim in node 0's store, which
    is waited for as torchrun would). c10d's rendezvous (``scripts/train.slurm``) gives the node
    ranks itself, and any agent may host its store."""
    if launch.rdzv_backend != "static":
        return None
    rank, port = launch.node_rank, launch.master_port or 29500  # torchrun's default port
    if not 0 <= rank < nodes:
        return (
            f"node rank {rank} (--node_rank, NODE_RANK) is outside 0 to {nodes - 1} for "
            f"{nodes} nodes (--nnodes, NNODES): give each node its own rank, node 0 the one "
            "at MASTER_ADDR"
        )
    if rank == 0:
        return _store_port_problem(launch.master_addr, port)
    return _claim(launch.master_addr, port, rank)


def claim_key(rank: int) -> str:
    return f"canon-titan/node-rank/{rank}"


def _claim(host: str, port: int, rank: int) -> str | None:
    """Claim node rank ``rank`` in node 0's store for this host; the line naming the host that
    holds it already, if another does."""
    from torch.distributed import DistError, TCPStore

    me = socket.gethostname()
    try:
        store = TCPStore(host, port, is_master=False, timeout=CLAIM_WAIT)
    except DistError:
        return (
            f"node 0 did not answer at {host}:{port} (MASTER_ADDR, MASTER_PORT) within "
            f"{CLAIM_WAIT.seconds} s: start it, or give every node its address and port"
        )
    holder = store.compare_set(claim_key(rank), "", me).decode()
    if holder != me:
        return (
            f"node rank {rank} (--node_rank, NODE_RANK) is taken by {holder}, which joined "
            "first: give each node its own rank from 0 to NNODES - 1"
        )
    return None
