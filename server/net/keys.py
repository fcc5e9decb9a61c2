"""CurveZMQ keys for a cluster: one keypair for the daemons, one per client.

The daemons present the *server* keypair, and use it too when they call
each other (their mounts as well): a request signed with it is a daemon's.
Every other caller (``ptcctl``, the training client) holds a *client*
keypair of its own, by name; the daemons admit the client public keys in
``DIR/public`` (re-read at every handshake: :mod:`ptcfs.server.auth`), so
adding, rotating or removing a client key takes effect on the daemons'
next connection, without a restart. A peer without an admitted key never
gets a connection: its requests time out (PeerError). Which client keys
may change a job is the job's record (``writers``; ``ptcctl job allow``).

Files in ``DIR`` (``ptcctl keys generate DIR`` makes the server keypair and
the client key ``client``; ``ptcctl keys new/rotate NAME`` more; ship
``server.key`` and ``public/`` to every host, ``server.key_secret`` to
daemons only, and ``clients/NAME.key_secret`` to NAME's user only)::

    server.key, server.key_secret    the daemons' keypair
    clients/NAME.key_secret          client NAME's keypair (public part inside)
    public/NAME.key                  the client public keys the daemons admit

A client picks its key with ``PTC_CLIENT_KEY`` (a name in ``DIR/clients``,
or the path of a ``.key_secret`` file; default ``client``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from ptcfs import settings
from ptcfs.errors import InvalidConfig

__all__ = ["CurveKeys", "DAEMON", "generate_keys", "load_keys", "new_client_key",
           "client_keys", "check_key_name"]

#: The name requests signed with the server keypair go by (no client key has it).
DAEMON = "@daemon"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class CurveKeys:
    """Keys loaded for one process: the server's public key (and secret, for
    a daemon), the keypair it connects with and that keypair's ``name``
    (:data:`DAEMON` for daemons); ``public_dir`` holds the client public
    keys the daemons admit."""

    server_public: bytes
    server_secret: bytes | None
    client_public: bytes
    client_secret: bytes
    public_dir: Path
    name: str = DAEMON


def check_key_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise InvalidConfig(f"bad key name {name!r}: use letters, digits, '_', '.' and '-', "
                            "starting with a letter or digit, at most 64 characters")
    return name


def generate_keys(directory: str | Path) -> Path:
    """Create a cluster's keys in ``directory`` (made if missing, mode 0700):
    the server keypair and client key ``client``; return it. Refuses to
    overwrite keys that are there already, and a folder that holds anything
    else (it would become its owner's only)."""
    d = Path(directory)
    if (d / "server.key_secret").exists():
        raise InvalidConfig(f"{d} has keys already; remove them first to make new ones "
                            "(every host then needs the new directory)")
    if d.is_dir() and any(d.iterdir()):
        raise InvalidConfig(f"{d} is not empty; give a new or empty folder for the keys "
                            "(it is made readable by its owner only)")
    _check_curve()
    try:
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)
        zmq.auth.create_certificates(str(d), "server")
        (d / "server.key_secret").chmod(0o600)
    except OSError as e:
        raise InvalidConfig(f"cannot write CURVE keys in {d}: {e}") from e
    new_client_key(d, "client")
    return d


def new_client_key(directory: str | Path, name: str, replace: bool = False) -> Path:
    """Make client key ``name`` in ``directory`` (``clients/NAME.key_secret``,
    admitted through ``public/NAME.key``); ``replace``: a new keypair for a
    key that exists (rotation: the old one is refused from the daemons'
    next handshake). Returns the secret key's path."""
    d = Path(directory)
    check_key_name(name)
    secret, public = d / "clients" / f"{name}.key_secret", d / "public" / f"{name}.key"
    if not replace and (secret.exists() or public.exists()):
        raise InvalidConfig(f"client key {name!r} exists in {d}; rotate it with: "
                            f"ptcctl keys rotate {name}")
    if replace and not public.exists():
        raise InvalidConfig(f"no client key {name!r} in {d} (ptcctl keys list)")
    _check_curve()
    try:
        for sub in ("clients", "public", ".new"):
            (d / sub).mkdir(mode=0o700, exist_ok=True)
        tmp = d / ".new"
        zmq.auth.create_certificates(str(tmp), name)
        (tmp / f"{name}.key_secret").chmod(0o600)
        # the public key last: the daemons admit the new key once its secret is there
        os.replace(tmp / f"{name}.key_secret", secret)
        os.replace(tmp / f"{name}.key", public)
        tmp.rmdir()
    except OSError as e:
        raise InvalidConfig(f"cannot write client key {name!r} in {d}: {e}") from e
    return secret


def client_keys(directory: str | Path) -> dict[str, bytes]:
    """The client keys the daemons admit: name → public key (z85), read now."""
    out: dict[str, bytes] = {}
    pub = Path(directory) / "public"
    try:
        files = sorted(pub.glob("*.key"))
    except OSError:
        return out
    for f in files:
        try:
            key, _ = zmq.auth.load_certificate(str(f))
        except (OSError, ValueError):
            continue  # being replaced, or not a key: admit nothing for it
        out[f.stem] = key
    return out


def load_keys(directory: str | Path, daemon: bool = False) -> CurveKeys:
    """The keys of ``directory`` (the cluster file's ``curve_secret_dir``) for
    a daemon (``daemon``: it connects with the server keypair) or a client
    (its keypair from ``PTC_CLIENT_KEY``)."""
    d = Path(directory)
    _check_curve()
    try:
        if daemon:
            sp, ss = zmq.auth.load_certificate(str(d / "server.key_secret"))
            if ss is None:
                raise InvalidConfig(f"{d}: the secret key is missing from server.key_secret")
            return CurveKeys(sp, ss, sp, ss, d / "public")
        sp, _ = zmq.auth.load_certificate(str(d / "server.key"))
        name, path = _client_key_path(d)
        cp, cs = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise InvalidConfig(f"cannot load CURVE keys from {d}: {e} "
                            "(make them with: ptcctl keys generate DIR)") from None
    if cs is None:
        raise InvalidConfig(f"{path}: the secret key is missing")
    return CurveKeys(sp, None, cp, cs, d / "public", name)


def _client_key_path(d: Path) -> tuple[str, Path]:
    """(name, path) of the client key this process uses (``PTC_CLIENT_KEY``)."""
    given = str(settings.get("PTC_CLIENT_KEY"))
    if "/" in given or given.endswith(".key_secret"):
        p = Path(given)
        return p.name.removesuffix(".key_secret"), p
    path = d / "clients" / f"{check_key_name(given)}.key_secret"
    if not path.exists() and given == "client" and (d / "client.key_secret").exists():
        path = d / "client.key_secret"  # a key directory made before client keys had names
    return given, path


def _check_curve() -> None:
    if not zmq.has("curve"):
        raise InvalidConfig("this libzmq was built without CURVE support; install a pyzmq "
                            "wheel (it bundles libsodium) or build libzmq with libsodium")
