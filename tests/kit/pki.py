"""A throwaway PKI for tests: a CA, certificates it signs, PEM files on disk (``cryptography``)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER = ExtendedKeyUsageOID.SERVER_AUTH
CLIENT = ExtendedKeyUsageOID.CLIENT_AUTH


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def sans(*hosts: str) -> list[x509.GeneralName]:
    """Subject alternative names: IP addresses as IPs, anything else as DNS names."""
    out: list[x509.GeneralName] = []
    for h in hosts:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def certificate(subject, issuer, key, signer, *, ca=False, names=(), usage=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if names:
        b = b.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    if usage:
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return b.sign(signer, hashes.SHA256())


def write_pem(folder: Path, name: str, cert: x509.Certificate, key) -> tuple[str, str]:
    """Write ``name.pem`` and ``name.key``; returns their paths."""
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert_path), str(key_path)


def new_key():
    return ec.generate_private_key(ec.SECP256R1())


@dataclass
class CA:
    """A CA in ``folder``: ``path`` is its PEM; ``issue`` signs certificates with it."""

    folder: Path
    cert: x509.Certificate
    key: object
    path: str
    name: str = "relayrl test CA"

    @classmethod
    def create(cls, folder: Path, name: str = "relayrl test CA") -> CA:
        key = new_key()
        cert = certificate(name, name, key, key, ca=True)
        path, _ = write_pem(folder, "ca", cert, key)
        return cls(folder, cert, key, path, name)

    def issue(self, name: str, *hosts: str, usage=SERVER) -> tuple[str, str]:
        """A certificate for ``name`` valid for ``hosts``; returns (cert path, key path)."""
        key = new_key()
        return write_pem(
            self.folder,
            name,
            certificate(name, self.name, key, self.key, names=sans(*hosts), usage=usage),
            key,
        )
