"""Zero-edit launcher: patch Megatron-LM with megatron_cispo, then run the fork's own script.

    python -m megatron_cispo.integrations.megatron_lm.run path/to/train_rl.py <megatron args> \
        --cispo-policy-loss cispo --cispo-anchor rollout --rl-inference-logprobs-is-correction
    torchrun --nproc-per-node 8 -m megatron_cispo.integrations.megatron_lm.run path/to/train_rl.py ...
The script runs as __main__ with its own directory first on sys.path, as `python script.py` would.
"""
from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Optional

from ..plugins import load_plugins
from .patch import install

USAGE = "usage: python -m megatron_cispo.integrations.megatron_lm.run path/to/train_rl.py [megatron and --cispo-* args]"


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 2
    script = Path(argv[0]).resolve()
    if not script.is_file():
        print(f"{USAGE}\nerror: script {argv[0]!r} not found", file=sys.stderr)
        return 2
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.parent))  # the Megatron-LM root, for `megatron`, `gpt_builders`, ...
    load_plugins()
    install()  # the LossConfig comes from the --cispo-* flags once Megatron has parsed them
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
