"""The view of a run that ``swarmavg peers`` prints: every peer, its progress.

Pure: the daemon gathers the inputs (its routing table and the run's progress records,
read through its DHT) and :func:`build_view` turns them into the ``PeersResponse`` the
control service returns. Progress lives under ``{run}.progress`` (CollaborativeOptimizer)
and ``{run}.diloco.progress`` (DiLoCo); a daemon that reports under neither (a bootstrap
node, a daemon whose trainer has not started) still appears, from the routing table.

What a daemon cannot see: the address of a peer outside its routing table. Such a peer is
shown in client mode (no address), which is what it is in a run small enough for every
routing table to hold every peer (a few hundred peers: k-buckets of 20).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from swarmavg.averaging.run_records.progress import PeerProgress, aggregate, swarm_epoch
from swarmavg.averaging.run_records.trainers import TrainingRun
from swarmavg.proto import control_pb2

METHODS = {"collaborative": ".progress", "diloco": ".diloco.progress"}
"""Training method -> the suffix of its progress key after the run id."""
REJOINS_METRIC = "rejoins"
"""The metric a peer's row shows its trainers' rejoins under (``PeerProgress.rejoins``,
summed over the daemon's processes; shown when not 0, unless a trainer reports a user
metric of that name itself)."""


def progress_keys(training_run: str) -> dict[str, str]:
    """Method -> the DHT key its trainers report under for ``training_run``."""
    return {method: f"{training_run}{suffix}" for method, suffix in METHODS.items()}


@dataclass(frozen=True)
class Neighbour:
    """A routing-table contact: a daemon this one can dial.

    Attributes:
        peer_id: hex peer id.
        address: its ``HOST:PORT``.
        age: seconds since this daemon last heard from it.
    """

    peer_id: str
    address: str
    age: float


@dataclass(frozen=True)
class ThisPeer:
    """The daemon that answers: its id, announced address (None in client mode)."""

    peer_id: str
    address: str | None


def _run_target(records: Sequence[PeerProgress], epoch: int) -> int:
    """The target batch size most records at ``epoch`` say (0: none says)."""
    targets = Counter(p.target for p in records if p.epoch == epoch and p.target > 0)
    return targets.most_common(1)[0][0] if targets else 0


def run_progress(
    method: str, records: Sequence[PeerProgress], now: float
) -> control_pb2.RunProgress:
    """The run's progress for one method's records (every record, left ones included)."""
    target = _run_target(records, swarm_epoch(records))
    view = aggregate(records, target or 1, now=now)
    eta = view.eta if target else -1.0
    return control_pb2.RunProgress(
        method=method,
        epoch=view.epoch,
        samples=view.samples,
        target=target,
        samples_per_second=view.samples_per_second,
        eta=eta if eta != float("inf") else -1.0,
        peers=view.num_peers,
    )


def _peer_row(
    peer_id: str, method: str, processes: Sequence[PeerProgress], now: float
) -> control_pb2.PeerView:
    epoch = max(p.epoch for p in processes)
    newest = max(processes, key=lambda p: p.time)
    with_metrics = [p for p in processes if p.metrics]
    row = control_pb2.PeerView(
        peer_id=peer_id,
        method=method,
        epoch=epoch,
        samples=sum(p.samples for p in processes if p.epoch == epoch),
        samples_per_second=sum(p.samples_per_second for p in processes),
        processes=len(processes),
        last_seen=max(now - newest.time, 0.0),
    )
    if with_metrics:
        row.metrics.update(dict(max(with_metrics, key=lambda p: p.time).metrics))
    rejoins = sum(p.rejoins for p in processes)
    if rejoins and REJOINS_METRIC not in row.metrics:
        row.metrics[REJOINS_METRIC] = float(rejoins)
    return row


def build_view(
    run_id: str,
    this: ThisPeer,
    neighbours: Iterable[Neighbour],
    records: Mapping[str, Sequence[PeerProgress]],
    now: float,
    ignored: int = 0,
) -> control_pb2.PeersResponse:
    """Every daemon of the run, one row per training method it reports, and the run's
    progress per method.

    Args:
        run_id: the daemon's run.
        this: the daemon that answers (always listed, first).
        neighbours: its routing table.
        records: method -> the valid records read under that method's key (see
            ``progress.parse_records``).
        now: the wall clock the records' ``time`` is compared with.
        ignored: records left out as malformed, implausible or forged.
    """
    contacts = {n.peer_id: n for n in neighbours}
    response = control_pb2.PeersResponse(run_id=run_id, ignored_records=ignored)
    rows: list[control_pb2.PeerView] = []
    for method, method_records in records.items():
        if method_records:
            response.progress.append(run_progress(method, method_records, now))
        by_peer: dict[str, list[PeerProgress]] = {}
        for p in method_records:
            if not p.left:
                by_peer.setdefault(p.peer_id, []).append(p)
        rows += [_peer_row(peer, method, procs, now) for peer, procs in by_peer.items()]
    listed = {row.peer_id for row in rows}
    rows += [
        control_pb2.PeerView(peer_id=peer_id, last_seen=contact.age)
        for peer_id, contact in contacts.items()
        if peer_id not in listed
    ]
    if this.peer_id not in listed:
        rows.append(control_pb2.PeerView(peer_id=this.peer_id))
    for row in rows:
        if row.peer_id == this.peer_id:
            row.this_peer = True
            row.address = this.address or ""
            row.mode = "full" if this.address else "client"
            row.last_seen = 0.0
            continue
        contact = contacts.get(row.peer_id)
        row.address = contact.address if contact is not None else ""
        row.mode = "full" if contact is not None else "client"
        if contact is not None:
            row.last_seen = min(row.last_seen, contact.age) if row.method else contact.age
    rows.sort(key=lambda r: (not r.this_peer, r.peer_id, r.method))
    response.peers.extend(rows)
    return response


def add_training_runs(view: control_pb2.PeersResponse, runs: Iterable[TrainingRun]) -> None:
    """List the training runs the trainer entries under the daemons' run name
    (``run_records.trainers.training_runs``) in ``view``."""
    view.training_runs.extend(
        control_pb2.TrainingRunView(run=r.run, method=r.method, trainers=r.trainers, alone=r.alone)
        for r in runs
    )


def view_to_dict(view: control_pb2.PeersResponse) -> dict[str, object]:
    """A plain dict (JSON-ready) of a run's view (``swarmavg peers --json``): ``eta`` is
    None when unknown, ``address`` None when not known."""
    return {
        "run_id": view.run_id,
        "ignored_records": view.ignored_records,
        "training_runs": [
            {"run": r.run, "method": r.method, "trainers": r.trainers, "alone": r.alone}
            for r in view.training_runs
        ],
        "progress": [
            {
                "method": p.method,
                "epoch": p.epoch,
                "samples": p.samples,
                "target": p.target or None,
                "samples_per_second": p.samples_per_second,
                "eta": p.eta if p.eta >= 0 else None,
                "peers": p.peers,
            }
            for p in view.progress
        ],
        "peers": [
            {
                "peer_id": r.peer_id,
                "address": r.address or None,
                "mode": r.mode,
                "method": r.method or None,
                "epoch": r.epoch if r.method else None,
                "samples": r.samples if r.method else None,
                "samples_per_second": r.samples_per_second if r.method else None,
                "processes": r.processes,
                "last_seen": r.last_seen,
                "metrics": dict(sorted(r.metrics.items())),
                "this_peer": r.this_peer,
            }
            for r in view.peers
        ],
    }
