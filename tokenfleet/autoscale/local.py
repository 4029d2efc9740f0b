"""The local orchestrator: carries out the autoscaler's decisions on this machine by starting and stopping
`tokenfleet replica` processes.

A new replica joins the way any replica does: with the fleet's Redis it runs with `--register` and announces itself
in the registry once it serves (every gateway sees it); without Redis the orchestrator adds it to this gateway's
router when its /health answers. It is stopped only after the autoscaler drained it and saw it empty; the SIGTERM
then finds nothing to wait for (and would still let a straggler finish, up to the replica's --drain-timeout); one
still running KILL_SLACK_S after that is killed. Until its process exits a stopping replica holds its machine:
`stopping()` counts them, for a shared budget. A replica started here gets SIGTERM (drains, then exits) when the
gateway dies, however it dies: a killed gateway leaves no replica serving with no one to stop it."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tokenfleet.autoscale.settings import AutoscaleSettings
from tokenfleet.autoscale.signals import pool_key

log = logging.getLogger(__name__)

KILL_SLACK_S = 5.0  # a replica still running this long after its SIGTERM drain limit is killed
PR_SET_PDEATHSIG = 1


@dataclass
class LocalReplica:
    name: str  # host:port, as the registry names it
    model: str
    region: str  # the router's pool it joins
    url: str
    proc: subprocess.Popen
    log_path: Path
    started_at: float  # wall clock
    launched: float  # monotonic
    ready: bool = False  # in the router
    stopping: bool = False
    sigterm_at: float | None = None  # monotonic: when stop() sent SIGTERM; None before, and once killed


class LocalOrchestrator:
    def __init__(
        self,
        router,
        settings: AutoscaleSettings,
        redis_url: str | None = None,
        register_prefix: str = "tokenfleet:replicas:",
    ) -> None:
        self.router, self.settings, self.local = router, settings, settings.local
        self.redis_url, self.register_prefix = redis_url, register_prefix
        self.log_dir = Path(self.local.log_dir or tempfile.mkdtemp(prefix="tokenfleet-replicas-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.replicas: dict[str, LocalReplica] = {}
        self._failed_at: dict[str, float] = {}  # model -> when a start last failed

    # --- what the autoscaler reads ----------------------------------------------------------------------------

    def starting(self) -> dict[str, int]:
        """Pool key -> replicas launched and not serving yet."""
        counts: dict[str, int] = {}
        for r in self.replicas.values():
            if not r.ready and not r.stopping:
                key = pool_key(r.model, r.region)
                counts[key] = counts.get(key, 0) + 1
        return counts

    def stopping(self) -> dict[str, int]:
        """Pool key -> replicas being stopped whose process still runs: out of the router, but each still holds its
        machine (for a shared budget)."""
        counts: dict[str, int] = {}
        for r in self.replicas.values():
            if r.stopping and r.proc.poll() is None:
                key = pool_key(r.model, r.region)
                counts[key] = counts.get(key, 0) + 1
        return counts

    def owned(self) -> dict[str, float]:
        """Replicas this orchestrator can stop -> when they started."""
        return {r.name: r.started_at for r in self.replicas.values() if not r.stopping}

    # --- acting -----------------------------------------------------------------------------------------------

    async def start(self, model: str, region: str, count: int) -> None:
        failed = self._failed_at.get(model)
        if failed is not None and time.monotonic() - failed < self.local.restart_backoff_s:
            log.info("not starting %s replicas yet: one failed to start %.0fs ago", model, time.monotonic() - failed)
            return
        for _ in range(count):
            replica = self._launch(model, region)
            self.replicas[replica.name] = replica
            log.info(
                "started replica %s of %s in %s (pid %d, log %s)",
                replica.name,
                model,
                region,
                replica.proc.pid,
                replica.log_path,
            )

    def _launch(self, model: str, region: str) -> LocalReplica:
        port = _free_port(self.local.host)
        url = f"http://{_bracketed(self.local.host)}:{port}"
        name = url.split("//", 1)[1]
        log_path = self.log_dir / f"{model.replace('/', '_')}-{port}.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(
                self._command(model, region, port, url),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                preexec_fn=_terminate_with_gateway if sys.platform.startswith("linux") else None,
            )
        return LocalReplica(name, model, region, url, proc, log_path, time.time(), time.monotonic())

    def _command(self, model: str, region: str, port: int, url: str) -> list[str]:
        spec = self.router.models[model].spec
        command = [
            sys.executable,
            "-m",
            "tokenfleet",
            "replica",
            "--model",
            spec.path,
            "--served-model-name",
            model,
            "--host",
            self.local.host,
            "--port",
            str(port),
            "--drain-timeout",
            f"{self.local.drain_timeout_s:g}",
        ]
        if spec.max_model_len:
            command += ["--max-model-len", str(spec.max_model_len)]
        if self.redis_url:
            command += [
                "--register",
                self.redis_url,
                "--registry-prefix",
                self.register_prefix,
                "--advertise-url",
                url,
                "--pool",
                region,
            ]
        return command + list(self.settings.pool(pool_key(model, region), model).replica_args)

    async def stop(self, name: str) -> None:
        """SIGTERM a drained replica (it withdraws from the registry and exits); not ours: left alone."""
        replica = self.replicas.get(name)
        if replica is None:
            log.warning("asked to stop replica %s, which this orchestrator did not start; leaving it", name)
            return
        if not replica.stopping and replica.proc.poll() is None:
            replica.proc.send_signal(signal.SIGTERM)
            replica.sigterm_at = time.monotonic()
            log.info("stopping replica %s of %s (drained)", name, replica.model)
        replica.stopping = True

    # --- keeping track ----------------------------------------------------------------------------------------

    async def poll(self) -> None:
        """Reaps exited replicas, kills ones that never came up or do not stop, and notices those now serving."""
        async with httpx.AsyncClient(timeout=1.0) as client:
            for replica in list(self.replicas.values()):
                code = replica.proc.poll()
                if code is not None:
                    self._exited(replica, code)
                elif replica.stopping:
                    self._check_stopped(replica)
                elif not replica.ready:
                    await self._check_started(client, replica)

    def _check_stopped(self, replica: LocalReplica) -> None:
        limit = self.local.drain_timeout_s + KILL_SLACK_S
        if replica.sigterm_at is not None and time.monotonic() - replica.sigterm_at > limit:
            log.warning(
                "replica %s still running %.0fs after SIGTERM; killing it (log: %s)",
                replica.name,
                limit,
                replica.log_path,
            )
            replica.proc.kill()
            replica.sigterm_at = None  # the next poll reaps it

    async def _check_started(self, client: httpx.AsyncClient, replica: LocalReplica) -> None:
        pools = self.router.models[replica.model]
        if time.monotonic() - replica.launched > self.local.start_timeout_s:
            log.error(
                "replica %s not serving after %.0fs; killing it (log: %s)",
                replica.name,
                self.local.start_timeout_s,
                replica.log_path,
            )
            replica.proc.kill()
            replica.stopping = True
            self._failed_at[replica.model] = time.monotonic()
        elif self.redis_url:
            replica.ready = replica.name in pools.replicas  # announced itself; the registry watch added it
        elif await _healthy(client, replica.url):
            pools.add(
                replica.name,
                replica.url,
                replica.region,
                "tokenfleet",
                lambda u, n: self.router.make_upstream(u, n, "tokenfleet"),
            )
            replica.ready = True
        if replica.ready:
            log.info(
                "replica %s of %s is serving (%.1fs after start)",
                replica.name,
                replica.model,
                time.monotonic() - replica.launched,
            )

    def _exited(self, replica: LocalReplica, code: int) -> None:
        del self.replicas[replica.name]
        self.router.models[replica.model].remove(replica.name)
        if replica.stopping:
            log.info("replica %s exited (%d)", replica.name, code)
            return
        if not replica.ready:
            self._failed_at[replica.model] = time.monotonic()
        log.error(
            "replica %s of %s exited unexpectedly with %d; last lines of %s:\n%s",
            replica.name,
            replica.model,
            code,
            replica.log_path,
            _tail(replica.log_path),
        )

    async def close(self) -> None:
        """Gateway shutdown: SIGTERM every replica started here (each drains), kill those still up after the drain
        limit."""
        running = [r for r in self.replicas.values() if r.proc.poll() is None]
        log.info("stopping the %d replica(s) started here: %s", len(running), ", ".join(r.name for r in running))
        for replica in running:
            replica.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.local.drain_timeout_s + KILL_SLACK_S
        while any(r.proc.poll() is None for r in self.replicas.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for replica in self.replicas.values():
            if replica.proc.poll() is None:
                log.warning("replica %s still running after its drain limit; killing it", replica.name)
                replica.proc.kill()
                replica.proc.wait()
        self.replicas.clear()


def _terminate_with_gateway() -> None:
    """In the replica, before exec: SIGTERM when the thread that started it (the gateway's event loop) ends."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


async def _healthy(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(f"{url}/health")).status_code == 200
    except httpx.HTTPError:
        return False


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"(unreadable: {e})"
