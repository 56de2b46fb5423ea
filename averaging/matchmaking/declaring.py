"""Declaring: a round's own declaration in the DHT, and its reads of everyone's.

A peer stores its declaration under the round's key (retrying in the background when the
first store misses its deadline: a peer nobody can see can never lead) and reads the
declarations while it looks for a group. What it reads becomes the round's view: the live
declarations of its schema and codec, and every signed one, against which a formed group
is checked.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import grpc

from swarmavg.averaging.matchmaking.base import MatchmakerBase
from swarmavg.averaging.matchmaking.closing import read_back_suffices
from swarmavg.averaging.matchmaking.config import MatchmakingEvent
from swarmavg.averaging.matchmaking.declarations import (
    Declaration,
    declaration_subkey,
    mismatched_schemas,
)
from swarmavg.averaging.matchmaking.round import Round, decode_declarations, has_group_bits

log = logging.getLogger(__name__)


class Declaring(MatchmakerBase):
    """Stores this peer's declarations and reads the others' (one round's view)."""

    async def _store_declaration(self, rnd: Round, budget: float, read_back: bool = False) -> bool:
        """Store our declaration; with ``read_back``, the same lookup reads the key too,
        and the read stands for the round's first read when it passes ``_read_back_stands``."""
        subkey = declaration_subkey(self.peer_id)
        value = rnd.me.encode()
        if self._legacy_join:
            del value["sa"]  # an older peer's declaration has no such field
        args = (rnd.request.key, value, rnd.me.give_up)
        replicas = self.config.declaration_replicas
        try:
            started = time.monotonic()
            async with asyncio.timeout(budget):
                if read_back:
                    ok, record = await self.dht.store_and_get(
                        *args, subkey=subkey, replicas=replicas
                    )
                else:
                    ok = await self.dht.store(*args, subkey=subkey, replicas=replicas)
            self.dht_latency.observe(time.monotonic() - started)
        except (TimeoutError, grpc.aio.AioRpcError) as error:
            log.debug("declaring under %s failed: %r", rnd.request.key, error)
            return False
        if read_back:
            found = decode_declarations(record, rnd.request.key)
            if self._read_back_stands(rnd, found):
                self._apply_declarations(rnd, found, started)
        return ok

    def _read_back_stands(self, rnd: Round, found: list[Declaration]) -> bool:
        """Whether a read made with our store stands for the round's first read (the rule
        is :func:`~swarmavg.averaging.matchmaking.closing.read_back_suffices`)."""
        seen = {
            p
            for p, d in self._current(rnd, found, time.time()).items()
            if d.schema_hash == rnd.me.schema_hash and d.codec == rnd.me.codec
        }
        return read_back_suffices(seen, rnd.previous, rnd.previous_seen, rnd.request.group_size)

    def _current(
        self, rnd: Round, found: list[Declaration], now: float
    ) -> dict[bytes, Declaration]:
        """The declarations of ``found`` that are live at wall time ``now``, ours included.

        A start outside the window is ignored: the earliest start leads, so a
        declaration with start=-1e300 would otherwise lead every round."""
        current = {
            d.peer_id: d
            for d in found
            if d.give_up > now and d.within_window(now, self.config.start_window)
        }
        current[self.peer_id] = rnd.me
        return current

    def _declares_beside(self, rnd: Round) -> bool:
        """Whether the round is a steady state, whose store of our declaration runs beside
        the search rather than before it, and whose leader closes without waiting for a
        read: the family's roster comes from a round of the family and fits one group, so
        its leader is known without the DHT (``Following._roster_leader``) and closes as
        soon as the roster is in (``closing``, ``"quorum"``); every join request carries
        its sender's signed declaration, and the formed group's answer carries them all,
        so nobody's check waits for the DHT either. A first round, a split, or a roster of
        presence entries stores first, as every peer must be visible to the reads that
        decide who leads. A newcomer the roster lacks finds the group closed and is
        expected in the family's next round (``Leading._note_late_asker``).

        Never under Moshpit's group bits: there the roster holds only the companions
        that moved to our bits with us, while members of other groups whose bits came
        out the same declare under our key too; only the read finds them."""
        return (
            not self._legacy_join
            and not has_group_bits(rnd.request.key)
            and rnd.proven_roster
            and bool(rnd.previous)
            and len(rnd.previous | {self.peer_id}) <= rnd.request.group_size
        )

    async def _declare(self, rnd: Round) -> None:
        """Store our declaration; when the store misses its deadline, keep retrying it in
        the background (``rnd.declaring``) while we look for a leader: a peer nobody can
        see can never lead, and when every peer's first store failed, nobody would."""
        budget = self._dht_budget(0, rnd.request.give_up_by)
        if not await self._store_declaration(rnd, budget, read_back=bool(rnd.previous_seen)):
            log.info(
                "declaration of %s under %s not stored yet; retrying while joining others",
                self.peer_id.hex()[:12],
                rnd.request.key,
            )
            rnd.declaring = asyncio.ensure_future(self._keep_declaring(rnd))
        self._notify(MatchmakingEvent.DECLARED, rnd.request.key, self.peer_id)

    async def _keep_declaring(self, rnd: Round) -> None:
        failures = 1
        while time.monotonic() < rnd.request.give_up_by and not rnd.closed:
            # jittered, so that a swarm's retries do not arrive as one burst again
            await asyncio.sleep(self.config.retry_after * random.uniform(0.5, 1.5))
            budget = self._dht_budget(failures, rnd.request.give_up_by)
            if await self._store_declaration(rnd, budget):
                log.info(
                    "declaration of %s under %s stored at try %d, %.1fs after the start",
                    self.peer_id.hex()[:12],
                    rnd.request.key,
                    failures + 1,
                    time.monotonic() - rnd.started,
                )
                return
            failures += 1
        if not rnd.closed:
            log.warning(
                "declaration of %s under %s was never stored; only joined others",
                self.peer_id.hex()[:12],
                rnd.request.key,
            )

    async def _read_declarations(
        self, key: str, give_up_by: float, failures: int = 0
    ) -> list[Declaration] | None:
        """The declarations under ``key``, read within ``give_up_by`` (``time.monotonic()``);
        ``None`` when the read failed (not: nobody)."""
        budget = self._dht_budget(failures, give_up_by)
        try:
            started = time.monotonic()
            async with asyncio.timeout(budget):
                record = await self.dht.get(key, latest=True, quorum=self.config.read_quorum)
            self.dht_latency.observe(time.monotonic() - started)
        except (TimeoutError, grpc.aio.AioRpcError) as error:
            log.debug("reading declarations under %s failed: %r", key, error)
            return None
        return decode_declarations(record, key)

    async def _refresh_declarations(self, rnd: Round) -> None:
        """Read the declarations under our key; keep the live ones of our schema."""
        started = time.monotonic()
        rnd.reads += 1
        found = await self._read_declarations(
            rnd.request.key, rnd.request.give_up_by, rnd.read_failures
        )
        if found is None:
            rnd.read_failures += 1
            return  # keep what we knew: a failed read must not look like an empty key
        rnd.read_failures = 0
        self._apply_declarations(rnd, found, started)

    async def _refresh_once(self, rnd: Round) -> None:
        """Read the declarations, sharing one read among everyone who needs it now."""
        if rnd.reading is None or rnd.reading.done():
            rnd.reading = asyncio.ensure_future(self._refresh_declarations(rnd))
        await asyncio.shield(rnd.reading)

    def _apply_declarations(self, rnd: Round, found: list[Declaration], started: float) -> None:
        """Take a read of the declarations that began at ``started`` as the round's view."""
        now_wall = time.time()
        # Remembered across reads: a later read may fail or miss them.
        for other in mismatched_schemas(found, rnd.me):
            rnd.mismatched[other.peer_id] = other.schema_hash
        signed = self._current(rnd, found, now_wall)
        rnd.signed = signed
        for other in signed.values():
            if other.peer_id != self.peer_id:
                self.note_answer_signer(other.peer_id, other.signs_answers)
        for other in signed.values():
            if other.schema_hash == rnd.me.schema_hash and other.codec != rnd.me.codec:
                rnd.other_codecs[other.peer_id] = other.codec
        live = {
            p: d
            for p, d in signed.items()
            if d.schema_hash == rnd.me.schema_hash and d.codec == rnd.me.codec
        }
        for peer_id in live:
            rnd.first_seen.setdefault(peer_id, started)
        rnd.declarations = tuple(live.values())
        rnd.last_read = started

    def _read_interval(self, rnd: Round) -> float:
        """Seconds until the next read of the declarations.

        A peer still alone reads again soon (one settle time, doubling up to
        ``poll_interval``): it may have read before an earlier peer's declaration was
        visible, and would otherwise sit as a leader nobody joins while its peers wait for
        it. Once it has company, or follows someone, it polls at ``poll_interval``; the
        doubling bounds the load a large swarm puts on the DHT.
        """
        if rnd.leader is not None or rnd.followers:
            rnd.lonely_reads = 0
            return self.config.poll_interval
        interval = min(self.config.poll_interval, self.settle_time() * 2.0**rnd.lonely_reads)
        rnd.lonely_reads += 1
        return interval
