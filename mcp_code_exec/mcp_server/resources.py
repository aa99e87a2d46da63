"""Files and run output as MCP resources, each visible to its owner only (see ``uris`` for the scheme)."""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ResourceError
from mcp.types import ListResourcesResult, Resource

from ..errors import SandboxError
from ..service import uris
from ..service.port import ServicePort
from .identity import owner_of
from .sdk import SandboxServer


def owns(service: ServicePort, identity: str, uri: str) -> bool:
    """Whether ``identity`` may see ``uri`` (for subscriptions: anything else is "no such resource")."""
    return service.may_see(identity, uri)


async def list_resources(service: ServicePort, ctx: Any) -> ListResourcesResult:
    owner = owner_of(ctx)
    resources = [
        Resource(uri=info.uri, name=info.path, mime_type=info.mime_type, size=info.size)
        for info in await service.session_files(owner)
        if info.uri is not None
    ]
    for run_id, path, size in service.run_file_listing(owner):
        uri = uris.run_file_uri(run_id, path)
        resources.append(Resource(uri=uri, name=path, mime_type=uris.guess_mime(path), size=size))
    for run in service.running_runs(owner):
        uri = uris.run_output_uri(run.id)
        resources.append(Resource(uri=uri, name=f"output of run {run.id}", mime_type="text/plain"))
    return ListResourcesResult(resources=resources)


def register_resources(server: SandboxServer, service: ServicePort) -> None:
    @server.resource(uris.SESSION_FILE_TEMPLATE, name="session_file", mime_type="application/octet-stream")
    async def session_file(session_id: str, path: str, ctx: Context) -> str | bytes:
        """A file under a session's /mnt/data."""
        try:
            found = await service.read_file(owner_of(ctx), session_id, path)
        except SandboxError as exc:
            raise ResourceError(str(exc)) from exc
        return uris.as_text(found.data, uris.guess_mime(path)) or found.data

    @server.resource(uris.RUN_FILE_TEMPLATE, name="run_file", mime_type="application/octet-stream")
    async def run_file(run_id: str, path: str, ctx: Context) -> str | bytes:
        """A file a stateless run left in /mnt/data (kept for a limited time)."""
        try:
            found = service.read_run_file(owner_of(ctx), run_id, path)
        except SandboxError as exc:
            raise ResourceError(str(exc)) from exc
        return uris.as_text(found.data, uris.guess_mime(path)) or found.data

    @server.resource(uris.RUN_OUTPUT_TEMPLATE, name="run_output", mime_type="text/plain")
    async def run_output(run_id: str, ctx: Context) -> str:
        """What a run printed so far (stdout, then stderr), while it runs and after it ended."""
        try:
            run = service.get_run(owner_of(ctx), run_id)
        except SandboxError as exc:
            raise ResourceError(str(exc)) from exc
        if run.result is not None:
            out, err, state = run.result.stdout, run.result.stderr, f"ended: {run.result.status}"
        else:
            out, err, state = run.output.since("stdout", 0), run.output.since("stderr", 0), "running"
        return f"[run {run.id}: {state}]\n{out}" + (f"\n[stderr]\n{err}" if err else "")
