"""State sharing: publish tensors for late joiners; download them from several donors.

A peer that publishes its state advertises ``(root, version, size, address)`` in the DHT
under ``{run}.state`` (one subkey per donor, refreshed while it holds the state). A joiner
(:meth:`StateSharer.load`) picks the root held by the most donors, the fresher of equally
held ones as far as other donors vouch for its version
(:func:`~swarmavg.averaging.state.adverts.choose_donors`: one advert's claimed version
never wins by itself), fetches the manifest from one donor holding it and checks
it against the advertised root, then downloads the chunks it lacks from every donor
holding that root at once: each donor serves small batches pulled from a
shared queue, so fast donors serve more, and a donor that fails (error, timeout, a chunk
whose sha256 is wrong) hands its unfinished batch back to the others. Chunks are
content-addressed (:mod:`swarmavg.averaging.state.format`), so a peer that holds an older
version fetches only the chunks that changed. hivemind sends every newcomer to one donor
(learning-at-home/hivemind#169); here the load spreads over all donors of the chosen root.

Peers republish every few steps, so a download must survive donors that move on while it
runs. A donor keeps serving its superseded versions for a bounded grace
(:mod:`swarmavg.averaging.state.store`: the last ``retain_versions``, each for
``retain_seconds`` after its last use). When every donor of the version being downloaded
has dropped it anyway, the joiner reads the DHT again and moves on to the best-ranked root
not yet tried, keeping every chunk it already verified (content addressing makes them valid
for any version that contains them). The result is always exactly one manifest's chunks,
each sha256-verified: never a mix of two versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from swarmavg.averaging.dht_access import DHTAccess, dictionary_entries
from swarmavg.averaging.errors import StateDownloadError, StateNotFoundError
from swarmavg.averaging.gauge import Gauge
from swarmavg.averaging.stalled import abort_stalled
from swarmavg.averaging.state.adverts import Advertisement, choose_donors, parse_advertisement
from swarmavg.averaging.state.config import MAX_CHUNKS_PER_REQUEST, DonorFaults, StateSharingConfig
from swarmavg.averaging.state.format import (
    HASH_BYTES,
    Manifest,
    StateFormatError,
    chunk_hash,
    pack_state,
    unpack_state,
)
from swarmavg.averaging.state.slots import UploadSlots
from swarmavg.averaging.state.store import StateStore
from swarmavg.averaging.stubs import DOWNLOAD_STATE, download_state_method
from swarmavg.averaging.transfer_progress import TransferProgress, format_bytes
from swarmavg.dht.auth import AuthenticationError, message_digest
from swarmavg.dht.channels import ChannelPool
from swarmavg.dht.identity import HeaderError
from swarmavg.dht.ranges import grpc_peer_host, limited_range
from swarmavg.dht.records import owner_suffix
from swarmavg.proto import averaging_pb2

log = logging.getLogger(__name__)


class _DonorFailed(Exception):
    pass


class _DonorBusy(_DonorFailed):
    """The donor serves ``max_uploads`` downloads already: try again shortly."""


_BUSY_RETRY = (0.2, 2.0)  # first and largest pause before asking a busy donor again


def _busy_pause(attempt: int) -> float:
    """Capped, jittered backoff before asking busy donors again."""
    first, cap = _BUSY_RETRY
    return random.uniform(0.5, 1.0) * min(cap, first * 2.0**attempt)


class StateSharer:
    """Publishes this peer's state and downloads others'. Create inside the running loop."""

    def __init__(
        self,
        dht: DHTAccess,
        run_id: str,
        address: str | None,
        channels: ChannelPool,
        config: StateSharingConfig | None = None,
        faults: DonorFaults | None = None,
    ) -> None:
        self.dht = dht
        self.run_id = run_id
        self.address = address or ""
        self.channels = channels
        self.config = config or StateSharingConfig()
        self.faults = faults
        self.key = f"{run_id}.state"
        self.store = StateStore(self.config.retain_versions, self.config.retain_seconds)
        """The published state and the superseded versions still served."""
        self._held: dict[bytes, bytes] = {}
        self.uploads = Gauge()
        """Download streams this donor is serving now (at most ``max_uploads``)."""
        self.slots = UploadSlots(self.config.max_uploads)
        """Who holds those streams: at most 2 per requesting identity and half of them per
        address range (:mod:`~swarmavg.averaging.state.slots`)."""
        self.served_chunks = 0
        """Chunks this peer has served to others (a counter for status and tests)."""
        self.downloaded_chunks = 0
        """Chunks this peer has downloaded from others."""
        self.uploads_cut = Gauge()
        """Uploads cut because their joiner did not keep up (a write or the stream ran
        past its deadline)."""
        self.progress: TransferProgress | None = None
        """The newest download (bytes, rate, ETA); None before the first."""
        self.load_switches = 0
        """Times a load moved on to another advertised version because every donor of the
        one it was downloading failed or no longer held it."""
        self._refresher: asyncio.Task[None] | None = None
        self._advertised = False
        """An advertisement of this peer's state was stored (later ones go in the background)."""
        self._advertiser: asyncio.Task[None] | None = None
        self._advert_due = False
        self._prune_timer: asyncio.TimerHandle | None = None

    @property
    def published(self) -> Manifest | None:
        """Manifest of the state this peer serves, if any."""
        return self.store.current

    async def publish(
        self, tensors: Sequence[np.ndarray], metadata: bytes, version: float | None = None
    ) -> Manifest:
        """Serve ``(metadata, tensors)`` from now on and advertise it in the DHT: the first
        state before returning, a later one in the background (joiners meanwhile find the
        version before it, served through the grace below).

        The tensors are copied into chunks at once; later changes to the arrays do not
        affect what is served. The previous version stays servable for the grace of
        ``retain_versions`` / ``retain_seconds`` so that downloads of it can finish.
        Client-mode peers (no address) keep the state for incremental downloads but cannot
        serve it, so they do not advertise.

        Raises:
            ValueError: unsupported dtype or a state over the format's limits.
        """
        version = time.time() if version is None else version
        packed = await asyncio.to_thread(
            pack_state, tensors, bytes(metadata), version, self.config.chunk_size
        )
        self.store.publish(packed)
        self._held = {}  # superseded by what we publish; the store serves reuse from now on
        self._schedule_prune()
        if self.address:
            retains = self.config.retain_versions > 0 and self.config.retain_seconds > 0
            if self._advertised and retains:
                # Joiners find this peer through its last advertisement, and the version it
                # names stays servable through the retain grace: the new one goes out in
                # the background, instead of holding the publisher for a round trip to the
                # DHT (on a long link, one RTT of every step that publishes).
                self._advertise_soon()
            else:
                self._advertised = await self._advertise()
            if self._refresher is None:
                self._refresher = asyncio.get_running_loop().create_task(self._refresh())
        return packed.manifest

    def _advertise_soon(self) -> None:
        """Advertise the current state from the advertiser task: one store at a time, the
        newest state's last (a publish during a store is advertised right after it)."""
        self._advert_due = True
        if self._advertiser is None or self._advertiser.done():
            self._advertiser = asyncio.get_running_loop().create_task(self._advertise_due())

    async def settle_advertisement(self) -> None:
        """Wait until the current state's advertisement was stored (or failed, logged)."""
        while self._advertiser is not None and not self._advertiser.done():
            await asyncio.wait({self._advertiser})

    async def _advertise_due(self) -> None:
        while self._advert_due:
            self._advert_due = False
            try:
                await self._advertise()
            except Exception:  # the refresher advertises again later
                log.exception("advertising the published state failed")

    def _schedule_prune(self) -> None:
        """Free retired versions when their grace ends, even if nobody asks again."""
        if self._prune_timer is not None:
            self._prune_timer.cancel()
            self._prune_timer = None
        expiry = self.store.next_expiry()
        if expiry is not None:
            delay = max(0.0, expiry - self.store.clock())
            self._prune_timer = asyncio.get_running_loop().call_later(delay, self._prune_due)

    def _prune_due(self) -> None:
        self._prune_timer = None
        self.store.prune()
        self._schedule_prune()

    async def _advertise(self) -> bool:
        """Store the current state's advertisement; False when the store failed (logged)."""
        manifest = self.store.current
        if manifest is None:
            return False
        value = {
            "root": manifest.root,
            "version": manifest.version,
            "size": manifest.total_bytes,
            "addr": self.address,
        }
        try:
            async with asyncio.timeout(self.config.message_timeout):
                await self.dht.store(
                    self.key,
                    value,
                    time.time() + self.config.ttl,
                    subkey=owner_suffix(self.dht.peer_id),
                )
        except (TimeoutError, grpc.aio.AioRpcError) as error:
            log.warning("advertising published state failed: %r", error)
            return False
        return True

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.config.ttl / 3)
            try:
                await self._advertise()
            except Exception:  # keep refreshing; the next try may succeed
                log.exception("refreshing the state advertisement failed")

    async def shutdown(self) -> None:
        """Stop refreshing the advertisement (it then expires by itself) and pruning."""
        if self._prune_timer is not None:
            self._prune_timer.cancel()
            self._prune_timer = None
        for task in (self._refresher, self._advertiser):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._refresher = self._advertiser = None

    # ------------------------------------------------------------------ joiner side

    async def load(
        self, timeout: float, max_bytes: int | None = None
    ) -> tuple[bytes, list[np.ndarray]]:
        """Download the run's state; return ``(metadata, tensors)``.

        The state taken is the root advertised by the most distinct donors, the fresher of
        equally held roots as far as other donors vouch for its version
        (:func:`~swarmavg.averaging.state.adverts.choose_donors`); a single advert's
        version never decides it.

        The state accepted, and so what the joiner buffers, is at most ``max_bytes``
        (the schema the caller expects, e.g. its own model's state) and at most
        ``config.max_state_bytes``: an advertisement or manifest declaring more is
        refused before any chunk is fetched.

        The result is exactly the state named by one advertised root: every chunk is
        checked against that root's manifest, never mixed with another version. When every
        donor of the version being downloaded fails or has dropped it (donors republish),
        the DHT is read again and the best-ranked root not yet tried is downloaded,
        reusing the chunks already verified; this goes on until ``timeout``.

        Raises:
            ValueError: ``max_bytes`` is not positive.
            StateNotFoundError: nobody advertises a state.
            StateDownloadError: every donor of every advertised state failed, or every
                advertised state is larger than the bound.
            TimeoutError: ``timeout`` seconds passed.
        """
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        cap = min(self.config.max_state_bytes, max_bytes or self.config.max_state_bytes)
        failed: set[bytes] = set()
        errors: list[str] = []
        verified: dict[bytes, bytes] = {}
        tried = False
        async with asyncio.timeout(timeout):
            while True:
                groups = [g for g in await self._advertised_groups() if g[0].root not in failed]
                too_large = [g for g in groups if g[0].size > cap]
                for group in too_large:
                    failed.add(group[0].root)
                    errors.append(
                        f"state {group[0].root.hex()[:12]} of {group[0].size} bytes is over "
                        f"the {cap}-byte bound"
                    )
                groups = [g for g in groups if g[0].size <= cap]
                if not groups:
                    if not failed:
                        raise StateNotFoundError(f"no peer advertises state under {self.key!r}")
                    raise StateDownloadError("; ".join(errors))
                if tried:
                    self.load_switches += 1
                tried = True
                donors = random.sample(groups[0], len(groups[0]))  # spread joiners over donors
                try:
                    return await self._load_root(donors, verified, cap)
                except StateDownloadError as error:
                    failed.add(donors[0].root)
                    errors.append(str(error))
                    log.info("moving on from state %s: %s", donors[0].root.hex()[:12], error)

    async def _advertised_groups(self) -> list[list[Advertisement]]:
        async with asyncio.timeout(self.config.message_timeout):
            record = await self.dht.get(self.key, latest=True)
        ads = [
            ad
            for sk, v in dictionary_entries(record).items()
            if (ad := parse_advertisement(sk, v)) is not None
        ]
        return choose_donors(ads, exclude=self.dht.peer_id)

    def _local_chunks(self) -> Mapping[bytes, bytes]:
        """Chunks this peer holds already: the last loaded state and what it serves."""
        if not self._held:
            return self.store.chunks
        local = dict(self._held)
        local.update(self.store.chunks)
        return local

    async def _load_root(
        self, donors: list[Advertisement], verified: dict[bytes, bytes], cap: int
    ) -> tuple[bytes, list[np.ndarray]]:
        """Download the state ``donors[0].root`` into ``verified`` (kept on failure)."""
        root = donors[0].root
        manifest: Manifest | None = None
        live: list[Advertisement] = []
        attempt = 0
        while manifest is None:
            busy = False
            for i, donor in enumerate(donors):
                try:
                    manifest = await self._fetch_manifest(donor, root, cap)
                    live = donors[i:]
                    break
                except _DonorBusy:
                    busy = True
                except _DonorFailed as error:
                    log.info("donor %s has no usable manifest: %s", donor.peer_id.hex()[:8], error)
            if manifest is not None or not busy:
                break
            # Busy is transient (donors cut joiners that do not keep up): wait, ask again;
            # load()'s timeout bounds it.
            await asyncio.sleep(_busy_pause(attempt))
            attempt += 1
        if manifest is None:
            raise StateDownloadError(f"no donor of state {root.hex()[:12]} sent a valid manifest")
        wanted = set(manifest.chunk_hashes)
        for digest in [h for h in verified if h not in wanted]:
            del verified[digest]  # an abandoned version's own chunks: bounds memory to one state
        local = self._local_chunks()
        for digest in wanted:
            if digest not in verified and digest in local:
                verified[digest] = local[digest]
        needed = [h for h in dict.fromkeys(manifest.chunk_hashes) if h not in verified]
        if needed:
            sizes = dict(zip(manifest.chunk_hashes, manifest.chunk_sizes, strict=True))
            self.progress = TransferProgress(sum(sizes[h] for h in needed))
            what = f"state {root.hex()[:12]}"
            log.info(
                "downloading %s: %s in %d chunk(s) from %d donor(s)",
                what,
                format_bytes(self.progress.total),
                len(needed),
                len(live),
            )
            await self._download(needed, live, verified)
            log.info(
                "downloaded %s: %s in %.1f s (%s/s)",
                what,
                format_bytes(self.progress.total),
                self.progress.elapsed(),
                format_bytes(self.progress.rate()),
            )
        try:
            metadata, tensors = await asyncio.to_thread(unpack_state, manifest, verified)
        except StateFormatError as error:
            raise StateDownloadError(f"state {root.hex()[:12]} is malformed: {error}") from None
        self._held = verified if self.config.keep_loaded_chunks else {}
        return metadata, tensors

    def _signed(
        self, donor: Advertisement, request: averaging_pb2.StateRequest
    ) -> averaging_pb2.StateRequest:
        """``request`` with a header signed for ``donor`` (its id is in its advert)."""
        digest = message_digest(request)
        request.header.CopyFrom(self.dht.signer.sign(donor.peer_id, DOWNLOAD_STATE, digest))
        return request

    def _download_call(self, donor: Advertisement) -> grpc.aio.UnaryStreamMultiCallable:
        return download_state_method(self.channels.channel(donor.address, donor.peer_id))

    async def _fetch_manifest(self, donor: Advertisement, root: bytes, cap: int) -> Manifest:
        request = self._signed(donor, averaging_pb2.StateRequest(root=root, want_manifest=True))
        call = self._download_call(donor)(request, timeout=self.config.message_timeout)
        try:
            async with asyncio.timeout(self.config.message_timeout):
                first = await call.read()
            if first is not grpc.aio.EOF and first.code == averaging_pb2.STATE_BUSY:
                raise _DonorBusy("busy")
            if first is grpc.aio.EOF or first.code != averaging_pb2.STATE_OK:
                detail = "" if first is grpc.aio.EOF else first.detail
                raise _DonorFailed(f"no manifest ({detail})")
            return Manifest.from_proto(first.manifest, root, cap)
        except (grpc.aio.AioRpcError, TimeoutError, StateFormatError) as error:
            raise _DonorFailed(repr(error)) from None
        finally:
            call.cancel()

    async def _download(
        self, needed: list[bytes], donors: list[Advertisement], got: dict[bytes, bytes]
    ) -> None:
        """Fetch ``needed`` chunks from ``donors`` in parallel into ``got``; verify every sha256.

        A donor that fails (including one that no longer holds a chunk) hands its
        unfinished batch back to the others. Chunks received before a failure stay in
        ``got``.

        Raises:
            StateDownloadError: some chunks could not be fetched from any donor.
        """
        pending = list(needed)
        in_flight = 0
        changed = asyncio.Event()
        failures: list[str] = []

        async def worker(donor: Advertisement) -> None:
            nonlocal in_flight
            busy_attempts = 0
            while True:
                if not pending:
                    if in_flight == 0:
                        return
                    changed.clear()
                    await changed.wait()
                    continue
                batch = pending[: self.config.batch_chunks]
                del pending[: len(batch)]
                in_flight += 1
                busy = False
                try:
                    await self._fetch_batch(donor, batch, got)
                    busy_attempts = 0
                except _DonorBusy:  # transient: hand the batch back, ask again shortly
                    pending.extend(h for h in batch if h not in got)
                    busy = True
                except _DonorFailed as error:
                    pending.extend(h for h in batch if h not in got)
                    failures.append(f"{donor.peer_id.hex()[:8]}: {error}")
                    log.info("donor %s failed: %s", donor.peer_id.hex()[:8], error)
                    return
                finally:
                    in_flight -= 1
                    changed.set()
                if busy:
                    await asyncio.sleep(_busy_pause(busy_attempts))
                    busy_attempts += 1

        async with asyncio.TaskGroup() as tasks:
            for donor in donors:
                tasks.create_task(worker(donor))
        if pending:
            raise StateDownloadError(
                f"{len(pending)} of {len(needed)} chunks of state {donors[0].root.hex()[:12]} "
                "could not be downloaded: " + "; ".join(failures)
            )

    async def _fetch_batch(
        self, donor: Advertisement, batch: list[bytes], got: dict[bytes, bytes]
    ) -> None:
        request = self._signed(
            donor, averaging_pb2.StateRequest(root=donor.root, chunk_hashes=batch)
        )
        call = self._download_call(donor)(request)
        try:
            for wanted in batch:
                async with asyncio.timeout(self.config.message_timeout):
                    message = await call.read()
                if message is not grpc.aio.EOF and message.code == averaging_pb2.STATE_BUSY:
                    raise _DonorBusy("busy")
                if message is grpc.aio.EOF or message.code != averaging_pb2.STATE_OK:
                    detail = "stream ended" if message is grpc.aio.EOF else message.detail
                    raise _DonorFailed(f"chunk not served ({detail})")
                data = bytes(message.chunk_data)
                if bytes(message.chunk_hash) != wanted or chunk_hash(data) != wanted:
                    raise _DonorFailed("chunk failed sha256 verification")
                got[wanted] = data
                self.downloaded_chunks += 1
                if self.progress is not None:
                    self.progress.add(len(data))
                    if self.progress.due():
                        log.info("%s", self.progress.line(f"state {donor.root.hex()[:12]}"))
        except (grpc.aio.AioRpcError, TimeoutError) as error:
            raise _DonorFailed(repr(error)) from None
        finally:
            call.cancel()

    # ------------------------------------------------------------------ donor side

    async def rpc_download_state(
        self, request: averaging_pb2.StateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """Serve the manifest and/or chunks, by content hash, of the published state or of a
        superseded version still within its grace (``STATE_NOT_FOUND`` once dropped).

        Every write has a deadline (``message_timeout``) and the whole stream another
        (``upload_timeout``): a joiner that does not keep up is cut, so that 8 slow
        readers cannot hold every upload slot and make every other joiner get
        ``STATE_BUSY``. And one requesting identity, or one address range, holds
        at most its share of the slots (:mod:`~swarmavg.averaging.state.slots`):
        readers that are slow but just fast enough for those deadlines still leave the
        other slots to everyone else.
        """
        try:
            sender = self.dht.authenticator.check(
                request.header, DOWNLOAD_STATE, message_digest(request)
            )
        except AuthenticationError as error:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))
            raise AssertionError("unreachable: abort raises") from None
        except HeaderError as error:
            await self._write(
                context,
                averaging_pb2.StateResponse(
                    code=averaging_pb2.STATE_BAD_REQUEST, detail=str(error)
                ),
            )
            return
        if len(request.chunk_hashes) > MAX_CHUNKS_PER_REQUEST or any(
            len(h) != HASH_BYTES for h in request.chunk_hashes
        ):
            await self._write(
                context,
                averaging_pb2.StateResponse(
                    code=averaging_pb2.STATE_BAD_REQUEST,
                    detail=f"at most {MAX_CHUNKS_PER_REQUEST} chunk hashes of 32 bytes",
                ),
            )
            return
        manifest: Manifest | None = None
        if request.want_manifest:
            manifest = self.store.manifest(bytes(request.root))
        elif request.root:
            self.store.touch(bytes(request.root))  # a download in progress keeps its grace
        if self.store.current is None or (request.want_manifest and manifest is None):
            await self._write(
                context,
                averaging_pb2.StateResponse(
                    code=averaging_pb2.STATE_NOT_FOUND, detail="that state is not held here"
                ),
            )
            return
        host = grpc_peer_host(context.peer())
        network = limited_range(host, False) if host else None  # local ranges: exempt
        refusal = self.slots.acquire(sender, network)
        if refusal is not None:
            await self._write(
                context, averaging_pb2.StateResponse(code=averaging_pb2.STATE_BUSY, detail=refusal)
            )
            return
        self.uploads.add(1)
        try:
            async with asyncio.timeout(self.config.upload_timeout):
                await self._upload(request, manifest, context)
        except TimeoutError:
            self.uploads_cut.add(1)
            reason = "joiner did not keep up with the download"
            log.info("state upload cut: %s", reason)
            await abort_stalled(context, grpc.StatusCode.DEADLINE_EXCEEDED, reason)
        finally:
            self.slots.release(sender, network)
            self.uploads.add(-1)

    async def _write(
        self, context: grpc.aio.ServicerContext[Any, Any], message: averaging_pb2.StateResponse
    ) -> None:
        """One message, within ``message_timeout`` (raises TimeoutError past it)."""
        async with asyncio.timeout(self.config.message_timeout):
            await context.write(message)

    async def _upload(
        self,
        request: averaging_pb2.StateRequest,
        manifest: Manifest | None,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        if manifest is not None:
            await self._write(
                context,
                averaging_pb2.StateResponse(
                    code=averaging_pb2.STATE_OK, manifest=manifest.to_proto()
                ),
            )
        for wanted in request.chunk_hashes:
            if self.faults is not None and self.faults.before_chunk is not None:
                await self.faults.before_chunk(self.served_chunks)
            # looked up per chunk: a version dropped mid-stream is not served on
            data = self.store.chunk(bytes(wanted))
            if data is None:
                await self._write(
                    context,
                    averaging_pb2.StateResponse(
                        code=averaging_pb2.STATE_NOT_FOUND,
                        detail="chunk not held here (its version was superseded)",
                    ),
                )
                return
            if self.faults is not None:
                limit = self.faults.fail_after_chunks
                if limit is not None and self.served_chunks >= limit:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "injected donor failure")
                if self.faults.corrupt_chunks and data:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
            self.served_chunks += 1
            await self._write(
                context,
                averaging_pb2.StateResponse(
                    code=averaging_pb2.STATE_OK, chunk_hash=wanted, chunk_data=data
                ),
            )
