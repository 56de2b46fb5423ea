"""TLS for a private run: mutual TLS 1.3 on the gRPC port and on the data plane.

One :class:`PeerTLS` per daemon, built from its checked
:class:`~swarmavg.dht.credentials.PeerCredentials`, gives every endpoint its TLS setup:

- the public gRPC server: ``grpc.ssl_server_credentials(..., root_certificates=authority,
  require_client_auth=True)``, so a peer without a credential of this run fails the handshake,
  before its first message reaches any handler (DHT, JoinGroup, Reduce, DownloadState);
- every outgoing channel (:class:`~swarmavg.dht.channels.ChannelPool`): a ``secure_channel``
  presenting this peer's credential, checking the server's against the same authority under
  the name of the peer it dials (:func:`channel_options`), or, for an address whose peer is
  not known yet (a bootstrap address), the one name every credential carries
  (:data:`~swarmavg.dht.credentials.TLS_SERVER_NAME`);
- the data plane (asyncio streams): ``ssl.SSLContext`` objects from the same files, TLS 1.3
  only, client certificates required; a client checks that the server's certificate names
  the peer it dials before it sends anything (averaging/allreduce/data_connector.py).

The handshake proves that a peer holds *a* credential of the run; :class:`PeerBindingInterceptor`
(gRPC) and :func:`peer_id_of_der` (the data plane) then check that the request header names the
peer id of *that* credential, so an invited peer cannot speak as another peer, and that the
organiser has not revoked it (:class:`~swarmavg.dht.revocation.Revocations`, held by
:class:`PeerTLS`: a set lookup on every call, so an open connection stops working too).

Public runs use none of this: insecure ports and plain TCP, as before.
"""

from __future__ import annotations

import functools
import inspect
import os
import ssl
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
from cryptography import x509

from swarmavg.dht.credentials import (
    PEER_URI_PREFIX,
    TLS_SERVER_NAME,
    PeerCredentials,
    peer_id_of_certificate,
    peer_server_name,
)
from swarmavg.dht.identity import PEER_ID_BYTES
from swarmavg.dht.revocation import Revocations
from swarmavg.dht.server_limits import ServerLimits, make_server
from swarmavg.proto import common_pb2

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a data-plane server gives a client to finish its TLS handshake."""
REVOKED_DETAILS = "credential revoked"
"""The details of the ``PERMISSION_DENIED`` that a revoked peer gets, on every path."""
_HEADER_FIELD = 1  # every peer-to-peer request carries its RequestHeader as field 1
_MAX_SCANNED_FIELDS = 64


class PeerTLS:
    """The TLS setup of one peer of a private run (immutable after creation, but for the
    revocation list it enforces, which only moves forward)."""

    def __init__(self, credentials: PeerCredentials) -> None:
        self.credentials = credentials
        self.peer_id = credentials.peer_id
        self.revocations = Revocations(credentials.run_id, credentials.authority_pem)
        """The peers this one refuses (dht/revocation.py); empty until a list is adopted."""
        self.server_context = self._context(server=True)
        self.client_context = self._context(server=False)

    def server_credentials(self) -> grpc.ServerCredentials:
        """For ``server.add_secure_port``: mutual TLS against the run's authority."""
        c = self.credentials
        return grpc.ssl_server_credentials(
            [(c.private_key_pem, c.certificate_pem)],
            root_certificates=c.authority_pem,
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """For ``grpc.aio.secure_channel``, with :data:`CHANNEL_OPTIONS`."""
        c = self.credentials
        return grpc.ssl_channel_credentials(
            root_certificates=c.authority_pem,
            private_key=c.private_key_pem,
            certificate_chain=c.certificate_pem,
        )

    def _context(self, *, server: bool) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=self.credentials.authority_pem.decode())
        if not server:
            context.check_hostname = True  # against TLS_SERVER_NAME, see client_context users
        # ``ssl`` loads keys from files only: a private folder (mode 700) holds them for the
        # instant of loading, then it is removed.
        with tempfile.TemporaryDirectory(prefix="swarmavg-tls-") as folder:
            cert_path = os.path.join(folder, "cert.pem")
            key_path = os.path.join(folder, "key.pem")
            for path, data in (
                (cert_path, self.credentials.certificate_pem),
                (key_path, self.credentials.private_key_pem),
            ):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
            context.load_cert_chain(cert_path, key_path)
        return context


CHANNEL_OPTIONS: tuple[tuple[str, str], ...] = (
    # Credentials name peer ids, not hosts: a client that does not know whom it dials (a
    # bootstrap address) checks the one name they all carry; see channel_options.
    ("grpc.ssl_target_name_override", TLS_SERVER_NAME),
    ("grpc.default_authority", TLS_SERVER_NAME),
)


def channel_options(peer_id: bytes | None) -> tuple[tuple[str, str], ...]:
    """The TLS options of a channel to ``peer_id`` (None: to any member of the run).

    With a peer id the server's certificate must carry that peer's own name
    (:func:`~swarmavg.dht.credentials.peer_server_name`), checked by gRPC's hostname
    verification during the handshake: a run's credential proves membership, so without it
    any member on the path (a relay, a hijacked address) could answer in another's place.
    """
    if peer_id is None:
        return CHANNEL_OPTIONS
    name = peer_server_name(peer_id)
    return (("grpc.ssl_target_name_override", name), ("grpc.default_authority", name))


SERVER_HOSTNAME = TLS_SERVER_NAME
"""``server_hostname`` of every data-plane connection (see :data:`CHANNEL_OPTIONS`)."""


# ---- who is on the other side ------------------------------------------------------------


def peer_id_of_auth_context(auth: Mapping[str, Sequence[bytes]]) -> bytes | None:
    """The peer id of a gRPC call's client credential (``context.auth_context()``), or None."""
    found = [
        uri[len(PEER_URI_PREFIX) :]
        for uri in auth.get("peer_uri", ())
        if uri.startswith(PEER_URI_PREFIX.encode())
    ]
    if len(found) != 1:
        return None
    try:
        peer_id = bytes.fromhex(found[0].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return None
    return peer_id if len(peer_id) == PEER_ID_BYTES else None


@functools.lru_cache(maxsize=1024)
def peer_id_of_der(der: bytes) -> bytes | None:
    """The peer id of a verified peer certificate in DER (``getpeercert(binary_form=True)``),
    or None. Cached: a daemon sees the same few certificates over and over."""
    try:
        return peer_id_of_certificate(x509.load_der_x509_certificate(der))
    except ValueError:
        return None


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    raise ValueError("truncated varint")


def header_in_bytes(data: bytes) -> common_pb2.RequestHeader | None:
    """The ``RequestHeader`` (field 1) of a serialized request, without parsing the rest.

    Scans at most a few dozen top-level fields; malformed input gives ``None``.
    """
    pos = 0
    try:
        for _ in range(_MAX_SCANNED_FIELDS):
            if pos >= len(data):
                return None
            tag, pos = _read_varint(data, pos)
            field, wire_type = tag >> 3, tag & 7
            if wire_type == 0:
                _, pos = _read_varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                length, pos = _read_varint(data, pos)
                if field == _HEADER_FIELD:
                    if pos + length > len(data):
                        return None
                    return common_pb2.RequestHeader.FromString(data[pos : pos + length])
                pos += length
            else:
                return None
    except Exception:  # a hostile request: no header, refused by the caller
        return None
    return None


def header_peer_id(request: object) -> bytes | None:
    """The sender peer id a request's header claims: raw bytes (the DHT's handlers), a
    generated message with a ``header`` field, or the all-reduce's scanned ``Request``."""
    if isinstance(request, bytes | bytearray | memoryview):
        header = header_in_bytes(bytes(request))
    else:
        header = getattr(request, "header", None)
    if header is None:
        return None
    return bytes(header.peer_id)


# ---- the gRPC server's check -------------------------------------------------------------


async def _check_binding(
    request: object, context: grpc.aio.ServicerContext[Any, Any], revoked: Revocations
) -> None:
    """Abort unless ``request``'s header names the peer id of the call's TLS credential and
    that peer is not ``revoked``."""
    credential = peer_id_of_auth_context(context.auth_context())
    if credential is None:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, "no peer credential of this run on the connection"
        )
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover
    if credential in revoked:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, REVOKED_DETAILS)
    claimed = header_peer_id(request)
    if claimed != credential:
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED,
            f"the request names another peer than its TLS credential ({credential.hex()[:12]})",
        )


async def _checked_stream(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any], revoked: Revocations
) -> AsyncIterator[Any]:
    """``requests``, after checking the first one (the one that carries the header)."""
    first = True
    async for request in requests:
        if first:
            await _check_binding(request, context, revoked)
            first = False
        yield request


def bind_handler(handler: grpc.RpcMethodHandler, revoked: Revocations) -> grpc.RpcMethodHandler:
    """``handler`` with :func:`_check_binding` run on its (first) request."""
    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: Any) -> Any:
            await _check_binding(request, context, revoked)
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream
        if inspect.isasyncgenfunction(inner_us):

            async def unary_stream_gen(request: Any, context: Any) -> AsyncIterator[Any]:
                await _check_binding(request, context, revoked)
                async for response in inner_us(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream_gen, **kwargs)

        async def unary_stream(request: Any, context: Any) -> Any:
            await _check_binding(request, context, revoked)
            return await inner_us(request, context)

        return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def stream_unary(requests: Any, context: Any) -> Any:
            return await inner_su(_checked_stream(requests, context, revoked), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)
    inner_ss = handler.stream_stream
    if inspect.isasyncgenfunction(inner_ss):

        async def stream_stream_gen(requests: Any, context: Any) -> AsyncIterator[Any]:
            async for response in inner_ss(_checked_stream(requests, context, revoked), context):
                yield response

        return grpc.stream_stream_rpc_method_handler(stream_stream_gen, **kwargs)

    async def stream_stream(requests: Any, context: Any) -> Any:
        return await inner_ss(_checked_stream(requests, context, revoked), context)

    return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)


class PeerBindingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # no stubs
    """Server interceptor of a private run's public server: every request's header must name
    the peer id of the TLS credential it arrived with, and that peer must not be revoked
    (else ``PERMISSION_DENIED``).

    Args:
        revoked: the peers to refuse, read on every call (a list adopted later applies to
            the next call, on connections already open too).
    """

    def __init__(self, revoked: Revocations) -> None:
        self._revoked = revoked

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return bind_handler(handler, self._revoked)


def new_server(limits: ServerLimits, tls: PeerTLS | None) -> grpc.aio.Server:
    """A grpc.aio public server with ``limits``; in a private run with
    :class:`PeerBindingInterceptor`. Create it inside the running loop, then :func:`bind_port`."""
    interceptors = [PeerBindingInterceptor(tls.revocations)] if tls is not None else None
    return make_server(limits, interceptors)


def bind_port(server: grpc.aio.Server, listen: str, tls: PeerTLS | None) -> int:
    """Bind ``listen`` on ``server``: mutual TLS in a private run, insecure in a public one.
    Returns the port, 0 when it could not be bound (gRPC's convention)."""
    if tls is None:
        return int(server.add_insecure_port(listen))
    return int(server.add_secure_port(listen, tls.server_credentials()))
