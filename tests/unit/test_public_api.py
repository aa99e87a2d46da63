"""The names the package offers an embedder, pinned: a rename or a removal of one is a deliberate
change to this list, not an accident of a refactoring (as httpx's ``test_exported_members`` does)."""

from __future__ import annotations

import inspect

import mcp_code_exec
from mcp_code_exec import config, errors, mcp_server, models

PACKAGE = ["Config", "SandboxError", "SandboxService", "__version__", "load_config"]

# the exception tree of errors.py's docstring: each class and its parent
ERROR_TREE = {
    "SandboxError": "Exception",
    "EngineError": "SandboxError",
    "EngineUnavailable": "EngineError",
    "EngineDown": "EngineUnavailable",
    "ImageMissing": "EngineError",
    "VolumeSizeUnsupported": "EngineError",
    "SandboxLost": "SandboxError",
    "ProtocolViolation": "SandboxLost",
    "PoolBusy": "SandboxError",
    "PoolClosed": "SandboxError",
    "SessionNotFound": "SandboxError",
    "RunNotFound": "SandboxError",
    "SessionBusy": "SandboxError",
    "SessionLimit": "SandboxError",
    "ClientLimit": "SandboxError",
    "OverQuota": "ClientLimit",
    "AuditUnavailable": "SandboxError",
    "InvalidPath": "SandboxError",
    "FileOperationError": "SandboxError",
    "QuotaExceeded": "FileOperationError",
    "TooLarge": "FileOperationError",
    "PackageError": "SandboxError",
    "WheelError": "SandboxError",
    "NoDistribution": "WheelError",
    "PipTimeout": "WheelError",
    "DownloadTooLarge": "WheelError",
    "Unsupported": "SandboxError",
    "EgressError": "SandboxError",
    "ProxyGone": "EgressError",
    "ReachRefused": "EgressError",
    "ConfigError": "SandboxError",
}

# the results a caller sees (and the tools' output schemas)
MODELS = [
    "DirEntry",
    "ErrorInfo",
    "FigureRef",
    "FileContent",
    "FileInfo",
    "ForkedSessions",
    "ImageOutput",
    "NotebookCell",
    "NotebookView",
    "QuotaUse",
    "RunResult",
    "SessionInfo",
    "SessionUsage",
    "TablePage",
    "TableRef",
    "Usage",
    "UsageReport",
    "UsageTotals",
    "VariableInfo",
    "VariableListing",
    "WrittenFile",
]


def _classes_defined_in(module: object) -> dict[str, type]:
    return {
        name: value
        for name, value in vars(module).items()
        if inspect.isclass(value) and value.__module__ == getattr(module, "__name__", None)
    }


def test_the_package_exports_exactly_the_embedding_api() -> None:
    assert sorted(mcp_code_exec.__all__) == PACKAGE
    for name in PACKAGE:
        assert getattr(mcp_code_exec, name) is not None


def test_the_package_names_are_the_objects_of_their_homes() -> None:
    from mcp_code_exec.service import SandboxService

    assert mcp_code_exec.Config is config.Config
    assert mcp_code_exec.load_config is config.load_config
    assert mcp_code_exec.SandboxError is errors.SandboxError
    assert mcp_code_exec.SandboxService is SandboxService


def test_the_config_package_and_the_mcp_face_export_their_names() -> None:
    assert sorted(config.__all__) == ["Config", "load_config"]
    assert mcp_server.__all__ == ["build_server"]
    assert callable(mcp_server.build_server)


def test_the_error_tree_is_the_one_documented() -> None:
    defined = _classes_defined_in(errors)
    assert {name: cls.__bases__[0].__name__ for name, cls in defined.items()} == ERROR_TREE
    assert all(len(cls.__bases__) == 1 for cls in defined.values())


def test_every_error_class_is_drawn_in_the_tree_of_the_errors_docstring() -> None:
    doc = errors.__doc__ or ""
    assert [name for name in ERROR_TREE if name not in doc] == []


def test_the_result_models_are_the_ones_pinned() -> None:
    assert sorted(_classes_defined_in(models)) == MODELS
