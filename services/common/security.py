"""Who may call a service: TLS (optionally mutual), a bearer token, and the loopback rule.

Server side, applied by ``create_server`` from the service's ``ServeConfig``:

- ``server_credentials``: TLS with the service's certificate; with ``tls_client_ca`` a caller must
  present a certificate that CA signed (mutual TLS).
- ``TokenAuthInterceptor``: every call must carry ``authorization: Bearer <token>``; a call
  without it, or with another token, ends UNAUTHENTICATED before it reaches the servicer. Health
  checks and reflection stay open, so probes and grpcurl need no secret.
- ``check_bind``: off loopback a service needs TLS and a way to tell callers apart (a token or a
  client CA), unless told ``insecure``; otherwise it refuses to start.

Client side: ``channel`` (grpc.aio) and ``sync_channel`` (the CLI) build a channel that speaks TLS
when given a CA, presents a client certificate for mutual TLS, and adds the token to every call;
``client_channel`` does the same from a ``ClientSecurity`` config.

The token lives in a file (``token_file``, else the file named by $RELAYRL_TOKEN_FILE), never in a
config or on a command line, where ``ps`` and run folders would show it.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import logging
import os
import stat
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc
from relayrl.common.serving import TOKEN_FILE_ENV

if TYPE_CHECKING:
    from relayrl.common.serving import ClientSecurity, ServeConfig

logger = logging.getLogger(__name__)

# Methods callable without a token: liveness/readiness probes and service discovery.
OPEN_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
Options = Sequence[tuple[str, Any]]


class SecurityError(ValueError):
    """A security setting that cannot be used: an unreadable file, a bad token, an open bind."""


# -- files ---------------------------------------------------------------------------------------
MAX_TOKEN_FILE_BYTES = 64 << 10
"""Largest token file read: a token is one word; a bigger file is a wrong path."""
MAX_PEM_FILE_BYTES = 4 << 20
"""Largest certificate, key or CA bundle read (a system CA bundle is a few hundred KiB)."""


def read_file(path: str, what: str, limit: int = MAX_PEM_FILE_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; SecurityError otherwise.

    A config may name any path: ``/dev/zero`` read whole never ends, and a FIFO blocks its
    reader until someone writes. So the file is opened without blocking, checked to be a
    regular file on the open descriptor (no swap between check and read), and read to ``limit``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
            data = _read_upto(fd, limit + 1) if regular else b""
        finally:
            os.close(fd)
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise SecurityError(f"{what}: cannot read {path:.300}: {getattr(e, 'strerror', None) or e}") from None
    if not regular:
        raise SecurityError(f"{what}: {path:.300} is not a regular file")
    if len(data) > limit:
        raise SecurityError(f"{what}: {path:.300} is larger than {limit} bytes")
    return data


def _read_upto(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n and (chunk := os.read(fd, n - got)):
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def token_path(configured: str | None) -> str | None:
    """The token file to use: the configured one, else $RELAYRL_TOKEN_FILE, else None."""
    return configured or os.environ.get(TOKEN_FILE_ENV) or None


def read_token(path: str) -> str:
    """The token in ``path``, surrounding whitespace removed; it must be one printable ASCII word."""
    token = read_file(path, "token file", MAX_TOKEN_FILE_BYTES).decode(errors="replace").strip()
    if not token:
        raise SecurityError(f"token file {path} is empty")
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise SecurityError(f"token file {path}: the token must be one word of printable ASCII")
    return token


# -- the server side -----------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine.

    >>> [is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost")]
    [True, True, True, True, True]
    >>> [is_loopback(h) for h in ("0.0.0.0", "::", "", "10.0.0.5", "gen-0.relayrl")]
    [False, False, False, False, False]
    """
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, tls: bool, insecure: bool, authenticated: bool = True) -> None:
    """Refuse a bind that would let anyone who can reach ``host`` call the service.

    Off loopback, a service needs TLS (``tls``) and a way to know its callers (``authenticated``:
    a bearer token or a client CA), unless ``insecure`` says the network is trusted.
    """
    if insecure or is_loopback(host):
        return
    if not tls:
        raise SecurityError(
            f"refusing to serve on {host} without TLS: anyone who can reach it could call it. Give "
            "--tls-cert and --tls-key (and --token-file or --tls-client-ca), or pass --insecure to "
            "serve plaintext on a network you trust"
        )
    if not authenticated:
        raise SecurityError(
            f"refusing to serve on {host} with TLS but no caller check: give --token-file (or "
            f"${TOKEN_FILE_ENV}) or --tls-client-ca, or pass --insecure to let any caller in"
        )


def server_credentials(cfg: ServeConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from ``cfg`` (mutual when ``tls_client_ca`` is set); None: plaintext."""
    if not (cfg.tls_cert and cfg.tls_key):
        return None
    client_ca = read_file(cfg.tls_client_ca, "serve.tls_client_ca") if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(read_file(cfg.tls_key, "serve.tls_key"), read_file(cfg.tls_cert, "serve.tls_cert"))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def server_security(
    cfg: ServeConfig,
) -> tuple[grpc.ServerCredentials | None, list[grpc.aio.ServerInterceptor]]:
    """Check the bind and read every file ``cfg`` names: (credentials, interceptors) for
    ``create_server``. Raises ``SecurityError`` with the reason, before anything is bound."""
    creds = server_credentials(cfg)
    path = token_path(cfg.token_file)
    interceptors: list[grpc.aio.ServerInterceptor] = [TokenAuthInterceptor(read_token(path))] if path else []
    check_bind(cfg.host, creds is not None, cfg.insecure, authenticated=bool(path or cfg.tls_client_ca))
    if not is_loopback(cfg.host) and creds is None:
        logger.warning(
            "serving %s without TLS (insecure)%s",
            cfg.host,
            ": the bearer token travels in clear" if path else ": any caller that reaches it is served",
        )
    return creds, interceptors


async def _unauthenticated(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (authorization: Bearer <token>)"
    )


# One refusal per RPC shape, so a streaming caller gets its status like any other answer. No
# deserializers: the request of a refused call is never parsed.
_DENY = {
    (False, False): grpc.unary_unary_rpc_method_handler(_unauthenticated),
    (False, True): grpc.unary_stream_rpc_method_handler(_unauthenticated),
    (True, False): grpc.stream_unary_rpc_method_handler(_unauthenticated),
    (True, True): grpc.stream_stream_rpc_method_handler(_unauthenticated),
}


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Let a call through only with ``authorization: Bearer <token>`` (health and reflection are
    open); any other call ends UNAUTHENTICATED. Tokens are compared in constant time."""

    def __init__(self, token: str, open_prefixes: Sequence[str] = OPEN_METHOD_PREFIXES):
        self._token = token.encode()
        self._open = tuple(open_prefixes)

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                text = value.decode(errors="replace") if isinstance(value, bytes) else value
                scheme, _, presented = text.strip().partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    presented.strip().encode(errors="replace"), self._token
                )
        return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler_call_details.method.startswith(self._open) or self.authorized(
            handler_call_details.invocation_metadata
        ):
            return handler
        if handler is None:  # an unknown method: say UNAUTHENTICATED, not what exists
            return _DENY[(False, False)]
        return _DENY[(handler.request_streaming, handler.response_streaming)]


# -- the client side -----------------------------------------------------------------------------
def _channel_credentials(
    tls_ca: str | None, client_cert: str | None, client_key: str | None
) -> grpc.ChannelCredentials | None:
    if not tls_ca:
        if client_cert or client_key:
            raise SecurityError("a client certificate (mutual TLS) needs a CA: it is only sent over TLS")
        return None
    if bool(client_cert) != bool(client_key):
        raise SecurityError("client certificate and key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=read_file(tls_ca, "tls ca"),
        private_key=read_file(client_key, "tls key") if client_key else None,
        certificate_chain=read_file(client_cert, "tls cert") if client_cert else None,
    )


def _with_token(metadata: Any, value: str) -> list[tuple[str, str]]:
    return [*(tuple(kv) for kv in (metadata or ())), ("authorization", value)]


class _AioBearer:
    def __init__(self, token: str):
        self._value = f"Bearer {token}"

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        md = grpc.aio.Metadata(*_with_token(d.metadata, self._value))
        return grpc.aio.ClientCallDetails(d.method, d.timeout, md, d.credentials, d.wait_for_ready)


# grpc.aio files an interceptor under the first call shape it implements, so one class per shape.
class _AioBearerUU(_AioBearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _AioBearerUS(_AioBearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _AioBearerSU(_AioBearer, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _AioBearerSS(_AioBearer, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def channel(
    address: str,
    *,
    tls_ca: str | None = None,
    client_cert: str | None = None,
    client_key: str | None = None,
    token: str | None = None,
    options: Options = (),
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address``: TLS when ``tls_ca`` is given (presenting ``client_cert``
    for mutual TLS), the bearer ``token`` on every call when given."""
    creds = _channel_credentials(tls_ca, client_cert, client_key)
    interceptors = (
        [cls(token) for cls in (_AioBearerUU, _AioBearerUS, _AioBearerSU, _AioBearerSS)] if token else None
    )
    if creds is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(address, creds, options=list(options), interceptors=interceptors)


_SyncDetails = collections.namedtuple(
    "_SyncDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
)


class _SyncCallDetails(_SyncDetails, grpc.ClientCallDetails):
    pass


class _SyncBearer(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str):
        self._value = f"Bearer {token}"

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _SyncCallDetails(
            d.method,
            d.timeout,
            _with_token(d.metadata, self._value),
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def sync_channel(
    address: str,
    *,
    tls_ca: str | None = None,
    client_cert: str | None = None,
    client_key: str | None = None,
    token: str | None = None,
    options: Options = (),
) -> grpc.Channel:
    """``channel`` for blocking code (the ``relayrl status/list/stop`` client)."""
    creds = _channel_credentials(tls_ca, client_cert, client_key)
    ch = (
        grpc.insecure_channel(address, options=list(options))
        if creds is None
        else grpc.secure_channel(address, creds, options=list(options))
    )
    return grpc.intercept_channel(ch, _SyncBearer(token)) if token else ch


def client_settings(security: ClientSecurity | None) -> dict[str, str | None]:
    """``channel``/``sync_channel`` keyword arguments from a ``ClientSecurity`` (None: plaintext),
    with the token read from its file (or $RELAYRL_TOKEN_FILE)."""
    path = token_path(security.token_file if security else None)
    return {
        "tls_ca": security.ca if security else None,
        "client_cert": security.cert if security else None,
        "client_key": security.key if security else None,
        "token": read_token(path) if path else None,
    }


def client_channel(
    address: str, security: ClientSecurity | None = None, options: Options = ()
) -> grpc.aio.Channel:
    """The grpc.aio channel a service client builds from its configured ``ClientSecurity``."""
    return channel(address, **client_settings(security), options=options)
