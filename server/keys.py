"""CurveZMQ keys for a cluster: one server keypair all daemons present, and
one client keypair every daemon and ``ptcctl`` use to connect. A peer
without the client secret key is refused by the daemons' authenticator.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from ptcfs.errors import InvalidConfig

__all__ = ["CurveKeys", "generate_keys", "load_keys"]


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    public_dir: Path  # holds the client public key the authenticator allows


def generate_keys(directory: str | Path) -> Path:
    """Create the cluster's keys in ``directory`` (refuses to overwrite)."""
    d = Path(directory)
    if (d / "server.key_secret").exists():
        raise InvalidConfig(f"{d} has keys already; remove them first to make new ones")
    (d / "public").mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(str(d), "server")
    zmq.auth.create_certificates(str(d), "client")
    (d / "client.key").rename(d / "public" / "client.key")
    for f in d.glob("*.key_secret"):
        f.chmod(0o600)
    return d


def load_keys(directory: str | Path) -> CurveKeys:
    d = Path(directory)
    if not zmq.has("curve"):
        raise InvalidConfig("this libzmq was built without CURVE support")
    try:
        sp, ss = zmq.auth.load_certificate(str(d / "server.key_secret"))
        cp, cs = zmq.auth.load_certificate(str(d / "client.key_secret"))
    except (OSError, ValueError) as e:
        raise InvalidConfig(f"cannot load CURVE keys from {d}: {e} "
                            "(make them with: ptcctl keys generate DIR)") from None
    if ss is None or cs is None:
        raise InvalidConfig(f"{d}: secret keys missing")
    return CurveKeys(sp, ss, cp, cs, d / "public")
