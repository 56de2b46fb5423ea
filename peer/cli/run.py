"""``swarmavg run``: a private run's authority and its invitations (docs/private-runs.md).

- ``swarmavg run init --run-id NAME``: the organiser creates the run authority (a private key,
  mode 600, kept by the organiser) and the run file (the run id and the authority's certificate,
  given to every peer).
- ``swarmavg run whoami --identity FILE``: a peer prints its peer id and its join request (one
  line, no secret), creating its identity and TLS key when missing.
- ``swarmavg run invite REQUEST --authority KEY --run-file RUN``: the organiser issues the
  peer's credential for that request.
- ``swarmavg run revoke PEER ... --authority KEY --run-file RUN``: the organiser writes (or
  extends) the run's signed revocation list, which any peer then passes on to the others.

The crypto is :mod:`swarmavg.dht.credentials`; this module only parses and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from swarmavg.dht.credentials import (
    DEFAULT_AUTHORITY_DAYS,
    DEFAULT_CREDENTIAL_DAYS,
    JOIN_REQUEST_PREFIX,
    CredentialError,
    JoinRequest,
    init_run,
    invite,
    load_or_create_tls_key,
    tls_key_path,
)
from swarmavg.dht.identity import Identity
from swarmavg.dht.revocation import default_revocations_path, revoke

EXIT_ERROR = 1


def add_run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``run`` and its subcommands to the top-level subparsers."""
    run = sub.add_parser(
        "run",
        help="private runs: create a run authority, print a join request, invite or revoke a peer",
        description="Private runs admit only invited peers and encrypt all traffic "
        "(docs/private-runs.md).",
    )
    steps = run.add_subparsers(dest="run_command", metavar="STEP", required=True)
    init = steps.add_parser("init", help="create a run authority and its run file (organiser)")
    init.add_argument("--run-id", required=True, metavar="NAME", help="the run's name")
    init.add_argument(
        "--authority",
        metavar="FILE",
        help="where to write the authority's private key, mode 600 (default NAME.authority.pem)",
    )
    init.add_argument(
        "--run-file",
        metavar="FILE",
        help="where to write the run file for the peers (default NAME.run.toml)",
    )
    init.add_argument(
        "--days",
        type=int,
        default=DEFAULT_AUTHORITY_DAYS,
        help=f"validity of the authority (default {DEFAULT_AUTHORITY_DAYS})",
    )
    whoami = steps.add_parser(
        "whoami", help="print this peer's id and join request (creates keys when missing)"
    )
    whoami.add_argument(
        "--identity", required=True, metavar="FILE", help="the peer's Ed25519 key file"
    )
    whoami.add_argument("--json", action="store_true", help="print one JSON object")
    inv = steps.add_parser("invite", help="issue a peer's credential for its join request")
    inv.add_argument(
        "request",
        metavar="REQUEST",
        help=f"the peer's join request ({JOIN_REQUEST_PREFIX}...), a file holding it, or - "
        "for stdin",
    )
    inv.add_argument("--authority", required=True, metavar="FILE", help="the authority's key")
    inv.add_argument("--run-file", required=True, metavar="FILE", help="the run file")
    inv.add_argument(
        "--days",
        type=int,
        default=DEFAULT_CREDENTIAL_DAYS,
        help=f"validity of the credential (default {DEFAULT_CREDENTIAL_DAYS})",
    )
    inv.add_argument(
        "--out", metavar="FILE", help="where to write the credential (default PEERID.cred.pem)"
    )
    rev = steps.add_parser(
        "revoke",
        help="shut peers out of the run: write or extend its signed revocation list",
        description="Sign a revocation list naming these peers (and those of the existing "
        "list, with its number + 1). Give the file to any peer of the run (swarmavg peer "
        "--revocations FILE): it refuses them and passes the list on to the others.",
    )
    rev.add_argument(
        "peers",
        nargs="+",
        metavar="PEER",
        help="a peer id (hex, as `swarmavg run invite` printed it) or the peer's credential file",
    )
    rev.add_argument("--authority", required=True, metavar="FILE", help="the authority's key")
    rev.add_argument("--run-file", required=True, metavar="FILE", help="the run file")
    rev.add_argument(
        "--out",
        metavar="FILE",
        help="the revocation list to write or extend (default: beside the run file, NAME.revoked)",
    )


def _error(message: str) -> int:
    print(f"swarmavg run: error: {message}", file=sys.stderr, flush=True)
    return EXIT_ERROR


def _request_text(argument: str) -> str:
    if argument == "-":
        return sys.stdin.read()
    if argument.strip().startswith(JOIN_REQUEST_PREFIX):
        return argument
    try:
        return Path(argument).read_text()
    except OSError as exc:
        raise CredentialError(f"join request file {argument}: {exc.strerror}") from None


def cmd_run(args: argparse.Namespace) -> int:
    """Run ``swarmavg run STEP``; return the exit status."""
    try:
        if args.run_command == "init":
            return _init(args)
        if args.run_command == "whoami":
            return _whoami(args)
        if args.run_command == "revoke":
            return _revoke(args)
        return _invite(args)
    except CredentialError as exc:
        return _error(str(exc))


def _init(args: argparse.Namespace) -> int:
    authority = args.authority or f"{args.run_id}.authority.pem"
    run_file = args.run_file or f"{args.run_id}.run.toml"
    run = init_run(args.run_id, authority, run_file, args.days)
    print(f"run {run.run_id!r}: authority key {authority} (keep it secret), run file {run_file}")
    print(f"give {run_file} to every peer; invite each with: swarmavg run invite REQUEST "
          f"--authority {authority} --run-file {run_file}")  # fmt: skip
    return 0


def _whoami(args: argparse.Namespace) -> int:
    try:
        identity = Identity.load_or_create(args.identity)
    except (OSError, ValueError) as exc:
        return _error(f"identity file {args.identity}: {exc}")
    key_path = tls_key_path(args.identity)
    request = JoinRequest.make(identity, load_or_create_tls_key(key_path))
    line = request.encode()
    if args.json:
        record = {"peer_id": identity.peer_id_hex, "join_request": line, "tls_key": str(key_path)}
        print(json.dumps(record))
    else:
        print(line)
        print(
            f"peer id {identity.peer_id_hex}; TLS key {key_path}. Send the line above to the "
            "run's organiser (it holds no secret).",
            file=sys.stderr,
        )
    return 0


def _invite(args: argparse.Namespace) -> int:
    peer_id, credential = invite(
        args.authority, args.run_file, _request_text(args.request), args.days
    )
    out = Path(args.out or f"{peer_id.hex()[:16]}.cred.pem")
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return _error(f"{out} exists; refusing to overwrite it (choose another --out)")
    except OSError as exc:
        return _error(f"cannot write {out}: {exc.strerror}")
    with os.fdopen(fd, "wb") as fh:
        fh.write(credential)
    print(f"invited peer {peer_id.hex()}: credential {out}; send it to that peer")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else default_revocations_path(args.run_file)
    revocations = revoke(args.authority, args.run_file, args.peers, out)
    print(
        f"revocation list #{revocations.number} of run {revocations.run_id!r}: "
        f"{len(revocations.peer_ids)} peer(s) revoked, written to {out}; give it to any peer "
        f"of the run (swarmavg peer --revocations {out})"
    )
    return 0
