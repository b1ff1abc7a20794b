"""TLS for the gRPC transport and the raw data path: PEM files, the chief's and workers' credentials, relays' certificates."""

from __future__ import annotations

from dataclasses import replace

import grpc

from collective import errors as E
from collective._proto import collective_pb2 as pb
from collective.config import TlsFiles

# --- TLS -------------------------------------------------------------------------------------


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """Refuses a half-configured chief: cert without key, or a client CA without a cert."""
    if tls.has("cert") != tls.has("key"):
        raise E.UsageError("--tls-cert and --tls-key go together: give the chief's certificate and its key")
    if tls.has("ca") and not tls.has("cert"):
        raise E.UsageError(
            "--tls-ca (the CA of client certificates) needs the chief's own --tls-cert and --tls-key"
        )
    return grpc.ssl_server_credentials(
        [(tls.read("key"), tls.read("cert"))],
        root_certificates=tls.read("ca"),
        require_client_auth=tls.has("ca"),  # a client CA always means client auth is required
    )

def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    if tls.has("cert") != tls.has("key"):
        raise E.UsageError("--tls-cert and --tls-key go together: give this worker's certificate and its key")
    if not tls.has("ca"):
        raise E.UsageError("--tls-ca is required with TLS: the CA that signed the chief's certificate")
    return grpc.ssl_channel_credentials(
        root_certificates=tls.read("ca"), private_key=tls.read("key"), certificate_chain=tls.read("cert")
    )


# How a worker's relay is served and verified (children dial it by IP address, which no
# certificate names):
# - mutual TLS: the relay serves the worker's own certificate and requires client certificates
#   of the same CA; a child verifies it against the CA under the name the plan gives it, its
#   worker id (the name its certificate must carry to join at all), and the relay lets a child
#   fetch only under the id its certificate names.
# - server-only TLS (workers hold only the CA): the relay serves a certificate made by the worker
#   at start, named RELAY_NAME. The worker sends it to the chief in its join (over the chief's
#   verified TLS channel) and the chief hands it to the relay's children in the plan, so each
#   child trusts exactly that certificate for that relay. Children are admitted by the token and
#   by being in the plan.
RELAY_NAME = "collective-relay"


def self_signed_certificate(name: str = RELAY_NAME, days: int = 7) -> tuple[bytes, bytes]:
    """A new P-256 key and a self-signed certificate for ``name``: (certificate PEM, key PEM)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def relay_server_tls(tls: TlsFiles | None) -> TlsFiles | None:
    """What a worker's relay serves with, given the worker's own TLS settings (see above)."""
    if tls is None or not tls.enabled:
        return None
    if tls.mutual:
        return tls
    cert, key = self_signed_certificate()
    return TlsFiles(cert_pem=cert, key_pem=key)


def relay_client_tls(tls: TlsFiles | None, parent: pb.WorkerInfo) -> TlsFiles | None:
    """How a child dials its parent's relay, given the child's own TLS settings and the plan's
    entry for the parent (see above). Raises ProtocolError if the plan lacks what TLS needs."""
    if tls is None or not tls.enabled:
        return None
    if tls.mutual:
        return replace(tls, server_name=parent.worker_id)
    if not parent.relay_cert:
        raise E.ProtocolError(
            f"the plan gives no TLS certificate for the relay of worker {parent.worker_id!r} "
            f"(rank {parent.rank}); is the chief older than this worker?"
        )
    return TlsFiles(ca_pem=parent.relay_cert, server_name=RELAY_NAME)


def peer_identities(context) -> set[str]:
    """Names in the verified client certificate (CN and SANs); empty without mutual TLS."""
    auth = context.auth_context() or {}
    names = list(auth.get("x509_common_name", [])) + list(auth.get("x509_subject_alternative_name", []))
    return {n.decode() if isinstance(n, bytes) else n for n in names}
