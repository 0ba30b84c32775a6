"""TLS for the HTTP and gRPC APIs from a certificate and key file, read again when they change.

Both files are PEM (cert-manager's `tls.crt` and `tls.key` in a Kubernetes Secret are). The
HTTP server keeps one `ssl.SSLContext` whose certificate chain is loaded again when the files
change, so new connections get the renewed certificate while open ones go on; the gRPC server
asks for the current pair at each handshake (`grpc.dynamic_ssl_server_credentials`). The router
looks at the files as often as at its keys file (router/server.py). TLS 1.2 is the oldest
version offered.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class TlsFiles:
    def __init__(self, cert_file: str | Path, key_file: str | Path) -> None:
        self.cert_file, self.key_file = Path(cert_file), Path(key_file)
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._pair = self._read()  # (key, cert) as gRPC takes them
        self._grpc_served: tuple[bytes, bytes] | None = None
        self.ssl_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ssl_context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.ssl_context.load_cert_chain(self.cert_file, self.key_file)

    def _stat(self) -> tuple[tuple[int, int, int], ...]:
        stats = (os.stat(self.cert_file), os.stat(self.key_file))
        return tuple((st.st_ino, st.st_mtime_ns, st.st_size) for st in stats)

    def _read(self) -> tuple[bytes, bytes]:
        return self.key_file.read_bytes(), self.cert_file.read_bytes()

    def reload_if_changed(self) -> bool:
        """Load the files again if they changed; whether they did. A pair that does not load
        (a half-written renewal, say) keeps the one in use, and is logged."""
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return False
            self.ssl_context.load_cert_chain(self.cert_file, self.key_file)
            pair = self._read()
        except (OSError, ssl.SSLError) as exc:
            log.warning("TLS files not reloaded, keeping the certificate in use: %s", exc)
            return False
        with self._lock:
            self._stamp, self._pair = stamp, pair
        log.warning("TLS certificate reloaded from %s", self.cert_file)
        return True

    def grpc_credentials(self) -> Any:
        """Server credentials that serve the current pair at each handshake."""
        import grpc

        def fetch() -> Any:
            with self._lock:
                pair = self._pair
            if pair == self._grpc_served:
                return None  # grpc keeps what it has
            self._grpc_served = pair
            return grpc.ssl_server_certificate_configuration([pair])

        with self._lock:
            self._grpc_served = self._pair
            initial = grpc.ssl_server_certificate_configuration([self._pair])
        return grpc.dynamic_ssl_server_credentials(initial, fetch)
