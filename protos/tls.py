"""Optional TLS for internal gRPC: the gateway and prefill nodes dialing nodes, nodes serving; the
same files secure the decode nodes' token streams to the gateway (protos/token_stream.py).

Every process of a cluster gets the same three paths (`--grpc-tls-cert`, `--grpc-tls-key`,
`--grpc-tls-ca`, or `PDSERVE_<COMMAND>_GRPC_TLS_*`; `pdserve up` hands its own to its children):

    none set   plaintext, as on one machine
    cert, key  nodes serve TLS with them; clients present them (mutual TLS when the nodes have a CA)
    ca         clients trust only servers whose certificate it signed, and nodes require a client
               certificate it signed; without it clients trust the system's roots

Certificates must name the host each node advertises (an IP address or DNS name in subjectAltName).
It lives under protos/, the contract both sides import: kvtransfer may not import cluster_state.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from pathlib import Path

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator


class GrpcTlsOptions(BaseModel):
    """File paths (PEM) for TLS on internal gRPC; all unset: plaintext."""

    model_config = ConfigDict(frozen=True)

    grpc_tls_cert: str | None = Field(
        None, description="PEM certificate chain: nodes serve internal gRPC with it, clients present it"
    )
    grpc_tls_key: str | None = Field(None, description="PEM private key of --grpc-tls-cert")
    grpc_tls_ca: str | None = Field(
        None,
        description="PEM CA: clients trust only node certificates it signed, nodes require client certificates "
        "it signed (mutual TLS); unset with a cert: the system's roots, no client certificates",
    )

    @model_validator(mode="after")
    def _cert_with_key(self) -> GrpcTlsOptions:
        if (self.grpc_tls_cert is None) != (self.grpc_tls_key is None):
            raise ValueError("give --grpc-tls-cert and --grpc-tls-key together")
        return self

    @property
    def tls_enabled(self) -> bool:
        return any((self.grpc_tls_cert, self.grpc_tls_key, self.grpc_tls_ca))

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """A node's: None without TLS; with a CA, clients must present a certificate it signed."""
        if not self.tls_enabled:
            return None
        if self.grpc_tls_cert is None or self.grpc_tls_key is None:
            raise ValueError("a node serving TLS needs --grpc-tls-cert and --grpc-tls-key")
        ca = _read(self.grpc_tls_ca)
        return grpc.ssl_server_credentials(
            [(_read(self.grpc_tls_key), _read(self.grpc_tls_cert))],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """A client's (gateway, prefill node): None without TLS."""
        if not self.tls_enabled:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.grpc_tls_ca),
            private_key=_read(self.grpc_tls_key),
            certificate_chain=_read(self.grpc_tls_cert),
        )

    def server_ssl_context(self) -> ssl.SSLContext | None:
        """The same as `server_credentials`, for a node's token stream (protos/token_stream.py)."""
        if not self.tls_enabled:
            return None
        if self.grpc_tls_cert is None or self.grpc_tls_key is None:
            raise ValueError("a node serving TLS needs --grpc-tls-cert and --grpc-tls-key")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.grpc_tls_ca)
        context.load_cert_chain(self.grpc_tls_cert, self.grpc_tls_key)
        if self.grpc_tls_ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_ssl_context(self) -> ssl.SSLContext | None:
        """The same as `channel_credentials`, for the gateway's token streams: the node's
        certificate must name the host it advertises."""
        if not self.tls_enabled:
            return None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.grpc_tls_ca)
        if self.grpc_tls_cert is not None and self.grpc_tls_key is not None:
            context.load_cert_chain(self.grpc_tls_cert, self.grpc_tls_key)
        return context


def open_channel(
    address: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, object]] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """An asyncio channel to a node: TLS with `credentials`, plaintext without."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=list(interceptors) or None)
    return grpc.aio.secure_channel(address, credentials, options=list(options), interceptors=list(interceptors) or None)


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None
