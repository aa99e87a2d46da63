import os
import sys

# ``python -m mcp_code_exec`` without -I or -P put the directory it was started in first on sys.path.
# This package was looked for there before any of its code ran (so a package planted there has
# already run: start it with ``python -I -m``, see docs/security.md); at least nothing imported from
# here on is looked for there.
try:
    started_in: str | None = os.getcwd()
except OSError:  # removed since
    started_in = None
if not sys.flags.safe_path and sys.path and sys.path[0] == started_in:
    del sys.path[0]

from .commands.cli import main  # after the working directory left sys.path

sys.exit(main())
