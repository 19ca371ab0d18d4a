"""TLS material for a client or server of the shard protocol: one CA, optionally a certificate
and key (mutual TLS). Makes gRPC channel credentials and ``ssl`` contexts (the relay's byte
stream) from the same three PEM files."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from ..errors import DgrError


@dataclass(frozen=True)
class TlsFiles:
    ca: Path                       # PEM CA that signed the peers' certificates
    cert: Path | None = None       # our certificate (mTLS), PEM
    key: Path | None = None        # its private key, PEM

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise DgrError("TLS needs both a certificate and its key (or neither, for server-only TLS)")
        for p in (self.ca, self.cert, self.key):
            if p is not None and not Path(p).is_file():
                raise DgrError(f"TLS file {p} not found")

    def _read(self, p: Path | None) -> bytes | None:
        return None if p is None else Path(p).read_bytes()

    def grpc_credentials(self):
        """grpc.ChannelCredentials verifying the server by ``ca`` and presenting ``cert``."""
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca),
                                            private_key=self._read(self.key),
                                            certificate_chain=self._read(self.cert))

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca))
        if self.cert is not None:
            ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx

    def server_context(self, *, require_client_cert: bool = True) -> ssl.SSLContext:
        if self.cert is None:
            raise DgrError("a TLS server needs a certificate and key")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.ca))
        ctx.load_cert_chain(str(self.cert), str(self.key))
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE
        return ctx
