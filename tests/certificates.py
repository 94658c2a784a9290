"""TLS material for tests: a self-signed certificate made with the openssl command."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from shardtrain.settings import Security

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None,
                                   reason="needs the openssl command to make a certificate")


def tls_security(directory) -> Security:
    """A token and a self-signed certificate for 127.0.0.1 (and localhost) that every party trusts."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=shardtrain-test", "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return Security(token="t", tls_cert=str(cert), tls_key=str(key), tls_ca=str(cert))
