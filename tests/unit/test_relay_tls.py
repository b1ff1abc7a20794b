"""How a worker's relay is served and dialled under each TLS mode (see SECURITY.md, "Relays")."""

from __future__ import annotations

import pytest
from cryptography import x509

from collective._proto import collective_pb2 as pb
from collective.errors import ProtocolError
from collective.transport.grpc import RELAY_NAME, TlsFiles, relay_client_tls, relay_server_tls

PARENT = pb.WorkerInfo(rank=0, worker_id="worker-1", relay_address="10.0.0.2:4321")


def test_without_tls_relays_are_plaintext_both_ways():
    assert relay_server_tls(None) is None and relay_server_tls(TlsFiles()) is None
    assert relay_client_tls(TlsFiles(), PARENT) is None


def test_mutual_tls_relays_serve_the_worker_certificate_checked_under_the_parent_id():
    tls = TlsFiles(ca="ca.pem", cert="w.pem", key="w.key")
    assert relay_server_tls(tls) is tls
    dial = relay_client_tls(tls, PARENT)
    assert dial.server_name == "worker-1" and (dial.ca, dial.cert, dial.key) == ("ca.pem", "w.pem", "w.key")


def test_server_only_tls_relays_serve_a_certificate_of_their_own_that_children_trust_alone():
    served = relay_server_tls(TlsFiles(ca="ca.pem"))
    cert = x509.load_pem_x509_certificate(served.cert_pem)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert names == [RELAY_NAME] and b"PRIVATE KEY" in served.key_pem
    assert not served.has("ca")  # no client certificates: children have none
    assert relay_server_tls(TlsFiles(ca="ca.pem")).cert_pem != served.cert_pem  # one per process
    parent = pb.WorkerInfo(rank=0, worker_id="worker-1", relay_address="10.0.0.2:4321", relay_cert=served.cert_pem)
    dial = relay_client_tls(TlsFiles(ca="ca.pem"), parent)
    assert dial.read("ca") == served.cert_pem and dial.server_name == RELAY_NAME
    assert dial.ca is None  # the chief's CA does not vouch for a relay


def test_server_only_tls_refuses_a_plan_without_the_relay_certificate():
    with pytest.raises(ProtocolError, match="no TLS certificate for the relay of worker 'worker-1' \\(rank 0\\)"):
        relay_client_tls(TlsFiles(ca="ca.pem"), PARENT)
