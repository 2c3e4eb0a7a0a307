"""Heartbeats between the launchers of a multi-node job, so a lost node is named and the others stop.

[Note: naming a lost node]
When a node dies, the other nodes' workers fail on their next collective (gloo: connection closed) or
hang in it (NCCL), and torchrun's own report names only local ranks. So every launcher of a multi-node
job beats into a small TCPStore that node 0's launcher hosts at the rendezvous port + 1 (not torchrun's:
it must outlive the local torchrun, which exits with its workers). A peer whose counter has not moved
for `lost_after_s` (measured on the watcher's own clock: no clock sync needed), or node 0 when its store
stops answering, is lost, but only once it was seen: a node that starts late is torchrun's join timeout's
business. A launcher that ends writes its exit code first, so a peer that finished or failed on its own
is never called lost. Without restarts the launcher stops its workers and exits naming the lost node;
with --max_restarts it logs the loss and leaves the re-rendezvous to torchrun.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)
PREFIX = "zeroshard_nodes"


@dataclass
class _Peer:
    beat: str = ""
    changed_at: float = field(default_factory=time.monotonic)
    host: str = "?"
    exited: bool = False


class NodeWatch:
    """Beat for this node and watch the others; `lost()` names the first node found lost."""

    def __init__(
        self, master_addr: str, port: int, node_rank: int, nnodes: int, interval_s: float = 1.0,
        lost_after_s: float = 15.0,
    ) -> None:  # fmt: skip
        self.addr, self.port, self.rank, self.nnodes = master_addr, port, node_rank, nnodes
        self.interval_s, self.lost_after_s = interval_s, lost_after_s
        self._peers = {r: _Peer() for r in range(nnodes) if r != node_rank}
        self._lost: str | None = None
        self._stop = threading.Event()
        self._store: dist.TCPStore | None = None
        self._store_failing_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="zeroshard-node-watch", daemon=True)

    def start(self) -> NodeWatch:
        self._thread.start()
        return self

    def lost(self) -> str | None:
        """'node R (HOST): no heartbeat for N s', or None while every node is alive or ended on its own."""
        return self._lost

    def forget(self) -> None:
        """After a loss under --max_restarts: start watching afresh for the restarted node."""
        now = time.monotonic()
        for peer in self._peers.values():
            peer.changed_at = now
        self._lost = None

    def wait_verdict(self, timeout_s: float) -> str | None:
        """After the local workers failed: wait until every peer beat again or ended, or one is lost."""
        deadline, since = time.monotonic() + timeout_s, time.monotonic()
        while time.monotonic() < deadline and self._lost is None:
            if all(p.exited or p.changed_at > since for p in self._peers.values()):
                return None
            time.sleep(self.interval_s / 2)
        return self._lost

    def stop(self, exit_code: int, linger_s: float = 10.0) -> None:
        """Write this node's exit code; node 0 keeps its store up until every peer ended (or `linger_s`)."""
        store = self._store
        if store is not None:
            try:
                store.set(f"{PREFIX}/exit/{self.rank}", str(exit_code))
            except (RuntimeError, dist.DistStoreError):
                pass
        if self.rank == 0:
            deadline = time.monotonic() + linger_s
            while time.monotonic() < deadline and not all(p.exited for p in self._peers.values()):
                time.sleep(self.interval_s / 2)
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        count = 0
        while not self._stop.wait(0 if count == 0 else self.interval_s):
            count += 1
            try:
                store = self._connect()
                store.set(f"{PREFIX}/beat/{self.rank}", str(count))
                if count == 1:
                    store.set(f"{PREFIX}/host/{self.rank}", socket.gethostname())
                self._read_peers(store)
                self._store_failing_since = None
            except (RuntimeError, dist.DistStoreError, TimeoutError):
                self._store = None
                self._store_failing_since = self._store_failing_since or time.monotonic()
                if time.monotonic() - self._store_failing_since > self.lost_after_s and self._lost is None:
                    # before the first contact node 0 may just start late (torchrun's join timeout covers that)
                    if self.rank != 0 and self._peers[0].beat and not self._peers[0].exited:
                        self._lost = f"node 0 ({self._peers[0].host}, {self.addr}): its launcher stopped answering"
            self._judge()

    def _connect(self) -> dist.TCPStore:
        if self._store is None:
            if self.rank != 0:  # a plain probe first: a failed TCPStore connect logs a C++ stack trace
                try:
                    socket.create_connection((self.addr, self.port), timeout=self.interval_s).close()
                except OSError as err:
                    raise RuntimeError(f"node 0's heartbeat store at {self.addr}:{self.port}: {err}") from None
            self._store = dist.TCPStore(
                self.addr,
                self.port,
                is_master=self.rank == 0,
                timeout=datetime.timedelta(seconds=max(2.0, 2 * self.interval_s)),
                wait_for_workers=False,
                multi_tenant=True,
            )
        return self._store

    def _read_peers(self, store: dist.TCPStore) -> None:
        for rank, peer in self._peers.items():
            keys = [f"{PREFIX}/beat/{rank}", f"{PREFIX}/host/{rank}", f"{PREFIX}/exit/{rank}"]
            if store.check(keys[2:]):
                peer.exited = True
            if store.check(keys[1:2]) and peer.host == "?":
                peer.host = store.get(keys[1]).decode()
            beat = store.get(keys[0]).decode() if store.check(keys[:1]) else ""
            if beat != peer.beat:
                peer.beat, peer.changed_at = beat, time.monotonic()

    def _judge(self) -> None:
        if self._lost is not None:
            return
        now = time.monotonic()
        for rank, peer in self._peers.items():
            silent = now - peer.changed_at
            if peer.beat and not peer.exited and silent > self.lost_after_s:
                self._lost = f"node {rank} ({peer.host}): no heartbeat for {silent:.0f} s"
                return
