"""Throwaway certificates for the TLS tests, made with the openssl CLI in a temporary directory:
a CA, server certificates (with DNS and IP subject alternative names) and client certificates it
signs. EC P-256 keys (fast to make), valid for two days."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl") or "/usr/bin/openssl"
    subprocess.run([openssl, *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@dataclass
class Ca:
    """A CA: its certificate and key, in `directory`."""

    directory: Path
    name: str

    @property
    def cert(self) -> Path:
        return self.directory / f"{self.name}.crt"

    @property
    def key(self) -> Path:
        return self.directory / f"{self.name}.key"

    def issue(self, name: str, *, server: bool, dns: list[str] = (), ips: list[str] = (),
              client_too: bool = False) -> tuple[Path, Path]:
        """A leaf certificate signed by this CA: (certificate, key) PEM files `<name>.crt/.key`;
        a server certificate with `client_too` may also authenticate as a client (Redis Cluster
        nodes use theirs on the TLS cluster bus)."""
        d = self.directory
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        sans = [f"DNS:{n}" for n in dns] + [f"IP:{i}" for i in ips]
        ext = [
            "basicConstraints=critical,CA:FALSE",
            "keyUsage=critical,digitalSignature,keyEncipherment",
            "extendedKeyUsage=" + ("serverAuth" + (",clientAuth" if client_too else "") if server else "clientAuth"),
        ]
        if sans:
            ext.append("subjectAltName=" + ",".join(sans))
        (d / f"{name}.ext").write_text("\n".join(ext) + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", self.cert.name, "-CAkey", self.key.name,
                 "-CAcreateserial", "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext", cwd=d)
        return d / f"{name}.crt", d / f"{name}.key"


def make_ca(directory: Path, name: str = "ca") -> Ca:
    """A self-signed CA in `directory` (created)."""
    directory.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)
    return Ca(directory, name)
