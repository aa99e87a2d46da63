"""What the sandbox service calls: the proxy's start, a run's grant, a session's reach and its end.

One ``Egress`` per running service (its proxy, its socket volume, its grant key). A run costs
egress nothing but a token minted here (an HMAC, microseconds) and, at its end, a message put on
the proxy's queue: no run waits for the proxy. A session's token is made once and kept for its
life, so code that kept ``HTTP_PROXY`` from an earlier cell (an httpx client, say) still works;
its run budget starts again with each run (``run``), and a narrowing reaches the proxy at once
(``narrow``: tunnels out of the new reach are cut) and the session's later tokens.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup

from ..config.egress import EgressSettings
from ..config.principals import is_local
from ..errors import EgressError
from ..observability import metrics
from ..observability.logs import identity_hash
from ..runtime.base import LABEL_KIND, ContainerEngine, ProxyEngine, ProxySpec
from . import reach as reaches
from . import tokens
from .accounting import Accounting
from .hosts import host_entries
from .image import require_current_image
from .proxy import EgressProxy, Message
from .sandboxes import HOST_UDS_FLAGS, RELAY_GID, SOCKET_VOLUME_PREFIX

log = logging.getLogger(__name__)
RUN_GRACE_S = 120.0  # a stateless run's token outlives its deadline by this much at most
USAGE_EVERY_S = 30.0
ENDED_KEPT = 1000  # ended grants kept before the expired ones are dropped
# Connections one sandbox may hold through the proxy (its relay's cap, ``mcpx_agent.relay``; the
# proxy's bridge holds each container to it too), and what each costs the proxy in descriptors
# (the relay's and mitmproxy's ends of the bridge, the upstream, one spare).
PER_SANDBOX = 64
FDS_PER_CONNECTION = 4
FDS_SPARE = 1024
# The proxy's memory: what it takes idle (about 60 MiB measured), and what each byte of a request
# head it holds costs it (mitmproxy's buffers and the bridge's: about 1.7 measured). The bytes of
# unfinished heads one sandbox may hold at once are sized so that every sandbox holding all of its
# own fits, within these bounds (a memory_mb that cannot give each the least is refused).
PROXY_IDLE_MIB = 80
HEAD_S = 60.0  # a request head begun must be whole by then, or its connection is closed (tests shorten it)
HEAD_COST = 2
HEADS_BUDGET_MAX = 2 << 20
HEADS_BUDGET_MIN = 128 << 10
CA_KEY, CA_CERT = "ca.key", "ca.pem"


class Egress:
    def __init__(
        self,
        settings: EgressSettings,
        engine: ContainerEngine,
        *,
        labels: dict[str, str],
        instance: str,
        runtime: str | None = None,
        session_lifetime_s: float = 86400.0,
        identities: Collection[str] | None = None,
        environ: Mapping[str, str] | None = None,
        max_sandboxes: int = 64,
    ) -> None:
        """``labels``: the service's (the proxy and its volume are swept with its containers);
        ``identities``: those the configuration names (HTTP tokens'), shown in the metrics by hash;
        ``max_sandboxes``: the most containers the server runs at once (the proxy is sized so that
        all of them holding all their connections leave room for one more)."""
        if not isinstance(engine, ProxyEngine):
            raise EgressError("[egress] needs an engine that can run its proxy (Docker)")
        self.settings = settings
        self.engine = engine
        self.proxy_engine: ProxyEngine = engine
        self.runtime = runtime
        self.session_lifetime_s = session_lifetime_s
        self.named = {identity_hash(identity)[:16] for identity in identities or ()}
        self.environ = dict(os.environ if environ is None else environ)
        self.key = tokens.new_key()
        self.volume = SOCKET_VOLUME_PREFIX + instance
        self.state_dir = settings.state_path(self.environ)
        self.accounting = Accounting([entry.host for entry in settings.allow], self.state_dir)
        self.ca: tuple[str, str] | None = None
        self.narrowed: dict[str, list[int]] = {}  # grant -> the indices it was narrowed to
        self.ended: dict[str, float] = {}  # grant -> its token's expiry
        self.session_tokens: dict[str, tuple[str, str]] = {}  # session id -> its container's key, its proxy URL
        self.unreachable: str | None = None  # why sandboxes cannot reach the proxy, when known
        self.max_connections = (max_sandboxes + 1) * PER_SANDBOX
        self.heads_budget = heads_budget(settings.memory_mb, max_sandboxes)
        spec = ProxySpec(
            image=settings.image,
            labels={**labels, LABEL_KIND: "egress-proxy"},
            socket_volume=self.volume,
            memory_bytes=settings.memory_bytes,
            extra_hosts=host_entries(settings.hosts_file),
            socket_gid=RELAY_GID,
            nofile=self.max_connections * FDS_PER_CONNECTION + FDS_SPARE,
        )
        self.proxy = EgressProxy(engine, spec, boot=self._boot, resend=self._resend, on_event=self._event)

    # -- its life -------------------------------------------------------------------------------------
    async def start(self, task_group: TaskGroup) -> None:
        """Check the proxy's image and the runtime, then keep the proxy running in ``task_group``
        (sandboxes may start meanwhile: until it answers, their requests fail with a clear message)."""
        await require_current_image(self.engine, self.settings.image)
        if self.runtime == "runsc":
            await self._check_runsc()
        await anyio.to_thread.run_sync(self._load_state)
        await self.proxy_engine.proxy_volume(self.proxy.spec)
        await task_group.start(self.proxy.serve)
        task_group.start_soon(self._keep_usage)

    async def _check_runsc(self) -> None:
        args = await self.proxy_engine.runtime_args("runsc") or []
        if not any(flag in args for flag in HOST_UDS_FLAGS):
            self.unreachable = (
                "gVisor (runsc) is registered without --host-uds=open, so sandboxes cannot reach the egress "
                "proxy's socket and every egress request fails; run `sudo scripts/ensure-docker.sh` (it adds the "
                "flag), and `mcp-code-exec doctor` checks it"
            )
            log.error("egress: %s", self.unreachable)

    async def stop(self) -> None:
        await self.proxy.aclose()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.accounting.save)

    async def _keep_usage(self) -> None:
        while True:
            await anyio.sleep(USAGE_EVERY_S)  # a timer: the counters reach the disk this often
            await anyio.to_thread.run_sync(self.accounting.save)

    def _load_state(self) -> None:
        """The deployment CA (made by the proxy at its first start) and the day's counters (blocking)."""
        self.accounting.load()
        try:
            key = (self.state_dir / CA_KEY).read_text()
            cert = (self.state_dir / CA_CERT).read_text()
        except OSError:
            return
        self.ca = (key, cert)

    def _keep_ca(self, key: str, cert: str) -> None:
        """Keep the CA the proxy made: the key in a file only this user reads (blocking)."""
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for name, text, mode in ((CA_KEY, key, 0o600), (CA_CERT, cert, 0o644)):
            path = self.state_dir / name
            fd = os.open(f"{path}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            os.replace(f"{path}.tmp", path)

    def _boot(self) -> Message:
        metrics.egress_proxy_started()
        upstream = ""
        if self.settings.upstream_ca is not None:
            upstream = Path(self.settings.upstream_ca).read_text()
        key, cert = self.ca or ("", "")
        level = "info" if log.isEnabledFor(logging.DEBUG) else "warn"
        return {
            "grant_key": self.key.hex(),
            "ca_key": key,
            "ca_cert": cert,
            "upstream_ca": upstream,
            "log_level": level,
            "socket_gid": RELAY_GID,
            "max_connections": self.max_connections,
            "heads_budget": self.heads_budget,
            "head_s": HEAD_S,
        }

    def _resend(self) -> list[Message]:
        settings = self.settings
        config: Message = {
            "op": "config",
            "allow": [entry.host for entry in settings.allow],
            "private_ranges": list(settings.private_ranges),
            "secrets": [
                {"host": host, "header": header, "value": value}
                for host, header, value in settings.secret_values(self.environ)
            ],
            "budget_run": settings.budget_run_bytes or None,
            "budget_day": settings.budget_day_bytes or None,
        }
        now = time.time()
        self.ended = {grant: expires for grant, expires in self.ended.items() if expires > now}
        messages = [config, self.accounting.usage_message()]
        messages += [{"op": "narrow", "grant": grant, "reach": reach} for grant, reach in self.narrowed.items()]
        messages += [{"op": "end", "grant": grant, "expires": expires} for grant, expires in self.ended.items()]
        return messages

    def _event(self, event: dict[str, Any]) -> None:
        if event.get("ev") == "ca" and self.ca is None:
            key, cert = str(event.get("key", "")), str(event.get("cert", ""))
            if "PRIVATE KEY" in key and "CERTIFICATE" in cert:
                self.ca = (key, cert)
                try:
                    self._keep_ca(key, cert)  # small and once: the first start of a deployment
                except OSError as exc:
                    log.warning("egress: could not keep the proxy's CA in %s: %s", self.state_dir, exc)
            return
        self.accounting.take(event)

    # -- grants ---------------------------------------------------------------------------------------
    def reach_of(self, identity: str) -> reaches.Reach:
        return reaches.of_identity(self.settings, identity)

    def _claims(self, identity: str) -> str:
        hashed = identity_hash(identity)[:16]
        label = hashed if hashed in self.named else "local" if is_local(identity) else "other"
        self.accounting.label(hashed, label)
        return hashed

    def run_proxy(self, identity: str, run_id: str, timeout_s: float, container_key: str) -> tuple[str, str]:
        """A stateless run's grant and its HTTP_PROXY, for the container of ``container_key`` alone."""
        grant = tokens.run_grant(run_id)
        indices = reaches.indices(self.settings, self.reach_of(identity))
        token = tokens.mint(
            self.key,
            grant=grant,
            identity=self._claims(identity),
            session="",
            reach=indices,
            expires=time.time() + timeout_s + RUN_GRACE_S,
            container=container_key,
        )
        return grant, tokens.proxy_url(token)

    def session_proxy(
        self, session_id: str, identity: str, reach: reaches.Reach, container_key: str
    ) -> tuple[str, str]:
        """A session run's grant and its HTTP_PROXY (the session's one token while it keeps its
        container; a new container, a resumed or restarted session's, gets a token of its own);
        its run budget starts again."""
        grant = tokens.session_grant(session_id)
        kept = self.session_tokens.get(session_id)
        if kept is not None and kept[0] == container_key:
            url = kept[1]
        else:
            token = tokens.mint(
                self.key,
                grant=grant,
                identity=self._claims(identity),
                session=tokens.session_hash(session_id),
                reach=reaches.indices(self.settings, reach),
                expires=time.time() + self.session_lifetime_s,
                container=container_key,
            )
            url = tokens.proxy_url(token)
            self.session_tokens[session_id] = (container_key, url)
        self.proxy.send({"op": "run", "grant": grant})
        return grant, url

    def run_ended(self, grant: str, timeout_s: float) -> list[str]:
        """A stateless run ended: its token is refused and its connections cut. Its notes for the result."""
        now = time.time()
        expires = now + timeout_s + RUN_GRACE_S
        if len(self.ended) > ENDED_KEPT:  # those past their expiry need no end any more (a restart's resend)
            self.ended = {ended: until for ended, until in self.ended.items() if until > now}
        self.ended[grant] = expires
        self.proxy.send({"op": "end", "grant": grant, "expires": expires})
        return self.accounting.notes(grant)

    def session_notes(self, grant: str) -> list[str]:
        return self.accounting.notes(grant)

    def session_closed(self, session_id: str) -> None:
        grant = tokens.session_grant(session_id)
        if self.session_tokens.pop(session_id, None) is not None:
            expires = time.time() + self.session_lifetime_s
            self.ended[grant] = expires
            self.proxy.send({"op": "end", "grant": grant, "expires": expires})
        self.narrowed.pop(grant, None)

    async def narrow(self, session_id: str, reach: reaches.Reach) -> None:
        """The session's reach is now ``reach`` (already checked to be no wider): the proxy hears it
        before this returns, and cuts the session's tunnels outside it."""
        grant = tokens.session_grant(session_id)
        indices = reaches.indices(self.settings, reach)
        previous = self.narrowed.get(grant)
        self.narrowed[grant] = sorted(set(indices) & set(previous)) if previous is not None else indices
        if self.proxy.ready.is_set():
            await self.proxy.ask({"op": "narrow", "grant": grant, "reach": self.narrowed[grant]})


def heads_budget(memory_mb: int, max_sandboxes: int) -> int:
    """The bytes of unfinished request heads one sandbox may hold in the proxy (see egress_limits)."""
    spare = (memory_mb - PROXY_IDLE_MIB) << 20
    budget = min(HEADS_BUDGET_MAX, spare // ((max_sandboxes + 1) * HEAD_COST))
    if budget < HEADS_BUDGET_MIN:
        least = PROXY_IDLE_MIB + -(-((max_sandboxes + 1) * HEAD_COST * HEADS_BUDGET_MIN) >> 20)
        raise EgressError(
            f"[egress] memory_mb = {memory_mb} cannot hold the proxy and the request heads of "
            f"{max_sandboxes} sandboxes; give it at least {least}"
        )
    return budget
