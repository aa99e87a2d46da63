"""The notebook shell that runs user code inside a worker.

Built once in the supervisor (before any fork, so every worker starts from the same pristine,
already-imported state) but only ever *used* inside a worker that has dropped to uid 1000.
Displays, the last expression's value, figures and tracebacks are captured into a ``Sink`` that
streams them as frames on the worker's result pipe instead of printing them.
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from ..output import ANSI
from . import packages
from .figures import flush_figures
from .sink import SINK
from .tracebacks import QuickContextTB, error_info


class CapturingDisplayHook(DisplayHook):
    """The last expression's value becomes ``result`` instead of an ``Out[n]:`` print."""

    def start_displayhook(self) -> None:
        pass

    def write_output_prompt(self) -> None:
        pass

    def write_format_data(self, format_dict: dict[str, Any], md_dict: Any = None) -> None:
        SINK.display(format_dict, is_result=True)

    def finish_displayhook(self) -> None:
        pass


class CapturingDisplayPublisher(DisplayPublisher):
    def publish(self, data: dict[str, Any], metadata: Any = None, source: Any = None, **_: Any) -> None:
        SINK.display(data)

    def clear_output(self, wait: bool = False) -> None:
        pass


class SandboxShell(InteractiveShell):
    displayhook_class = CapturingDisplayHook
    display_pub_class = CapturingDisplayPublisher

    def init_display_formatter(self) -> None:
        """Every object formatted for a cell's value or ``display()`` passes by the table keeper first."""
        super().init_display_formatter()
        plain = self.display_formatter.format

        def format_and_keep(obj: Any, include: Any = None, exclude: Any = None) -> Any:
            SINK.table(obj)
            return plain(obj, include=include, exclude=exclude)

        self.display_formatter.format = format_and_keep

    def _showtraceback(self, etype: type, evalue: BaseException, stb: list[str]) -> None:
        text = ANSI.sub("", "\n".join(stb))
        SINK.raised(error_info(etype, evalue, text))

    def init_virtualenv(self) -> None:
        pass

    def init_traceback_handlers(self, custom_exceptions: Any) -> None:
        super().init_traceback_handlers(custom_exceptions)
        previous: Any = getattr(self, "InteractiveTB")  # noqa: B009 - set by IPython, typed Any here
        self.InteractiveTB = QuickContextTB(  # IPython 9: colours by theme; the printers are not Configurables
            mode=previous.mode,
            theme_name="nocolor",
            tb_offset=previous.tb_offset,
            check_cache=previous.check_cache,
            debugger_cls=self.debugger_cls,
        )


NOT_PLAIN = re.compile(
    r"^(?:[ \t]*[%!/,;]|>>>|\.\.\.|In \[|[ \t]*\.\.\.+:|[ \t]*pip3?[ \t]+(?:install|uninstall|list|show|freeze)\b)",
    re.MULTILINE,
)
PLAIN_EVENTS: dict[str, int] = {}  # the event callbacks of a fresh shell (run_cell's own)
PLAIN_TRANSFORMS: tuple[int, ...] = ()
EXIT_HINT = "To exit: use 'exit', 'quit', or Ctrl-D."


@dataclass
class LeanResult:
    """What worker.execute reads of IPython's ExecutionResult."""

    error_before_exec: BaseException | None = None
    error_in_exec: BaseException | None = None


def _transforms(shell: InteractiveShell) -> tuple[int, ...]:
    manager = shell.input_transformer_manager
    return (
        len(manager.cleanup_transforms),
        len(manager.line_transforms),
        len(manager.token_transformers),
        len(shell.input_transformers_post),
        len(shell.ast_transformers),
    )


def lean_eligible(shell: InteractiveShell, code: str) -> bool:
    """True when IPython's run_cell would only parse and run this cell as plain Python."""
    if not code or code.isspace() or "?" in code or NOT_PLAIN.search(code) is not None:
        return False
    if shell.autocall or shell.ast_node_interactivity != "last_expr":
        return False
    # Magics may have hooked the shell (%load_ext autoreload, %matplotlib inline, transformers).
    callbacks = shell.events.callbacks
    if any(len(callbacks.get(name, ())) != count for name, count in PLAIN_EVENTS.items()):
        return False
    return _transforms(shell) == PLAIN_TRANSFORMS


def run_lean(shell: InteractiveShell, raw_code: str, *, store_history: bool = True) -> LeanResult | None:
    """Run a plain-Python cell as IPython's ``run_cell`` would, without its machinery.

    The same compiler (``__future__`` flags carry over), cell names (tracebacks say ``Cell In[n]``),
    namespace, traceback formatting, display formatter, ``_``/``Out`` and execution count; well under
    half the memory pages written. None (nothing run; only the cell's source cached under the name
    run_cell gives it too) when the cell is not plain Python or does not compile as such (top-level
    ``await``, a bare ``return``): the caller then uses ``run_cell``, which reports those its own way.
    """
    if not lean_eligible(shell, raw_code):
        return None
    lines = raw_code.splitlines(keepends=True)
    start = 0
    while start < len(lines) and (not lines[start] or lines[start].isspace()):
        start += 1  # IPython drops leading blank lines (and so numbers the lines after them)
    code = "".join(lines[start:])
    if not code.endswith("\n"):
        code += "\n"
    number = shell.execution_count
    shell.events.trigger("pre_execute")
    result = LeanResult()
    with shell.builtin_trap, shell.display_trap:
        compiled = _compile_cell(shell, code, raw_code, number, store_history)
        if compiled is None:
            return None
        run, value, last = compiled
        if store_history:
            shell.history_manager.store_inputs(number, code, raw_code)
        try:
            if run is not None:
                exec(run, shell.user_global_ns, shell.user_ns)  # noqa: S102 - running user code is the point
            if value is not None:
                shown = eval(value, shell.user_global_ns, shell.user_ns)  # noqa: S307
                if shown is not None and not quiet(code, last):
                    format_dict, _ = shell.display_formatter.format(shown)
                    shell.displayhook.update_user_ns(shown)
                    if format_dict:
                        SINK.display(format_dict, is_result=True)
        except SystemExit as exc:
            result.error_in_exec = exc
            shell.showtraceback(exception_only=True)
            code_obj = InteractiveShell.run_code.__code__  # run_cell's own warning comes from there
            warnings.warn_explicit(EXIT_HINT, UserWarning, code_obj.co_filename, hint_line(code_obj))
        except BaseException as exc:  # noqa: BLE001 - as run_code: every error is the cell's
            result.error_in_exec = exc
            if isinstance(exc, SyntaxError) and exc.__traceback__ is not None:
                # IPython's SyntaxTB lists every frame (tb_offset does not apply): not ours.
                exc.__traceback__ = exc.__traceback__.tb_next
            shell.showtraceback(running_compiled_code=True)
    shell.last_execution_succeeded = result.error_in_exec is None
    shell.events.trigger("post_execute")
    if store_history:
        shell.execution_count += 1
    return result


def _compile_cell(
    shell: InteractiveShell, code: str, raw_code: str, number: int, store_history: bool
) -> tuple[Any, Any, ast.Expr | None] | None:
    """The cell compiled as run_cell would (statements, then the last expression), or None when it
    does not compile plainly. Warnings are held back and shown after, so a cell handed on to run_cell
    does not warn twice."""
    compiler = shell.compile
    cell_name = compiler.cache(code, number, raw_code=raw_code) if store_history else "<cell>"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            body = compiler.ast_parse(code, filename=cell_name).body
            last = body[-1] if body and isinstance(body[-1], ast.Expr) else None
            if last is not None:
                body = body[:-1]
            run = compiler(ast.Module(body, type_ignores=[]), cell_name, "exec") if body else None
            value = compiler(ast.Expression(last.value), cell_name, "eval") if last is not None else None
        except Exception:  # noqa: BLE001 - what does not compile plainly is run_cell's to report
            return None
    for item in caught:  # e.g. an invalid escape sequence, as run_cell's parse would show it
        warnings.warn_explicit(item.message, item.category, item.filename, item.lineno or 0)
    return run, value, last


@contextlib.contextmanager
def cell_taken_back(shell: InteractiveShell) -> Iterator[None]:
    """Take back what a quiet plain cell run by ``run_lean`` leaves in the shell: its number, its
    input in the history and the ``_i`` names, its source under the cell's name in linecache.
    (A cell that shows a value, or goes through run_cell, leaves more: not for this.)"""
    history = shell.history_manager
    number = shell.execution_count
    inputs = (history._i00, history._i, history._ii, history._iii)  # store_inputs rotates these
    lengths = (len(history.input_hist_parsed), len(history.input_hist_raw), len(history.db_input_cache))
    names = {name: shell.user_ns[name] for name in ("_i", "_ii", "_iii") if name in shell.user_ns}
    cached = set(shell.compile._filename_map)  # the cell names the compiler gave (and cached)
    try:
        yield
    finally:
        shell.execution_count = number
        history._i00, history._i, history._ii, history._iii = inputs
        del history.input_hist_parsed[lengths[0] :], history.input_hist_raw[lengths[1] :]
        del history.db_input_cache[lengths[2] :]
        shell.user_ns.update(names)
        shell.user_ns.pop(f"_i{number}", None)
        shell.user_ns_hidden.pop(f"_i{number}", None)
        for name in set(shell.compile._filename_map) - cached:
            del shell.compile._filename_map[name]
            linecache.cache.pop(name, None)


def hint_line(code_obj: Any) -> int:
    """The line of run_code's ``warn(EXIT_HINT)``, so the warning reads as run_cell's would."""
    import dis

    for instruction in dis.get_instructions(code_obj):
        if instruction.argval == EXIT_HINT and instruction.positions is not None:
            return instruction.positions.lineno or code_obj.co_firstlineno
    return int(code_obj.co_firstlineno)


def quiet(code: str, last: ast.Expr | None) -> bool:
    """IPython's rule: a cell whose last token (comments aside) is ``;`` shows no result."""
    if last is None or last.end_lineno is None or last.end_col_offset is None:
        return False
    lines = code.splitlines()
    rest = lines[last.end_lineno - 1].encode()[last.end_col_offset :].decode(errors="replace")
    tail = "\n".join([rest, *lines[last.end_lineno :]])
    return tail.lstrip().startswith(";")


def make_shell() -> SandboxShell:
    config = Config()
    config.HistoryManager.enabled = False
    config.InteractiveShell.colors = "nocolor"
    config.InteractiveShell.autocall = 0
    config.InteractiveShell.xmode = "Context"
    shell: SandboxShell = SandboxShell.instance(config=config)
    packages.install_magic(shell)  # before the plain shell's shape is taken: part of it
    settle_shell(shell)
    return shell


def settle_shell(shell: SandboxShell) -> None:
    """Take the plain shell's shape, once the libraries every worker will share are loaded (again
    in the full zygote, after the data libraries; before any fork)."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        # pyplot loads its backend at the first figure: in every worker (about 370 page copies,
        # 3 ms a plot), and it then hooks post_execute on the shell, after which every cell of
        # the session would look hooked and leave the lean path. Loaded here, once, the hook is
        # part of the plain shell.
        adopt_pyplot(pyplot)
    prime_display(shell)  # before the shape is taken: whatever hooks a first display adds are part of it
    PLAIN_EVENTS.update({name: len(found) for name, found in shell.events.callbacks.items()})
    global PLAIN_TRANSFORMS
    PLAIN_TRANSFORMS = _transforms(shell)


LAST_ERROR = ("last_type", "last_value", "last_traceback")


def prime_display(shell: InteractiveShell) -> None:
    """Show a value of each kind a cell most often ends with, once, before any fork, and throw the
    result away. A process's first display does much once (IPython builds each formatter's table
    of printers, pretty and numpy set up their printing, pandas its HTML): done here, a worker that
    shows ``1+1`` writes ~110 pages instead of ~450, an array ~310 instead of ~720, a DataFrame
    ~1030 instead of ~1330. Only values of our own; the one difference it could make is undone:
    the text printers' table, built here before numpy was loaded (the first process), lacks
    numpy's float64, which IPython adds (for ``%precision``) when numpy is loaded at the first display.
    """
    values: list[object] = [0, 0.5, "", b"", [0], {"a": 0}, (0,), {0}, None, True]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        add_float64_printer(shell, numpy)
        values = [numpy.arange(3), numpy.linspace(0.0, 1.0, 3)]  # the builtins were shown before numpy
    pandas = sys.modules.get("pandas")
    if pandas is not None:
        values += [pandas.DataFrame({"a": [1.5, 2.0], "b": ["x", "y"]}), pandas.Series([1.5])]
    unset = [name for name in LAST_ERROR if not hasattr(sys, name)]
    for value in values:
        with contextlib.suppress(Exception):  # an optimisation only
            shell.display_formatter.format(value)
    for name in unset:  # a formatter's error, shown by IPython: not the user's to find
        vars(sys).pop(name, None)


def add_float64_printer(shell: InteractiveShell, numpy: Any) -> None:
    """numpy's float64 printed as float is (IPython's own rule when numpy is loaded at its first
    display): ``%precision`` applies to both."""
    plain = shell.display_formatter.formatters["text/plain"]
    plain.type_printers.setdefault(numpy.float64, plain.type_printers[float])


def adopt_pyplot(pyplot: Any) -> None:
    """Load pyplot's backend now, and make ``show`` send the open figures (as Jupyter's inline one does)."""
    pyplot.switch_backend(pyplot.get_backend())
    setattr(pyplot, "show", lambda *args, **kwargs: flush_figures())  # noqa: B010 - a module's function
