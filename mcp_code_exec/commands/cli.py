"""Command line: parse arguments, load configuration, start things (the local service's start,
its fork and signals, included); the work itself is in the layers below.

``main(argv) -> int`` so every path is testable without a subprocess. Every error a user can
reach prints one sentence to stderr and returns a non-zero code; stdout stays clean (in stdio
mode it belongs to the protocol).

``serve`` over stdio (the default) is the front (``stdio.front``), which must start fast: it is chosen
before anything heavier than argparse is imported (no pydantic, anyio, docker or mcp on its path).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .. import __version__

if TYPE_CHECKING:
    from ..config.settings import Config
    from ..observability.logs import LogFormat

log = logging.getLogger("mcp_code_exec")
EXIT_USAGE = 2
EXIT_FAILURE = 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcp-code-exec",
        description="An MCP server that runs untrusted Python in hardened, warm Docker containers.",
    )
    parser.add_argument("--version", action="version", version=f"mcp-code-exec {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the MCP server (the default command)")
    _add_serve_arguments(serve)

    daemon = commands.add_parser("daemon", help="the local service stdio clients share (serve starts it)")
    daemon.add_argument("--config", help="configuration file (TOML); also MCP_CODE_EXEC_CONFIG")
    daemon.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None)
    daemon.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    daemon.add_argument("--start-lock-fd", type=int, default=None, help=argparse.SUPPRESS)

    image = commands.add_parser("image", help="build the sandbox image")
    image_commands = image.add_subparsers(dest="image_command", metavar="ACTION", required=True)
    build = image_commands.add_parser("build", help="build the sandbox image (makes an offline base if needed)")
    build.add_argument("--config", help="configuration file (TOML)")
    build.add_argument("--tag", help="image name to build (default: the configured image)")
    build.add_argument("--base", help="base image (default: debian:bookworm-slim, else one made offline)")
    build.add_argument("--apt", default="", help="extra Debian packages to install, space separated")
    custom = image_commands.add_parser("custom", help="build an image with extra packages on top of the sandbox image")
    custom.add_argument("--config", help="configuration file (TOML)")
    custom.add_argument("--tag", required=True, help="name of the new image (then set image = ... in the config)")
    custom.add_argument("--from", dest="from_image", help="image to extend (default: the configured image)")
    custom.add_argument("--apt", default="", help="Debian packages to add, space separated")
    custom.add_argument("--requirements", help="pip requirements (wheels fetched by the host, installed offline)")
    custom.add_argument("--dockerfile-snippet", help="a file of Dockerfile lines to append")
    egress = image_commands.add_parser("egress", help="build the egress proxy's image ([egress] in the config)")
    egress.add_argument("--config", help="configuration file (TOML)")
    egress.add_argument("--tag", help="image name to build (default: [egress] image)")
    egress.add_argument("--base", help="base image (default: debian:trixie-slim, else one made offline)")

    doctor = commands.add_parser("doctor", help="check the engine, image, runtime and limits; say what to fix")
    doctor.add_argument("--config", help="configuration file (TOML)")

    bench = commands.add_parser("bench", help="measure latency and throughput on the real engine")
    bench.add_argument("--config", help="configuration file (TOML)")
    bench.add_argument("--quick", action="store_true", help="a short run (CI)")
    bench.add_argument("--json", dest="json_path", help="also write the results as JSON here")
    bench.add_argument(
        "--scale",
        action="store_true",
        help="instead, measure scale-out: the first of [cluster] engines alone, then all of them",
    )
    from .install import add_parsers  # install, uninstall, bundle (standard library only)

    add_parsers(commands)
    from . import ledger  # audit verify, usage

    ledger.add_parsers(commands)
    return parser


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transport", choices=["stdio", "sse", "streamable-http"], default=None, help="default: stdio")
    parser.add_argument("--host", default=None, help="HTTP bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    parser.add_argument("--config", help="configuration file (TOML); also MCP_CODE_EXEC_CONFIG")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None)
    parser.add_argument(
        "--log-format", choices=["text", "json"], default=None, help="stderr lines: text, or one JSON object a line"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="over stdio, serve in this process instead of through the local service stdio clients share",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve GET /metrics on this port too (on metrics.host, loopback by default; 0: any free port); "
        "over stdio with --in-process only",
    )
    parser.add_argument(
        "--auth",
        choices=["both", "tokens", "oauth"],
        default="both",
        help="over HTTP, which of the configured bearer tokens this listener takes: static ones ([http.tokens]), "
        "OAuth access tokens ([http.oauth]), or both (the default)",
    )


def _setup_logging(level: str, log_format: LogFormat = "text") -> None:
    from ..observability import logs

    logs.setup(level, log_format)
    for noisy in ("docker", "urllib3", "httpx2", "mcp", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, getattr(logging, level.upper())))


def _fail(message: str, code: int = EXIT_FAILURE) -> int:
    print(f"mcp-code-exec: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not args_list or (args_list[0].startswith("--") and args_list[0] not in ("--help", "--version")):
        args_list = ["serve", *args_list]  # serve is the default command
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.command == "serve" and (args.transport or "stdio") == "stdio" and not args.in_process:
        if args.metrics_port is not None:
            return _fail(
                "--metrics-port over stdio needs --in-process: the local service that stdio clients share "
                "serves no metrics listener",
                EXIT_USAGE,
            )
        return _front(args)
    if args.command == "daemon":
        return _daemon(args)
    if args.command in ("install", "uninstall", "bundle"):
        from .install import run

        return run(args)
    if args.command in ("audit", "usage"):
        from . import ledger

        return ledger.run(args)
    from ..config.settings import load_config
    from ..errors import ConfigError, SandboxError

    try:
        config = load_config(getattr(args, "config", None))
    except ConfigError as exc:
        return _fail(str(exc), EXIT_USAGE)
    _setup_logging(
        getattr(args, "log_level", None) or config.log_level, getattr(args, "log_format", None) or config.log_format
    )
    try:
        return _dispatch(args, config)
    except ConfigError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except SandboxError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return 130


def _front(args: argparse.Namespace) -> int:
    from .stdio.front import run_front
    from .stdio.local_service import LocalServiceError

    try:
        return run_front(args.config, args.log_level)
    except LocalServiceError as exc:
        return _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace, config: Config) -> int:
    import anyio

    if args.command == "serve":
        from ..observability import tracing

        tracing.configure_from_environment()  # OTEL_* variables, with the otel extra installed
        try:
            return anyio.run(_serve, args, config)
        finally:
            tracing.shutdown()
    if args.command == "image":
        return _image(args, config)
    if args.command == "doctor":
        from .doctor import doctor

        return anyio.run(doctor, config)
    if args.command == "bench":
        from .bench import bench

        return anyio.run(bench, config, args.quick, args.json_path, args.scale)
    return _fail("unknown command", EXIT_USAGE)


async def _serve(args: argparse.Namespace, config: Config) -> int:
    """``serve`` in this process: over HTTP (the HTTP host), or over stdio with ``--in-process``."""
    if (args.transport or "stdio") == "stdio":
        from ..mcp_server.local.stdio import serve_stdio
        from .stdio.local_service import identity_name, stdio_identity

        identity = stdio_identity(identity_name({}, os.environ) or config.stdio.identity, os.geteuid())
        return await serve_stdio(config, identity, args.metrics_port)
    from ..mcp_server.http.host import ServeOptions, serve_http

    port = args.port if args.port is not None else 8000
    options = ServeOptions(args.transport, args.host or "127.0.0.1", port, args.metrics_port, args.auth)
    return await serve_http(config, options)


def _daemon(args: argparse.Namespace) -> int:
    """The local service: it locks its pid file for its life, and tells the front that started it
    (``--ready-fd``) that it listens, then that its sandbox service has started, or why it cannot
    (the same sentence goes to its log). It holds the start lock the front handed it
    (``--start-lock-fd``) until it listens, or exits: no other front starts a second service while
    this one starts, even when the front that started it is gone."""
    import anyio

    from ..config.settings import load_config
    from ..errors import ConfigError, SandboxError
    from ..mcp_server.local.daemon import LocalHooks, serve_local
    from .stdio.handshake import remember_answer
    from .stdio.local_service import LocalServiceError, ReadyPipe, config_path, hold_pid_file, place_for, stdio_identity

    if args.ready_fd is not None and os.fork() != 0:
        os._exit(0)  # started by a front: live on as its grandchild, reaped by init rather than by it
    ready = ReadyPipe(args.ready_fd, args.start_lock_fd)
    # A mask and ignored signals survive exec: a front started from a thread that blocks SIGTERM
    # (or a client that ignores SIGINT) must not make a service that cannot be stopped.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        config_file = config_path(args.config, os.environ)
        place = place_for(config_file, os.environ)
        os.chdir(place.directory)  # a front starts it there; started by hand, it leaves its directory too
        config = load_config(config_file)
        _setup_logging(args.log_level or config.log_level)
        hold_pid_file(place)
        remember = functools.partial(remember_answer, place.answers)
        hooks = LocalHooks(stdio_identity, ready.listening, ready.say, remember)
        return anyio.run(serve_local, config, place.socket, hooks)
    except (ConfigError, SandboxError, LocalServiceError, OSError) as exc:
        code = EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILURE
        ready.say(f"error {code}: {exc}")
        return _fail(str(exc), code)
    except KeyboardInterrupt:
        return 130
    finally:
        ready.say(f"error {EXIT_FAILURE}: the local service stopped before it was ready")


def _image(args: argparse.Namespace, config: Config) -> int:
    from . import image
    from .stoppable import Stopped, exit_now_if_threads_remain, run_until_stopped

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        if args.image_command == "build":
            tag = args.tag or config.image

            async def build() -> None:
                await image.build(tag, base=args.base, extra_apt=args.apt, docker_host=config.docker_host, log=progress)

            run_until_stopped(build)
            print(f"mcp-code-exec: built {tag}", file=sys.stderr)
            return 0
        if args.image_command == "egress":
            from .egress_image import build_egress

            egress_tag = args.tag or config.egress.image
            build_proxy = functools.partial(
                build_egress, egress_tag, base=args.base, docker_host=config.docker_host, log=progress
            )
            took = run_until_stopped(build_proxy)
            print(f"mcp-code-exec: built {egress_tag} in {took:.0f} s", file=sys.stderr)
            return 0
        extra: dict[str, Any] = {"apt": args.apt, "requirements": args.requirements, "snippet": args.dockerfile_snippet}

        async def custom() -> None:
            await image.build_custom(
                args.tag, args.from_image or config.image, docker_host=config.docker_host, log=progress, **extra
            )

        run_until_stopped(custom)
    except Stopped as stop:
        print(f"mcp-code-exec: image {args.image_command} {stop}", file=sys.stderr)
        return exit_now_if_threads_remain(stop.exit_code)
    print(f'mcp-code-exec: built {args.tag}; set image = "{args.tag}" in your config to use it', file=sys.stderr)
    return 0
