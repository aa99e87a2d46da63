"""Which zygote a stateless cell's worker comes from: the lean one (see ``zygote.lean``) unless the
cell may import something beyond the standard library and IPython.

A cell without the word ``import`` cannot name a module it has not imported, so it goes lean
without being parsed. Any other cell goes lean only when it parses as plain Python (IPython's
magics and shell escapes do not) and every module it imports, by statement or by a call of
``__import__`` or ``importlib``, is one of the standard library's or IPython's. The check only chooses the
faster of two workers that run every cell alike: a cell it sends lean that imports pandas after
all (through ``exec``, say) pays for the import there, and nothing else.
"""

from __future__ import annotations

import ast
import sys
import warnings

# Bytes: a larger cell goes to the full zygote unparsed. Parsing costs about 0.4 ms a KiB (more for
# f-strings), so beyond this it would cost more than the lean worker saves.
MAX_PARSED = 16 << 10
# The standard library, and what the lean zygote holds besides: IPython (``IPython.display`` is how
# a cell shows rich output) and code mode's module, the agent's own.
LEAN_MODULES = frozenset(sys.stdlib_module_names) | {"IPython", "mcp_tools"}
IMPORTERS = frozenset({"__import__", "import_module"})


def needs_libraries(code: bytes) -> bool:
    """Whether the cell may import a module beyond the standard library's."""
    if b"import" not in code:
        return False
    if len(code) > MAX_PARSED:
        return True
    try:
        with warnings.catch_warnings():  # the parser's SyntaxWarnings would go to the container's stderr
            warnings.simplefilter("ignore")
            tree = ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError, LookupError, UnicodeError):
        return True  # IPython syntax, or not Python at all: the full zygote's worker says which
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(alias.name.partition(".")[0] not in LEAN_MODULES for alias in node.names):
                return True
        elif isinstance(node, ast.ImportFrom):
            if node.level or (node.module or "").partition(".")[0] not in LEAN_MODULES:
                return True
        elif isinstance(node, ast.Name | ast.Attribute) and (
            (node.id if isinstance(node, ast.Name) else node.attr) in IMPORTERS
        ):
            return True
    return False
