"""Run ``train.py`` as ``__main__`` once per argument list, in one process (the startup of
torch is most of a bad run's cost). Prints one JSON line per case: exit code, stderr."""

import contextlib
import io
import json
import runpy
import sys
import traceback
from pathlib import Path

TRAIN = str(Path(__file__).resolve().parents[2] / "train.py")

for line in sys.stdin:
    argv = json.loads(line)
    err = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        sys.argv = [TRAIN, *argv]
        try:
            runpy.run_path(TRAIN, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # what the interpreter would print and exit 1 with
            traceback.print_exc(file=err)
            code = 1
    print(json.dumps({"argv": argv, "code": code, "stderr": err.getvalue()}), flush=True)
