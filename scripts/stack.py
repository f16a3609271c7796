"""Start and stop the whole service on this machine: Redis (if needed), migrations, the web process
and one Celery worker per queue, with the command lines of ``project.processes``.

Used by ``make demo``/``make run`` and by the end-to-end tests. Each process logs to
``$VAR_DIR/log/<name>.log``. Stopping sends SIGTERM to each process group, then SIGKILL.

    python -m scripts.stack run          # start everything, wait for Ctrl-C, SIGTERM or SIGHUP

Every process runs in its own session (``start_new_session``), so a signal sent to this script
alone never reaches them: ``main`` turns SIGTERM and SIGHUP into the same orderly stop as Ctrl-C.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from project import configuration, lanes, processes  # noqa: E402


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
        deployment: ``"split"`` (a): one worker per queue (``processes.commands``); ``"shared"`` (b):
            one worker for both embedding lanes (``processes.shared_commands``).
        process_env: extra environment per process name, e.g. ``{"worker-bulk": {"TORCH_THREADS": "1"}}``.
    """

    def __init__(self, var_dir: Path, env: dict | None = None, *, private_redis: bool = False,
                 only: tuple[str, ...] | None = None, log=print, deployment: str = "split",
                 process_env: dict[str, dict] | None = None) -> None:
        if deployment not in ("split", "shared"):
            raise ValueError(f"deployment must be 'split' or 'shared', not {deployment!r}")
        self.deployment = deployment
        self.process_env = process_env or {}
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
        self.commands: dict[str, list[str] | str] = {}  # how each process was started, for restart()
        self._lock = threading.RLock()  # kill/restart vs the supervisor
        self._held_down: set[str] = set()  # stopped on purpose: the supervisor leaves them down
        self._stopping = False

    @property
    def key_prefix(self) -> str:
        """``"<DEPLOYMENT_NAME>:"``: the start of every Redis key this stack's processes write
        (queues, ``unacked``, results, lane control: project/lanes.py ``key_prefix``)."""
        return lanes.key_prefix(configuration.read(self.env, names=["DEPLOYMENT_NAME"])["DEPLOYMENT_NAME"])

    def celery_app(self):
        """A Celery client on this stack's broker and deployment (its ``global_keyprefix``): what
        sends to its queues, pings its workers or reads its events. The caller closes it."""
        from celery import Celery  # deferred: the stack runner starts without Celery loaded

        options = {"global_keyprefix": self.key_prefix}
        app = Celery(broker=self.env["REDIS_URL"], backend=self.env["REDIS_URL"], set_as_current=False)
        app.conf.update(broker_transport_options=options, result_backend_transport_options=options)
        return app

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

    def site_user(self, username: str, password: str | None = None, *, staff: bool = False) -> str | None:
        """Create a user who signs in to the site (``/``) and the admin (staff), or reuse one.

        Args:
            password: set it (an existing user's too); None: a new user gets a random one and an
                existing user keeps theirs.

        Returns:
            The password set, or None when an existing user kept theirs.
        """
        import secrets

        fresh = password or secrets.token_urlsafe(12)
        code = ("import os; from django.contrib.auth import get_user_model; e = os.environ; "
                "u, new = get_user_model().objects.get_or_create(username=e['SITE_USER']); "
                "pw = e['SITE_PASSWORD'] if new or e['SITE_SET_PASSWORD'] == '1' else None; "
                "u.is_staff = u.is_superuser = u.is_staff or e['SITE_STAFF'] == '1'; "
                "pw and u.set_password(pw); u.save(); print('set' if pw else 'kept')")
        env = {**self.env, "SITE_USER": username, "SITE_PASSWORD": fresh, "SITE_SET_PASSWORD": "1" if password else "0",
               "SITE_STAFF": "1" if staff else "0"}
        out = subprocess.run([sys.executable, str(ROOT / "manage.py"), "shell", "-c", code], env=env, cwd=ROOT,
                             text=True, capture_output=True)
        if out.returncode:
            raise RuntimeError(f"could not create user {username}: {out.stderr}")
        return fresh if out.stdout.strip().endswith("set") else None

    def _spawn(self, name: str, cmd: list[str] | str) -> subprocess.Popen:
        logdir = self.var_dir / "log"
        logdir.mkdir(parents=True, exist_ok=True)
        logf = open(logdir / f"{name}.log", "ab")
        argv = cmd.split() if isinstance(cmd, str) else cmd
        if argv[0] in ("celery", "gunicorn"):
            argv = [str(Path(sys.executable).parent / argv[0]), *argv[1:]]
        p = subprocess.Popen(argv, env={**self.env, **self.process_env.get(name, {})}, cwd=ROOT, stdout=logf,
                             stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = p
        self.commands[name] = cmd
        self._held_down.discard(name)
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

    def start(self, timeout: float = 180, *, wait: bool = True) -> "Stack":
        """Redis, migrations, then the processes; returns when the web answers and each worker pings
        (``wait=False``: once the processes are started; ``wait_ready`` then waits for them, e.g.
        while another host's stack starts on the same, now migrated, database).

        ``migrate`` and ``collectstatic`` run side by side (the static files touch no database);
        the workers start as soon as the migrations are done (they read the database as they
        start), the web process as soon as the static files are collected (WhiteNoise lists
        STATIC_ROOT when it starts; ``/healthz`` reads no database). One after another, the steps
        left a core idle for seconds of every start (15-20 s on the 2-core CI machine).
        """
        self.var_dir.mkdir(parents=True, exist_ok=True)
        self.clear_metrics()
        self.ensure_redis()
        cmds = (processes.shared_commands if self.deployment == "shared" else processes.commands)(self.env)
        wanted = {name: cmd for name, cmd in cmds.items() if self.only is None or name in self.only}
        with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="stack-start") as pool:
            steps = {pool.submit(self.manage, "migrate", "--noinput"): [n for n in wanted if n != "web"]}
            # Static files (admin, API docs, the site) into STATIC_ROOT with gzip copies; WhiteNoise
            # serves them from the web process (it also finds them in the apps without this step). A
            # host without the web process (``only`` workers: another worker host) serves none.
            if "web" in wanted:
                steps[pool.submit(self.manage, "collectstatic", "--noinput", "--verbosity", "0")] = ["web"]
            for step in concurrent.futures.as_completed(steps):
                step.result()  # a failed step raises here: nothing waits on it
                for name in steps[step]:
                    self._spawn(name, wanted[name])
        if wait:
            self.wait_ready(timeout)
        return self

    def clear_metrics(self) -> None:
        """Empty the Prometheus multiprocess folder before any process starts: files left by the
        processes of an earlier run would otherwise be summed into this run's metrics
        (prometheus-client's multiprocess mode requires a clean folder at start)."""
        folder = self.env.get("METRICS_DIR", str(self.var_dir / "prometheus"))
        if folder:
            for f in Path(folder).glob("*.db"):
                f.unlink(missing_ok=True)

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
                names -= self.ping_workers(expect=self._worker_count())
            if not web and not names:
                return
            time.sleep(0.1)
        raise TimeoutError(f"not ready after {timeout} s: workers {sorted(names)}, web pending={web}")

    def _worker_count(self) -> int:
        """Workers this stack started: once as many answer a ping, no other reply is awaited (on a
        shared Redis another host's workers answer too; the caller checks the names)."""
        return sum(1 for n in self.procs if n.startswith("worker-"))

    def ping_workers(self, expect: int | None = None) -> set[str]:
        """Names (``interactive``, ``bulk``, ``vectors``) of the workers that answer a ping now.

        Args:
            expect: stop waiting for replies once this many came (default: wait the whole 0.5 s,
                as a broadcast does not know how many workers there are).
        """
        app = self.celery_app()
        try:
            replies = app.control.ping(timeout=0.5, limit=expect)
        except Exception:  # noqa: BLE001 - e.g. a pooled connection to a Redis that restarted: ask again
            return set()
        finally:
            app.close()
        return {next(iter(r)).split("@")[0] for r in replies}

    def stop(self) -> None:
        """SIGTERM every process group (workers finish or requeue), then SIGKILL stragglers. The
        private Redis goes last: a worker's warm shutdown gives its unacknowledged messages back to it."""
        with self._lock:  # the supervisor finishes any restart first, so the process is in self.procs
            self._stopping = True
        order = [n for n in self.procs if n != "redis"] + [n for n in self.procs if n == "redis"]
        for group in (order[:-1], order[-1:]) if order[-1:] == ["redis"] else (order,):
            for name in group:
                p = self.procs[name]
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGTERM)
            self._reap([self.procs[n] for n in group])
        self.procs.clear()

    def _reap(self, procs: list[subprocess.Popen]) -> None:
        deadline = time.monotonic() + 20
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    # --- fault injection (tests/e2e/test_faults.py, scripts/soak.py) --------------------------------

    def pid(self, name: str) -> int:
        """Pid of process ``name`` (the worker's parent for prefork workers)."""
        return self.procs[name].pid

    def children(self, name: str) -> list[int]:
        """Pids of the child processes of ``name`` (a prefork worker's pool children)."""
        import psutil

        with contextlib.suppress(psutil.NoSuchProcess):
            return [c.pid for c in psutil.Process(self.pid(name)).children()]
        return []

    def busiest_child(self, name: str, *, sample_s: float = 0.3) -> int:
        """Pid of the pool child of ``name`` using the most CPU now (the one running a task).

        Raises:
            LookupError: ``name`` has no child process.
        """
        import psutil

        kids = []
        for pid in self.children(name):
            with contextlib.suppress(psutil.NoSuchProcess):
                k = psutil.Process(pid)
                k.cpu_percent(None)
                kids.append(k)
        if not kids:
            raise LookupError(f"{name} has no child process")
        time.sleep(sample_s)
        usage = {}
        for k in kids:
            with contextlib.suppress(psutil.NoSuchProcess):
                usage[k.pid] = k.cpu_percent(None)
        if not usage:
            raise LookupError(f"{name} has no child process")
        return max(usage, key=usage.get)

    def kill(self, name: str, *, child: bool = False, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` (default SIGKILL) to process ``name``'s whole group, or with ``child`` to the
        busiest pool child only (the one running a task: the parent notices and, with late acks,
        requeues its task). Returns the pid signalled. Raises ``LookupError`` when ``child`` is asked
        and there is none."""
        if child:
            pid = self.busiest_child(name)
            os.kill(pid, sig)
            return pid
        with self._lock:
            p = self.procs[name]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=30)
            return p.pid

    def stop_process(self, name: str, *, sig: int = signal.SIGKILL) -> None:
        """Stop process ``name`` (its whole group) and wait for it; ``restart`` brings it back (the
        supervisor does not)."""
        self._held_down.add(name)
        p = self.procs[name]
        if p.poll() is None:
            self.kill(name, sig=sig)
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def restart(self, name: str, *, sig: int = signal.SIGKILL, timeout: float = 180) -> None:
        """Stop process ``name`` (if running) and start it again with the same command line; returns
        when it is ready (a worker answers a ping, the web answers ``/healthz``)."""
        if name == "redis":
            self.restart_redis()
            return
        with self._lock:
            self.stop_process(name, sig=sig)
            self._spawn(name, self.commands[name])
        self._wait_for({name}, timeout)

    def restart_redis(self) -> None:
        """SIGKILL the private Redis and start it again on the same port, empty: it keeps nothing
        on disk (``--save ""``, no AOF), so every queued message and result is lost."""
        if "redis" not in self.procs:
            raise RuntimeError("restart_redis only restarts the stack's private Redis, never a shared one")
        with self._lock:
            self.stop_process("redis")
            self._spawn("redis", self.commands["redis"])
        for _ in range(200):
            if redis_answers(self.env["REDIS_URL"]):
                return
            time.sleep(0.05)
        raise RuntimeError("private redis-server did not restart; see its log")

    def supervise(self, every: float = 1.0) -> threading.Thread:
        """Start a daemon thread that starts again any process that exits by itself, as a process
        manager does in production (docker ``restart:``, systemd ``Restart=``). A Celery worker can
        exit when its broker connection breaks at a bad moment (kombu raises from its close path
        during a Redis restart); processes stopped on purpose (``stop_process``) stay down, and so
        does one that exited with status 78 (EX_CONFIG: a configuration error such as missing
        weights, which a restart cannot mend; systemd's ``RestartPreventExitStatus=78``)."""

        def loop() -> None:
            while not self._stopping:
                time.sleep(every)
                with self._lock:
                    for name, p in list(self.procs.items()):
                        if self._stopping or name in self._held_down or p.poll() is None:
                            continue
                        if p.returncode == 78:
                            self.log(f"{name} refused to start (exit 78, configuration error; see "
                                     f"{self.var_dir / 'log' / (name + '.log')}); not starting it again")
                            self._held_down.add(name)
                            continue
                        self.log(f"{name} exited with {p.returncode}; starting it again")
                        self._spawn(name, self.commands[name])

        thread = threading.Thread(target=loop, name="stack-supervisor", daemon=True)
        thread.start()
        return thread

    def _wait_for(self, names: set[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        workers = {n.removeprefix("worker-") for n in names if n.startswith("worker-")}
        web = "web" in names
        while time.monotonic() < deadline:
            for name in names:
                if self.procs[name].poll() is not None:
                    raise RuntimeError(f"{name} exited with {self.procs[name].returncode}; see "
                                       f"{self.var_dir}/log/{name}.log")
            if web:
                with contextlib.suppress(Exception):
                    urllib.request.urlopen(self.web_url + "/healthz", timeout=1)
                    web = False
            if workers:
                workers -= self.ping_workers(expect=self._worker_count())
            if not web and not workers:
                return
            time.sleep(0.1)
        raise TimeoutError(f"not ready after {timeout} s: {sorted(workers)}, web pending={web}")

    def __enter__(self) -> "Stack":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_stopping = False  # set once main() has begun to stop: further signals are ignored


def _interrupt(signum: int, frame) -> None:
    """SIGTERM/SIGHUP handler: stop exactly as Ctrl-C does, by raising ``KeyboardInterrupt`` in the
    main thread (out of ``signal.pause``, or out of a start that is still in progress)."""
    if not _stopping:
        raise KeyboardInterrupt(signal.Signals(signum).name)


def _end_leftover_children(timeout: float = 10) -> None:
    """Safety net after ``Stack.stop``: SIGTERM, then SIGKILL, any child of this script still alive,
    e.g. one a signal caught between ``Popen`` and ``Stack._spawn`` recording it."""
    import psutil

    kids = psutil.Process().children()
    for k in kids:
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(k.pid) == k.pid:  # a session leader started by _spawn: its whole group
                os.killpg(k.pid, signal.SIGTERM)
            else:
                k.terminate()
    _, alive = psutil.wait_procs(kids, timeout=timeout)
    for k in alive:
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(k.pid) == k.pid:
                os.killpg(k.pid, signal.SIGKILL)
            else:
                k.kill()
    psutil.wait_procs(alive, timeout=timeout)


def main() -> None:
    """``python -m scripts.stack run``: start everything and wait for Ctrl-C, SIGTERM or SIGHUP;
    any of them stops every process the stack started (the private Redis last) and exits 0."""
    global _stopping
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    var = Path(os.environ.get("VAR_DIR", ROOT / "var"))
    stack = Stack(var)
    try:
        stack.start()
        stack.supervise()  # a process that exits by itself is started again, as in production
        print(f"web at {stack.web_url}; logs in {var}/log; Ctrl-C stops", flush=True)
        password = stack.site_user("admin", staff=True)
        how = (f"user admin, password {password} (made now; change it with `python manage.py changepassword admin`)"
               if password else "user admin with the password printed when it was made (forgotten? "
                                "`python manage.py changepassword admin`)")
        print(f"sign in at {stack.web_url}/ (search, upload, jobs) and {stack.web_url}/admin/: {how}; "
              f"API docs at {stack.web_url}/api/docs/", flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt as exc:
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            print(f"{exc.args[0] if exc.args else 'SIGINT'}: stopping", flush=True)
    finally:
        _stopping = True
        for sig in STOP_SIGNALS:  # a second signal must not cut the stop short and orphan processes
            signal.signal(sig, signal.SIG_IGN)
        stack.stop()
        _end_leftover_children()


if __name__ == "__main__":
    main()
