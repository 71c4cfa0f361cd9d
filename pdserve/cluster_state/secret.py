"""The cluster secret: what proves that a gRPC call or a registry entry comes from the cluster.

Every process of a cluster (gateway and nodes) is given the same secret (`--cluster-secret`, or
`PDSERVE_<COMMAND>_CLUSTER_SECRET`; `pdserve up` generates one per cluster and hands it to its
children through the environment). With it:

    gRPC     clients add `authorization: Bearer <secret>` to every call (`client_interceptors`, given
             to each channel, or `call_metadata`, given to each call); a node's
             `ClusterSecretServerInterceptor` answers a call without it UNAUTHENTICATED. The
             standard health service stays open: it reveals nothing and mutates nothing, and
             load balancers probe it.
    registry a node writes its entry with `signature` = HMAC-SHA256(secret, the entry's JSON
             without the signature, keys sorted); the gateway ignores entries that do not verify.

Without a secret everything stays open, as for a single user on one machine. The secret travels
in clear text over gRPC without TLS (protos/tls.py): across hosts, give the cluster TLS too.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import secrets

import grpc
from pydantic import BaseModel, ConfigDict, Field, SecretStr

AUTHORIZATION = "authorization"
SIGNATURE = "signature"
# Open without the secret: load balancers and the gateway's direct checks probe it.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


class ClusterSecretOptions(BaseModel):
    """The secret shared by the gateway and the nodes of one cluster."""

    model_config = ConfigDict(frozen=True)

    cluster_secret: SecretStr | None = Field(
        None,
        description="shared by the gateway and every node: internal gRPC calls carry it and registry entries are "
        "signed with it; unset: internal calls are open (pdserve up generates one)",
    )

    def secret_value(self) -> str | None:
        return self.cluster_secret.get_secret_value() if self.cluster_secret else None


def generate_secret() -> str:
    return secrets.token_urlsafe(32)


def _canonical(entry: dict) -> bytes:
    return json.dumps(entry, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_entry(entry: dict, secret: str) -> dict:
    """`entry` (a JSON object, without a signature) with its signature added."""
    signature = hmac.new(secret.encode(), _canonical(entry), hashlib.sha256).hexdigest()
    return {**entry, SIGNATURE: signature}


def verify_entry(entry: dict, secret: str) -> bool:
    """Whether `entry` carries a valid signature over all its other fields (constant-time compare)."""
    signature = entry.get(SIGNATURE) if isinstance(entry, dict) else None
    if not isinstance(signature, str):
        return False
    unsigned = {key: value for key, value in entry.items() if key != SIGNATURE}
    expected = hmac.new(secret.encode(), _canonical(unsigned), hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected.encode(), signature.encode("utf-8", "replace"))


def bearer_matches(metadata, secret: str) -> bool:
    """Whether the call's invocation metadata holds `authorization: Bearer <secret>`."""
    expected = f"Bearer {secret}".encode()
    for key, value in metadata or ():
        if key == AUTHORIZATION:
            given = value.encode("utf-8", "replace") if isinstance(value, str) else bytes(value)
            return hmac.compare_digest(expected, given)
    return False


def call_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a call carries to prove it comes from the cluster: given per call on a hot
    path instead of an interceptor, whose wrapper costs every streamed message of the call a
    further async-generator step (`ClusterBackend`: a token stream's messages)."""
    return ((AUTHORIZATION, f"Bearer {secret}"),) if secret else ()


class _SecretHeader:
    def __init__(self, secret: str) -> None:
        self._header = call_metadata(secret)

    def _with_secret(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._header)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# One class per kind of call: a channel files each interceptor under the first kind it implements.
class _UnaryUnary(_SecretHeader, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._with_secret(client_call_details), request)


class _UnaryStream(_SecretHeader, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._with_secret(client_call_details), request)


class _StreamUnary(_SecretHeader, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_secret(client_call_details), request_iterator)


class _StreamStream(_SecretHeader, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._with_secret(client_call_details), request_iterator)


def client_interceptors(secret: str | None) -> list[grpc.aio.ClientInterceptor]:
    """What a channel to a node needs so that every call carries the secret; nothing without one."""
    if not secret:
        return []
    return [kind(secret) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


class ClusterSecretServerInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to every call without the secret, except the open health service."""

    def __init__(self, secret: str) -> None:
        self._secret = secret

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        if bearer_matches(handler_call_details.invocation_metadata, self._secret):
            return handler
        return _refusing(handler)


async def _refuse(request_or_iterator, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster secret")


async def _refuse_stream(request_or_iterator, context):
    await _refuse(request_or_iterator, context)
    yield  # an async generator, as a streaming handler must be


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that refuses the call before reading it."""
    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse_stream, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse_stream, **codec)
    return grpc.unary_unary_rpc_method_handler(_refuse, **codec)


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server (the gateway, a node) to this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False
