"""A private run's revocation list (dht/revocation.py): signing, checking, files, the DHT key.

The list is believed only when the run's authority signed it for this run, and a peer only
moves forward (a higher number). ``swarmavg run revoke``'s library call extends an existing
file. The DHT key class refuses anything else under the run's revocation key.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from swarmavg.dht.credentials import CredentialError, load_authority_key, read_run_file
from swarmavg.dht.records import StoredRecord, owner_suffix, pack, pack_subkey, signing_payload
from swarmavg.dht.revocation import (
    RevocationError,
    RevocationList,
    Revocations,
    default_revocations_path,
    read_revocations,
    revocation_key,
    revoke,
)
from swarmavg.dht.validation import DHTLimits, ValidationError, validate_record
from tests.dht.swarm import swarm
from tests.private_runs import Authority

pytestmark = pytest.mark.timeout(30)

RUN = "secret-run"
ALICE, BOB = bytes(range(20)), bytes(range(1, 21))


@pytest.fixture
def authority(tmp_path: Path) -> Authority:
    return Authority.create(tmp_path / "run", RUN)


def signed(
    authority: Authority, number: int, *peer_ids: bytes, run_id: str = RUN
) -> RevocationList:
    key = load_authority_key(authority.authority_path)
    return RevocationList.sign(key, run_id, number, peer_ids)


def holder(authority: Authority) -> Revocations:
    run = read_run_file(authority.run_path)
    return Revocations(run.run_id, run.authority_pem)


def test_a_signed_list_verifies_and_survives_its_file_and_dht_forms(authority: Authority) -> None:
    revocations = signed(authority, 3, ALICE, BOB)
    run = read_run_file(authority.run_path)
    revocations.verify(run.authority, RUN)
    assert RevocationList.from_value(revocations.to_value()) == revocations
    path = authority.folder / "my.revoked"
    path.write_text(revocations.dumps())
    assert read_revocations(path, run) == revocations
    assert "number = 3" in path.read_text()
    assert ALICE.hex() in path.read_text()


def test_an_altered_list_does_not_verify(authority: Authority) -> None:
    revocations = signed(authority, 1, ALICE)
    run = read_run_file(authority.run_path)
    for altered in (
        RevocationList(RUN, 1, revocations.issued, frozenset({BOB}), revocations.signature),
        RevocationList(RUN, 2, revocations.issued, revocations.peer_ids, revocations.signature),
        RevocationList(RUN, 1, revocations.issued, frozenset(), revocations.signature),
    ):
        with pytest.raises(RevocationError, match="not signed by the authority"):
            altered.verify(run.authority, RUN)


def test_a_list_of_another_authority_or_another_run_is_refused(
    authority: Authority, tmp_path: Path
) -> None:
    run = read_run_file(authority.run_path)
    # Another organiser's run of the same name: its authority signs a well-formed list.
    foreign = Authority.create(tmp_path / "foreign", RUN)
    with pytest.raises(RevocationError, match="not signed by the authority of run"):
        signed(foreign, 5, ALICE).verify(run.authority, RUN)
    # This authority, but a list made for another run name.
    with pytest.raises(RevocationError, match="of run 'other', not of run 'secret-run'"):
        signed(authority, 5, ALICE, run_id="other").verify(run.authority, RUN)
    path = tmp_path / "foreign.revoked"
    path.write_text(signed(foreign, 1, ALICE).dumps())
    with pytest.raises(RevocationError, match=f"revocation list {path}: it was not signed"):
        read_revocations(path, run)


def test_a_peer_adopts_only_a_higher_number(authority: Authority) -> None:
    revocations = holder(authority)
    adopted: list[int] = []
    revocations.on_change(lambda found: adopted.append(found.number))
    assert ALICE not in revocations
    assert revocations.adopt(signed(authority, 2, ALICE))
    assert ALICE in revocations
    assert BOB not in revocations
    assert not revocations.adopt(signed(authority, 1, BOB))  # older: a rollback
    assert not revocations.adopt(signed(authority, 2, BOB))  # same number, other content
    assert BOB not in revocations
    assert revocations.number == 2
    with pytest.raises(RevocationError):  # newer but forged: refused, not ignored
        revocations.adopt(RevocationList(RUN, 9, int(time.time()), frozenset({BOB}), b"x" * 70))
    assert revocations.adopt(signed(authority, 3, BOB))
    assert revocations.revoked == {BOB}
    assert adopted == [2, 3]


def test_copies_of_one_list_cost_one_verification_and_a_forged_copy_still_fails(
    authority: Authority, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every holder stores its own copy of the list, so a read returns many copies of it."""
    revocations = holder(authority)
    calls: list[int] = []
    real = RevocationList.verify

    def counted(self: RevocationList, *args: object) -> None:
        calls.append(self.number)
        real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(RevocationList, "verify", counted)
    good = signed(authority, 4, ALICE)
    for _ in range(5):
        revocations.verify(RevocationList.from_value(good.to_value()))
    assert calls == [4]
    forged = RevocationList(RUN, 4, good.issued, good.peer_ids, b"y" * 70)
    with pytest.raises(RevocationError):
        revocations.verify(forged)
    with pytest.raises(RevocationError):
        revocations.verify(forged)  # a failure is never remembered
    assert calls == [4, 4, 4]


def test_revoke_writes_then_extends_the_list(authority: Authority) -> None:
    member = authority.invite("mallory")
    out = default_revocations_path(authority.run_path)
    assert out == authority.folder / f"{RUN}.revoked"
    first = revoke(authority.authority_path, authority.run_path, [ALICE.hex()], out)
    assert (first.number, first.peer_ids) == (1, {ALICE})
    # A credential file stands for its peer; the list keeps the peers it had.
    second = revoke(
        authority.authority_path, authority.run_path, [str(member.credential_path)], out
    )
    assert second.number == 2
    assert second.peer_ids == {ALICE, member.identity.peer_id}
    assert read_revocations(out, read_run_file(authority.run_path)) == second


def test_revoke_refuses_bad_input_with_one_line(authority: Authority, tmp_path: Path) -> None:
    out = tmp_path / "x.revoked"
    with pytest.raises(RevocationError, match="is neither a peer id"):
        revoke(authority.authority_path, authority.run_path, ["3fa1"], out)
    foreign = Authority.create(tmp_path / "foreign", "other")
    with pytest.raises(CredentialError, match="does not belong to run 'secret-run'"):
        revoke(foreign.authority_path, authority.run_path, [ALICE.hex()], out)
    # --out names a list of another run: never extended, never overwritten.
    revoke(foreign.authority_path, foreign.run_path, [ALICE.hex()], out)
    before = out.read_text()
    with pytest.raises(RevocationError, match="of run 'other', not of run 'secret-run'"):
        revoke(authority.authority_path, authority.run_path, [BOB.hex()], out)
    assert out.read_text() == before
    assert not list(tmp_path.glob(".*.tmp"))


# ---- the DHT key class -------------------------------------------------------------------


def record(value: object, owner_key: ec.EllipticCurvePrivateKey | None = None) -> StoredRecord:
    """A record under the run's revocation key, owner-signed by a fresh identity."""
    from swarmavg.dht.identity import Identity

    identity = Identity.generate()
    key = revocation_key(RUN).encode()
    subkey = pack_subkey(owner_suffix(identity.peer_id))
    now = time.time()
    raw = pack(value)
    signature = identity.sign(signing_payload(RUN, key, subkey, raw, now + 60, now))
    return StoredRecord(key, subkey, raw, now + 60, identity.public_key, signature, now)


def test_the_dht_key_takes_only_lists_signed_by_the_authority(
    authority: Authority, tmp_path: Path
) -> None:
    key_classes = (holder(authority).key_class(),)

    def check(value: object) -> None:
        validate_record(
            record(value), DHTLimits(), time.time(), run_id=RUN, key_classes=key_classes
        )

    check(signed(authority, 4, ALICE).to_value())  # a holder's copy: taken
    foreign = Authority.create(tmp_path / "foreign", RUN)
    for refused in (
        signed(foreign, 99, ALICE).to_value(),  # another authority
        signed(authority, 99, ALICE, run_id="other").to_value(),  # another run
        [RUN, 99, int(time.time()), [], b"forged"],  # a stranger's wipe
        "x",
    ):
        with pytest.raises(ValidationError, match="revocation lists"):
            check(refused)


async def test_a_node_reads_no_record_of_a_refused_peer() -> None:
    """Records a revoked peer stored before its revocation (its matchmaking declaration, its
    state advert) stay on their holders until they expire; a node that refuses the peer
    must not see them, or it would dial the peer as a leader or a donor."""
    async with swarm(3, run_id="test") as s:
        revoked, reader, other = s.nodes
        key = "test.board"
        for node in (revoked, other):
            subkey = owner_suffix(node.peer_id)
            assert await node.store(key, {"here": True}, time.time() + 600, subkey=subkey)
        seen = await reader.get(key, latest=True)
        assert seen is not None
        assert len(seen.value) == 2
        reader.routing.refuse(frozenset({revoked.peer_id}))
        seen = await reader.get(key, latest=True)
        assert seen is not None
        assert list(seen.value) == [owner_suffix(other.peer_id)]
        assert len((await other.get(key, latest=True)).value) == 2  # other nodes still see it
