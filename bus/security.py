"""CURVE security for the bus: encryption and client authentication (zmq.auth).

A curve directory holds the keys of one bus, made by `ensure_curve_dir` (mode 0700)::

    DIR/server.key, DIR/server.key_secret      the broker's keypair
    DIR/client.key, DIR/client.key_secret      the keypair every client uses by default
    DIR/authorized/*.key                       public keys the broker lets in

The broker (`CurveServer`) runs a ZAP authenticator that admits only the public
keys in ``authorized/``; a client whose key is not there never completes the
handshake, so it can neither publish nor receive anything. Clients (publishers,
subscribers, command receivers, state requests) take a `CurveConfig`: the
server's public key and their own keypair. To admit another client keypair, copy
its ``NAME.key`` into ``authorized/`` and restart the broker.

ipc buses stay without CURVE by default: their 0700 run directory already keeps
other users out. CURVE can still be applied to them.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from evtrain.errors import UsageError

log = structlog.get_logger("evtrain.bus.security")

CURVE_DIR_ENV = "EVTRAIN_CURVE_DIR"
SERVER_NAME = "server"
CLIENT_NAME = "client"
AUTHORIZED_DIR = "authorized"


@dataclass(frozen=True, repr=False)
class CurveConfig:
    """What a client needs to talk to a CURVE broker: its public key and our keypair.

    Keys are the 40-character Z85 forms (bytes), as `zmq.auth.load_certificate`
    returns them.
    """

    server_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client of the broker (call before ``connect``)."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret

    def __repr__(self) -> str:  # never print the secret
        return f"CurveConfig(server_public={self.server_public!r}, public={self.public!r})"


@dataclass(frozen=True, repr=False)
class CurveServer:
    """The broker's side: its keypair and the directory of authorized client keys."""

    public: bytes
    secret: bytes
    authorized_dir: Path

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server (call before ``bind``)."""
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret

    def start_authenticator(self, context: zmq.Context) -> ThreadAuthenticator:
        """Start the ZAP handler of ``context`` that admits only authorized client keys.

        One per context: ZAP handlers bind a fixed inproc address.
        """
        keys = sorted(self.authorized_dir.glob("*.key"))
        if not keys:
            raise UsageError(f"no authorized client keys in {self.authorized_dir}")
        auth = ThreadAuthenticator(context)
        auth.start()
        # configure_curve reads the directory once: keys added later need a restart.
        auth.configure_curve(domain="*", location=str(self.authorized_dir))
        log.info("curve authentication on", authorized_keys=len(keys))
        return auth

    def __repr__(self) -> str:
        return f"CurveServer(public={self.public!r}, authorized_dir={str(self.authorized_dir)!r})"


def ensure_curve_dir(directory: str | Path) -> Path:
    """Create ``directory`` (mode 0700) with server and client keys unless they exist.

    Existing keys are kept, so every run of the same bus can reuse them; the client
    public key is authorized on creation.
    """
    path = Path(directory).expanduser().absolute()
    try:
        path.mkdir(mode=stat.S_IRWXU, parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create curve directory {str(path)!r}: {exc}") from None
    _check_private(path)
    authorized = path / AUTHORIZED_DIR
    authorized.mkdir(mode=stat.S_IRWXU, exist_ok=True)
    for name in (SERVER_NAME, CLIENT_NAME):
        if not (path / f"{name}.key_secret").exists():
            _, secret_file = zmq.auth.create_certificates(path, name)
            os.chmod(secret_file, stat.S_IRUSR | stat.S_IWUSR)
            log.info("curve keys created", name=name, directory=str(path))
    client_public = path / f"{CLIENT_NAME}.key"
    if not any(authorized.glob("*.key")):
        shutil.copyfile(client_public, authorized / client_public.name)
    return path


def load_server(directory: str | Path) -> CurveServer:
    """The broker's `CurveServer` from a curve directory (`UsageError` if incomplete)."""
    path = _existing_dir(directory)
    public, secret = _load(path / f"{SERVER_NAME}.key_secret", need_secret=True)
    return CurveServer(public=public, secret=secret, authorized_dir=path / AUTHORIZED_DIR)


def load_client(directory: str | Path, name: str = CLIENT_NAME) -> CurveConfig:
    """A client's `CurveConfig` from a curve directory: keypair ``name``, server's public key."""
    path = _existing_dir(directory)
    server_public, _ = _load(path / f"{SERVER_NAME}.key", need_secret=False)
    public, secret = _load(path / f"{name}.key_secret", need_secret=True)
    return CurveConfig(server_public=server_public, public=public, secret=secret)


def curve_from_env(name: str = CLIENT_NAME) -> CurveConfig | None:
    """The client `CurveConfig` from ``$EVTRAIN_CURVE_DIR``, or None when it is unset."""
    directory = os.environ.get(CURVE_DIR_ENV)
    return load_client(directory, name) if directory else None


def _existing_dir(directory: str | Path) -> Path:
    path = Path(directory).expanduser().absolute()
    if not path.is_dir():
        raise UsageError(f"curve directory {str(path)!r} does not exist")
    _check_private(path)
    return path


def _check_private(path: Path) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(
            f"curve directory {str(path)!r} is accessible by other users (mode {mode:04o}); "
            "run chmod 700 on it"
        )


def _load(file: Path, *, need_secret: bool) -> tuple[bytes, bytes]:
    if not file.is_file():
        raise UsageError(f"curve key file {str(file)!r} is missing")
    try:
        public, secret = zmq.auth.load_certificate(file)
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read curve key file {str(file)!r}: {exc}") from None
    if public is None or (need_secret and secret is None):
        raise UsageError(f"curve key file {str(file)!r} holds no usable key")
    return public, secret or b""
