"""CurveZMQ keys for a cluster.

The scheme, the simplest that still refuses strangers: one *server*
keypair that every daemon presents, and one *client* keypair that every
daemon (fetching from its peers) and ``ptcctl`` use to connect. Each daemon
runs a ZAP authenticator that admits only the client public keys in
``DIR/public``. A peer without the cluster's client secret key never gets
a connection, so its requests time out (PeerError). All traffic of an
admitted peer is encrypted.

Files in ``DIR`` (``ptcctl keys generate DIR`` makes them; ship the whole
directory to every host and point ``curve_secret_dir`` at it)::

    server.key, server.key_secret    the daemons' keypair
    client.key_secret                the clients' keypair (public part inside)
    public/client.key                the client public key the daemons admit
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
    """The cluster's keys, loaded; ``public_dir`` holds the client public
    key(s) the daemons' authenticator admits."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    public_dir: Path


def generate_keys(directory: str | Path) -> Path:
    """Create a cluster's keys in ``directory`` (made if missing, mode 0700)
    and return it. Refuses to overwrite keys that are there already, and a
    folder that holds anything else (it would become its owner's only)."""
    d = Path(directory)
    if (d / "server.key_secret").exists() or (d / "client.key_secret").exists():
        raise InvalidConfig(f"{d} has keys already; remove them first to make new ones "
                            "(every host then needs the new directory)")
    if d.is_dir() and any(d.iterdir()):
        raise InvalidConfig(f"{d} is not empty; give a new or empty folder for the keys "
                            "(it is made readable by its owner only)")
    _check_curve()
    try:
        (d / "public").mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)
        zmq.auth.create_certificates(str(d), "server")
        zmq.auth.create_certificates(str(d), "client")
        (d / "client.key").rename(d / "public" / "client.key")
        for f in d.glob("*.key_secret"):
            f.chmod(0o600)
    except OSError as e:
        raise InvalidConfig(f"cannot write CURVE keys in {d}: {e}") from e
    return d


def load_keys(directory: str | Path) -> CurveKeys:
    """The keys of ``directory`` (the cluster file's ``curve_secret_dir``)."""
    d = Path(directory)
    _check_curve()
    try:
        sp, ss = zmq.auth.load_certificate(str(d / "server.key_secret"))
        cp, cs = zmq.auth.load_certificate(str(d / "client.key_secret"))
    except (OSError, ValueError) as e:
        raise InvalidConfig(f"cannot load CURVE keys from {d}: {e} "
                            "(make them with: ptcctl keys generate DIR)") from None
    if ss is None or cs is None:
        raise InvalidConfig(f"{d}: the secret keys are missing from server.key_secret or "
                            "client.key_secret")
    if not (d / "public" / "client.key").is_file():
        raise InvalidConfig(f"{d}/public/client.key is missing: the daemons would admit "
                            "no client (make the keys with: ptcctl keys generate DIR)")
    return CurveKeys(sp, ss, cp, cs, d / "public")


def _check_curve() -> None:
    if not zmq.has("curve"):
        raise InvalidConfig("this libzmq was built without CURVE support; install a pyzmq "
                            "wheel (it bundles libsodium) or build libzmq with libsodium")
