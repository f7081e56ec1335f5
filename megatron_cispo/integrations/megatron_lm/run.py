"""Zero-edit launcher: patch Megatron-LM with megatron_cispo, then run the fork's own script.

    python -m megatron_cispo.integrations.megatron_lm.run path/to/train_rl.py <megatron args> \
        --cispo-policy-loss cispo --cispo-anchor rollout --rl-inference-logprobs-is-correction
    torchrun --nproc-per-node 8 -m megatron_cispo.integrations.megatron_lm.run path/to/train_rl.py ...
    python -m megatron_cispo.integrations.megatron_lm.run path/to/train_rl.py --help   # every flag
The script runs as __main__ with its own directory first on sys.path, as `python script.py` would.
Needs Megatron-LM's packages: pip install "megatron_cispo[megatron-lm]".
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path
from typing import Optional

from ..plugins import PluginImportError, load_plugins
from .patch import HELP_FLAGS, MegatronLMDependencyError, MegatronLMVersionError, install
from .settings import extra_args_provider

USAGE = "usage: python -m megatron_cispo.integrations.megatron_lm.run path/to/train_rl.py [megatron and --cispo-* args]"


def flags_help() -> str:
    """The usage line and the --cispo-* flags, as Megatron's --help shows them."""
    parser = extra_args_provider(argparse.ArgumentParser(usage=USAGE[len("usage: "):], add_help=False))
    return (parser.format_help() + "\nWith a script, `... run path/to/train_rl.py --help` lists Megatron-LM's "
            "flags and these.\n")


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in HELP_FLAGS:
        print(flags_help())
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    script = Path(argv[0]).resolve()
    if not script.is_file():
        print(f"{USAGE}\nerror: script {argv[0]!r} not found", file=sys.stderr)
        return 2
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.parent))  # the Megatron-LM root, for `megatron`, `gpt_builders`, ...
    try:
        load_plugins()
        install()  # the LossConfig comes from the --cispo-* flags once Megatron has parsed them
    except (MegatronLMVersionError, MegatronLMDependencyError, PluginImportError) as e:
        if os.environ.get("RANK", "0") == "0":  # every rank fails alike: say it once
            print(f"error: {e}", file=sys.stderr)
        return 2
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
