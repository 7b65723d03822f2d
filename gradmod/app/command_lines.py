"""What the commands that read a finished run (``gradmod scores``, ``gradmod influence``) share:
bad input as the command's one line on stderr, exit 2; a file that cannot be read or written, exit 1."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable


def parser(command: str, usage: str, description: str) -> argparse.ArgumentParser:
    """An argument parser whose error is the command's one line (its usage in it), exit status 2."""

    class OneLine(argparse.ArgumentParser):
        def error(self, message: str):  # type: ignore[override]
            print(f"error: gradmod {command}: {message}; usage: {usage}", file=sys.stderr)
            sys.exit(2)

    return OneLine(prog=f"gradmod {command}", usage=usage, description=description)


def reported(command: str, call: Callable[[], Any]) -> Any:
    """``call()``'s result, or the exit status after its one line: 2 for bad input (a ValueError),
    1 for a file that cannot be read or written (an OSError)."""
    from gradmod.run.folder import endings

    try:
        return call()
    except ValueError as e:
        print(f"error: gradmod {command}: {endings.one_line(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: gradmod {command}: {endings.describe_os_error(e)}", file=sys.stderr)
        return 1
