"""One console line, whatever became of the terminal."""
from __future__ import annotations

import sys


def say(line: str, stream=None) -> None:
    """Print one console line (stderr by default). A terminal that went away (EIO after a hang-up,
    before SIGHUP's handler moved the output to run_dir/console.log) loses the line, never the run."""
    try:
        print(line, file=sys.stderr if stream is None else stream, flush=True)
    except OSError:
        pass
