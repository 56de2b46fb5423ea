"""Keeping a private run's revocation list current on one peer: its file and the run's DHT.

The organiser hands the list (dht/revocation.py) to one peer, or to a few; every peer of the
run must learn it. A :class:`RevocationKeeper` does two things, each in a task it owns:

- **The file** (``--revocations FILE``): checked every :attr:`RevocationKeeper.file_interval`
  seconds by its size, mtime and inode, and read again when they change. Why polling: one
  ``stat`` every two seconds costs nothing, needs no inotify (not on every platform, and lost
  when an editor or ``swarmavg run revoke`` replaces the file by a rename, which a new inode
  shows), and reading "on use" would put file I/O on the path of every call. A changed file
  that does not verify is reported and ignored: the peer keeps the list it holds.
- **The DHT**: at start and every :attr:`RevocationKeeper.dht_interval` seconds (30: every peer
  learns a new list within about a minute), it reads :func:`revocation_key` and adopts the
  newest list there that verifies; and while fewer than :attr:`RevocationKeeper.copies`
  other holders keep a copy of the list it holds, it keeps one there too, under its own owner
  subkey, refreshed well before it expires. Storing nodes and readers accept under
  that key only lists signed by the run's authority (``Revocations.key_class``, registered
  by the daemon), and each copy is owner-signed by its holder, so nobody can wipe or replace
  another peer's copy; readers take the highest number, so an older list stored there changes
  nothing.

Adopting a list drops its peers from the routing table and keeps them out of lookups
(``RoutingTable.refuse``); the gRPC interceptor and the data plane read the same set.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import grpc

from swarmavg.dht.credentials import CredentialError, RunFile
from swarmavg.dht.node import DHTNode
from swarmavg.dht.records import owner_suffix
from swarmavg.dht.revocation import (
    RevocationError,
    RevocationList,
    Revocations,
    read_revocations,
    revocation_key,
)

log = logging.getLogger(__name__)

_FileStamp = tuple[int, int, int]  # (inode, size, mtime in ns)


class RevocationKeeper:
    """Keeps ``revocations`` current from the file at ``path`` (if any) and the run's DHT.

    Its owner runs :meth:`run` in a task it owns, once the node joined, and cancels it before
    the node shuts down. Adopting a list (from anywhere) updates the node's routing table.

    Args:
        node: the peer's DHT node (started).
        revocations: the list the peer enforces (its :class:`~swarmavg.dht.tls.PeerTLS`'s).
        run: the run file (the authority the file is checked against).
        path: the ``--revocations`` file; None: the DHT only.
    """

    file_interval = 2.0
    """Seconds between two checks of the file's size, mtime and inode."""
    dht_interval = 30.0
    """Seconds between two reads of the run's revocation key."""
    dht_timeout = 10.0
    """The longest one read or store of the key may take."""
    ttl = 600.0
    """Seconds a stored copy lives; refreshed every ``ttl / 3``."""
    copies = 8
    """A peer adds its copy only while fewer holders than this keep one of the newest list:
    each read of the key returns every copy, so one per peer of a large run would grow the
    answer with the run (and a long list past the DHT's caps). Holders keep refreshing
    theirs; when they leave, their copies expire and the next readers add their own."""

    def __init__(
        self, node: DHTNode, revocations: Revocations, run: RunFile, path: str | None = None
    ) -> None:
        self.node = node
        self.revocations = revocations
        self.run_file = run
        self.path = path
        self._stamp: _FileStamp | None = self._file_stamp()
        self._stored: tuple[int, float] = (0, 0.0)  # (number, when) of our copy in the DHT
        self._copies_seen = 0  # other holders' copies of the held list at the last read
        self._wake = asyncio.Event()
        node.routing.refuse(revocations.revoked)
        revocations.on_change(self._adopted)

    async def run(self) -> None:
        """Watch the file and the DHT until cancelled (both loops are owned here)."""
        async with asyncio.TaskGroup() as group:
            if self.path is not None:
                group.create_task(self._watch_file(), name="revocations-file")
            group.create_task(self._watch_dht(), name="revocations-dht")

    def _adopted(self, revocations: RevocationList) -> None:
        self.node.routing.refuse(revocations.peer_ids)
        self._wake.set()  # pass it on through the DHT now, not at the next tick
        if self.node.identity.peer_id in revocations.peer_ids:
            log.error(
                "this peer's credential was revoked by the organiser of run %s (revocation "
                "list #%d): the run's peers refuse it from now on",
                self.run_file.run_id,
                revocations.number,
            )
        else:
            log.info(
                "revocation list #%d adopted: %d peer(s) of run %s refused",
                revocations.number,
                len(revocations.peer_ids),
                self.run_file.run_id,
            )

    # ---- the file ----

    def _file_stamp(self) -> _FileStamp | None:
        if self.path is None:
            return None
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        return (info.st_ino, info.st_size, info.st_mtime_ns)

    def check_file(self) -> bool:
        """Read the file again if its stamp changed; return whether a list was adopted."""
        stamp = self._file_stamp()
        if stamp is None or stamp == self._stamp or self.path is None:
            return False
        self._stamp = stamp
        try:
            found = read_revocations(self.path, self.run_file)
        except CredentialError as exc:
            log.warning("%s; keeping revocation list #%d", exc, self.revocations.number)
            return False
        adopted = self.revocations.adopt(found)
        if not adopted:
            log.info(
                "revocation list %s is #%d, not newer than the #%d held; ignored",
                self.path,
                found.number,
                self.revocations.number,
            )
        return adopted

    async def _watch_file(self) -> None:
        while True:
            await asyncio.sleep(self.file_interval)
            self.check_file()

    # ---- the DHT ----

    async def sync_dht(self) -> None:
        """Read the run's key and adopt the newest list there; store our copy if it is not
        there yet or is due for a refresh. Failures are logged (the next tick retries)."""
        try:
            async with asyncio.timeout(self.dht_timeout):
                self._adopt_newest(
                    await self.node.get(revocation_key(self.run_file.run_id), latest=True)
                )
                await self._store_copy()
        except (TimeoutError, grpc.aio.AioRpcError, OSError) as exc:
            log.info("revocation list sync through the DHT failed: %r", exc)
        except Exception:  # anything else is a bug, but must not end the keeper's task
            log.warning("revocation list sync through the DHT failed", exc_info=True)

    def _adopt_newest(self, record: Any) -> None:
        entries = record.value if record is not None and isinstance(record.value, dict) else {}
        mine = owner_suffix(self.node.identity.peer_id)
        lists: list[tuple[RevocationList, bool]] = []
        for subkey, entry in entries.items():
            try:
                lists.append((RevocationList.from_value(entry.value), subkey == mine))
            except RevocationError:
                continue  # the key class refuses these; a node of another version may not
        for found, _ in sorted(lists, key=lambda item: -item[0].number):
            if found.number <= self.revocations.number:
                break
            try:
                self.revocations.adopt(found)
                break
            except RevocationError as exc:
                log.warning("a revocation list in the DHT does not verify (%s); ignored", exc)
        held = self.revocations.current
        self._copies_seen = sum(
            1 for found, ours in lists if not ours and held is not None and found == held
        )

    async def _store_copy(self) -> None:
        current = self.revocations.current
        if current is None:
            return
        number, when = self._stored
        now = time.time()
        if number == current.number and now - when < self.ttl / 3:
            return
        if number != current.number and self._copies_seen >= self.copies:
            return  # enough holders keep this list; ours would only grow every read
        stored = await self.node.store(
            revocation_key(self.run_file.run_id),
            current.to_value(),
            now + self.ttl,
            subkey=owner_suffix(self.node.identity.peer_id),
        )
        if stored:
            self._stored = (current.number, now)

    async def _watch_dht(self) -> None:
        while True:
            self._wake.clear()
            await self.sync_dht()
            try:
                async with asyncio.timeout(self.dht_interval):
                    await self._wake.wait()
            except TimeoutError:
                pass
