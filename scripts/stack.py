"""Start and stop the whole service on this machine: Redis (if needed), migrations, the web process
and one Celery worker per queue, with the command lines of ``project.processes``.

Used by ``make demo``/``make run`` and by the end-to-end tests. Each process logs to
``$VAR_DIR/log/<name>.log``. Stopping sends SIGTERM to each process group, then SIGKILL.

    python -m scripts.stack run          # start everything, wait for Ctrl-C
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from project import processes  # noqa: E402


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_answers(url: str) -> bool:
    """True when a Redis server answers PING at ``url`` within a second."""
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1).ping())
    except Exception:
        return False


class Stack:
    """The service's processes, started in ``start`` and stopped in ``stop`` (or ``with Stack(...)``).

    Args:
        var_dir: state folder (database, blobs, embedded Qdrant, logs).
        env: extra environment for every process (``CLIP_PRETRAINED``, ``DATABASE_URL``, ...).
        private_redis: always start a private redis-server (tests), instead of using ``REDIS_URL``
            when it answers.
        only: names from ``project.processes.commands()`` to start (default: all).
    """

    def __init__(self, var_dir: Path, env: dict | None = None, *, private_redis: bool = False,
                 only: tuple[str, ...] | None = None, log=print) -> None:
        self.var_dir = Path(var_dir).resolve()
        self.env = {**os.environ, **(env or {})}
        self.env["VAR_DIR"] = str(self.var_dir)
        self.env.setdefault("WEB_PORT", str(free_port()))
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), self.env.get("PYTHONPATH")]))
        self.env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), self.env.get("PATH", "")])
        self.private_redis = private_redis
        self.only = only
        self.log = log
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def web_url(self) -> str:
        return f"http://127.0.0.1:{self.env['WEB_PORT']}"

    def manage(self, *args: str, capture: bool = True) -> str:
        """Run ``manage.py`` with the stack's environment; returns stdout. Raises on failure."""
        out = subprocess.run([sys.executable, str(ROOT / "manage.py"), *args], env=self.env, cwd=ROOT,
                             text=True, capture_output=capture)
        if out.returncode:
            raise RuntimeError(f"manage.py {' '.join(args)} failed ({out.returncode}): {out.stderr or ''}")
        return out.stdout if capture else ""

    def _spawn(self, name: str, cmd: list[str] | str) -> subprocess.Popen:
        logdir = self.var_dir / "log"
        logdir.mkdir(parents=True, exist_ok=True)
        logf = open(logdir / f"{name}.log", "ab")
        argv = cmd.split() if isinstance(cmd, str) else cmd
        if argv[0] in ("celery", "gunicorn"):
            argv = [str(Path(sys.executable).parent / argv[0]), *argv[1:]]
        p = subprocess.Popen(argv, env=self.env, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs[name] = p
        return p

    def ensure_redis(self) -> None:
        """Use ``REDIS_URL`` if it answers (unless ``private_redis``); else start a private server."""
        url = self.env.get("REDIS_URL", "redis://127.0.0.1:6379/0")
        if not self.private_redis and redis_answers(url):
            self.env["REDIS_URL"] = url
            return
        server = shutil.which("redis-server")
        if server is None:
            raise SystemExit(
                f"no Redis answers at {url} and redis-server is not installed: install it "
                f"(apt-get install redis-server, brew install redis) or set REDIS_URL to a running server"
            )
        port = free_port()
        folder = self.var_dir / "redis"
        folder.mkdir(parents=True, exist_ok=True)
        self._spawn("redis", [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
                              "--save", "", "--appendonly", "no"])
        url = f"redis://127.0.0.1:{port}/0"
        for _ in range(100):
            if redis_answers(url):
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("private redis-server did not start; see its log")
        self.env["REDIS_URL"] = url
        self.log(f"started a private Redis at {url}")

    def start(self, timeout: float = 180) -> "Stack":
        """Redis, migrations, then the processes; returns when the web answers and each worker pings."""
        self.var_dir.mkdir(parents=True, exist_ok=True)
        self.ensure_redis()
        self.manage("migrate", "--noinput")
        cmds = processes.commands(self.env)
        for name, cmd in cmds.items():
            if self.only is None or name in self.only:
                self._spawn(name, cmd)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        """Block until the web answers ``/healthz`` and every started worker answers a ping."""
        deadline = time.monotonic() + timeout
        names = {n.removeprefix("worker-") for n in self.procs if n.startswith("worker-")}
        web = "web" in self.procs
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}; see {self.var_dir}/log/{name}.log")
            if web:
                with contextlib.suppress(Exception):
                    urllib.request.urlopen(self.web_url + "/healthz", timeout=1)
                    web = False
            if names:
                names -= self.ping_workers()
            if not web and not names:
                return
            time.sleep(0.3)
        raise TimeoutError(f"not ready after {timeout} s: workers {sorted(names)}, web pending={web}")

    def ping_workers(self) -> set[str]:
        """Names (``interactive``, ``bulk``, ``vectors``) of the workers that answer a ping now."""
        from celery import Celery

        app = Celery(broker=self.env["REDIS_URL"], backend=self.env["REDIS_URL"])
        try:
            replies = app.control.ping(timeout=0.5)
        finally:
            app.close()
        return {next(iter(r)).split("@")[0] for r in replies}

    def stop(self) -> None:
        """SIGTERM every process group (workers finish or requeue), then SIGKILL stragglers."""
        for name, p in reversed(list(self.procs.items())):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()

    def __enter__(self) -> "Stack":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> None:
    """``python -m scripts.stack run``: start everything and wait for Ctrl-C."""
    var = Path(os.environ.get("VAR_DIR", ROOT / "var"))
    with Stack(var) as stack:
        print(f"web at {stack.web_url}; logs in {var}/log; Ctrl-C stops")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


if __name__ == "__main__":
    main()
