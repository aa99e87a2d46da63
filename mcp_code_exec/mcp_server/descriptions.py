"""What the model reads about the tools. No agent framework forwards the server's instructions, so
each tool's description carries what a model needs to use it well: paths, limits, how long
things may take and what to do then. Built from the configuration, so the numbers are true."""

from __future__ import annotations

from ..config import greeting
from ..config.settings import Config
from ..config.units import MIB
from ..protocol.messages import ToolSpec

TOOLS_INLINE = 40  # past this many, run_python's description gives a count and mcp_tools.search
LIBRARIES = greeting.LIBRARIES


def instructions(config: Config) -> str:
    return greeting.instructions(greeting.from_config(config))


def host_directories(config: Config) -> str:
    return greeting.host_directories(greeting.from_config(config).mounts)


def installs(config: Config) -> bool:
    return config.packages.enabled


def packages_text(config: Config) -> str:
    """How a model adds a package, when the server lets it."""
    if not installs(config):
        return "Installing packages is turned off on this server.\n"
    return (
        "More packages: a line `%pip install NAME` (or `!pip install NAME`) in a cell installs them, importable "
        "right after that line and, in a session, for the rest of it; the server fetches them from its own "
        "package index before the cell runs (wheels only; the sandbox itself stays offline). Or pass "
        "packages=['NAME', ...] to have them installed before the code runs (also without a session). Names and "
        "versions only (no URLs, files or other indexes). A package that cannot be had (unknown, no wheel, "
        "refused by the server's policy) ends the run with a PackageError before any of the cell runs.\n"
    )


GET_USAGE = (
    "What you have spent: each of your quotas counted over time (runs a minute, CPU seconds an hour "
    "and a day, package installs a day) with its limit, what is counted now and in how many seconds "
    "that has all left its window; with session_id, that session's runs added up (CPU seconds, peak "
    "memory, bytes written, packages, tool calls). Each run's own cost is its result's usage."
)
# The tools of durable sessions (see docs/sessions.md).
DURABLE_TOOLS = {
    "fork_session": (
        "Copy a session as it is now into `count` new sessions (at most 8) of your own: each starts with its "
        "files, installed packages and (where the sandbox keeps snapshots) its variables, then goes its own "
        "way. For trying several approaches from one point. Returns the new session_ids; each starts "
        "paused and resumes at its first call."
    ),
    "list_variables": (
        "List a session's variables without running code: each name with its type, a short repr, and its "
        "size or shape where known."
    ),
    "export_notebook": (
        "Write a session's run history as a Jupyter notebook (code cells with their outputs, images and "
        "errors) into its /mnt/data (default session.ipynb); returns its path and resource URI, to read "
        "with read_file or download with file_url."
    ),
}


def tool_descriptions(config: Config, *, urls: bool = False) -> dict[str, str]:
    limits = config.limits
    cap_kb = limits.max_output_bytes // 1024
    read_mb = limits.read_max_bytes / MIB
    write_mb = limits.write_max_bytes / MIB
    network = network_text(config)
    mounted = f"\n{host_directories(config)}" if config.mounts else ""
    return {
        "run_python": (
            "Run Python 3 code in an isolated sandbox, like a notebook cell: returns stdout, stderr, the value "
            "of the last expression, a traceback on error, matplotlib figures and displayed images as "
            "images, and the files the code wrote under /mnt/data (the working directory). "
            f"{LIBRARIES} are installed; {network}. IPython magics and !cmd work.\n"
            + packages_text(config)
            + "Without session_id every call starts from scratch (its files are kept for a while: read them "
            "with read_file(run_id=...)); with a session_id from new_session, variables and files persist.\n"
            f"timeout: seconds the run may take (default {limits.default_timeout_s:g}, at most "
            f"{limits.max_run_s:g}). wait: seconds this call waits (default {limits.wait_s:g}); a run still "
            "going then is NOT stopped: the answer has status 'running' and a run_id, and "
            "get_run(run_id) returns its new output and, once it ends, its result.\n"
            f"Output is capped at {cap_kb} KiB per stream (head and tail kept), and at "
            f"{limits.max_images} images per run. An exception in the code is a normal result with "
            "status 'error' and the traceback: fix the code and run it again." + mounted
        ),
        **run_follow_descriptions(config),
        "new_session": (
            "Start a persistent Python session: variables, imports and files under /mnt/data survive "
            "between run_python calls that pass its session_id. One run at a time per session. Close it "
            f"with close_session when done; it closes itself after {config.sessions.idle_timeout_s:g} s "
            f"unused. Memory {limits.memory_mb} MiB, {limits.cpus:g} CPU, {network}."
            + mounted
            + (EGRESS_NEW if config.egress.enabled else "")
        ),
        "restrict_egress": EGRESS_RESTRICT if config.egress.enabled else "",
        "close_session": "Close a session: its interpreter, container and files are deleted.",
        **DURABLE_TOOLS,
        "list_files": (
            "List files under /mnt/data, recursively (capped), with sizes and resource URIs: of a session "
            "(session_id) or of a stateless run (run_id, from its result). path narrows a session's listing."
        ),
        "read_file": (
            "Read a file from /mnt/data of a session (session_id) or of a stateless run (run_id): text comes "
            f"back as text, images as images, anything else as a binary resource. At most {read_mb:g} MiB; "
            "paths are relative to /mnt/data (or absolute under /mnt/data/)."
        ),
        "write_file": (
            "Write a file into a session's /mnt/data, atomically replacing it if it exists; parent "
            f"directories are created. content is text, or base64 with encoding='base64'. At most {write_mb:g} MiB. "
            "For bigger or binary files, use file_url instead."
        ),
        "file_url": file_url_description(config, urls=urls),
        "get_usage": GET_USAGE,
    }


def run_follow_descriptions(config: Config) -> dict[str, str]:
    return {
        "get_run": (
            "Follow a run that answered 'running': waits up to `wait` seconds (default "
            f"{config.limits.wait_s:g}) for it to end. Returns the output printed since the last look while it "
            "runs, and its whole result (value, images, files) once it has ended."
        ),
        "cancel_run": (
            "Stop a run that is still going (an interrupt first; a session keeps its variables when the "
            "code lets the interrupt through). Returns how it ended."
        ),
    }


def network_text(config: Config) -> str:
    if config.egress.enabled:
        return "no network but the hosts the server allows (see run_python)"
    return "no network" if not config.network else "network access"


EGRESS_NEW = (
    "\negress: the host patterns this session may reach, of those you may (see run_python's description; "
    "default: all of them; [] for none). Its result's egress lists what it reaches; forks reach what it "
    "reaches when forked."
)
EGRESS_RESTRICT = (
    "Narrow what a session's code may reach (never widen it): allow is the host patterns it keeps, of "
    "those it reaches now; [] cuts it off. Takes effect at once, even for a run going on (connections "
    "to hosts it no longer reaches are cut): e.g. fetch the data, then restrict_egress(session_id, []) "
    "before analysing it with code you do not trust. Returns the session, whose egress is what it reaches now."
)


def file_url_description(config: Config, *, urls: bool) -> str:
    limits, files = config.limits, config.files
    ttl = f"{files.url_ttl_s / 60:g} minutes" if files.url_ttl_s >= 60 else f"{files.url_ttl_s:g} s"
    upload_mb = min(files.max_upload_bytes, limits.fsize_bytes) // MIB
    return (
        "Get a short-lived URL that moves a file of any size between a session's /mnt/data and the "
        "outside, without its bytes passing through this conversation. direction='download': an HTTP GET "
        "of the URL returns the file (e.g. `curl -fo out.csv URL`). direction='upload': an HTTP PUT (or "
        "POST) of the raw bytes to the URL writes them to path, atomically (e.g. `curl -fT data.csv URL`); "
        f"it works once, for at most {upload_mb} MiB and within the session's quota. URLs "
        f"expire after {ttl} and need no Authorization header: the URL itself is the permission, so "
        "share it only with whoever should move that file. "
        + (
            "Hand the URL to the user or to a tool that can make HTTP requests."
            if urls
            else "This server runs over stdio, where no URL can be served: this tool only says so; use "
            "read_file and write_file."
        )
    )


def code_mode_text(catalog: list[ToolSpec]) -> str:
    """What run_python's description adds for a caller whose code may call other MCP servers' tools
    (those of the caller's ``principals`` only): a line per tool, or a count past ``TOOLS_INLINE``."""
    if not catalog:
        return ""
    servers = sorted({spec.server for spec in catalog})
    text = (
        "\nOther MCP servers' tools are callable from the code: `import mcp_tools`, then "
        "`mcp_tools.<server>.<tool>(**arguments)` returns the tool's result to the code (a dict, or text), so "
        "only what the code prints comes back; `help(mcp_tools.<server>.<tool>)` shows a tool's description; "
        "errors are mcp_tools.ToolError and its kinds (ToolDenied, ToolTimeout, ...). Servers: "
        + ", ".join(servers)
        + ".\n"
    )
    if len(catalog) > TOOLS_INLINE:
        return text + (f"{len(catalog)} tools in all: find them with `print(mcp_tools.search('word'))` in the code.\n")
    lines = []
    for spec in catalog:
        params = ", ".join(param.name + ("" if param.required else "=None") for param in spec.params)
        first = spec.description.strip().splitlines()[0][:120] if spec.description.strip() else ""
        lines.append(f"- mcp_tools.{spec.server}.{spec.name}({params})" + (f": {first}" if first else ""))
    return text + "\n".join(lines) + "\n"
