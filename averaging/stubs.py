"""Outbound calls of the ``Averaging`` service, typed (the generated stub is not).

Every component that calls another peer's ``Averaging`` service takes its method from here;
the inbound side is :mod:`swarmavg.averaging.service`.
"""

from __future__ import annotations

import grpc

from swarmavg.averaging.allreduce.wire import deserialize_reply, pass_bytes
from swarmavg.proto import averaging_pb2

_SERVICE = "/swarmavg.v1.Averaging/"
JOIN_GROUP = _SERVICE + "JoinGroup"
REDUCE = _SERVICE + "Reduce"
DOWNLOAD_STATE = _SERVICE + "DownloadState"
"""Full method names, as request signatures cover them (:mod:`swarmavg.dht.auth`)."""


def join_group_method(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamMultiCallable:
    """Outbound ``JoinGroup`` on ``channel`` (typed; the generated stub is not)."""
    return channel.unary_stream(
        JOIN_GROUP,
        request_serializer=averaging_pb2.JoinRequest.SerializeToString,
        response_deserializer=averaging_pb2.JoinResponse.FromString,
    )


def download_state_method(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamMultiCallable:
    """Outbound ``DownloadState`` on ``channel``."""
    return channel.unary_stream(
        DOWNLOAD_STATE,
        request_serializer=averaging_pb2.StateRequest.SerializeToString,
        response_deserializer=averaging_pb2.StateResponse.FromString,
    )


def reduce_method(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamMultiCallable:
    """Outbound ``Reduce``: requests go as prebuilt wire bytes, replies are scanned in place."""
    return channel.stream_stream(
        REDUCE,
        request_serializer=pass_bytes,
        response_deserializer=deserialize_reply,
    )
