"""docs/integration.md section 3 stays true: its code is docs/examples/fork_step.py's (which
tests/e2e/test_fork_example.py runs), and its Rollouts table lists every field with its shape."""
import dataclasses
import re
import textwrap
from pathlib import Path

from megatron_cispo.step import Rollouts

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "integration.md").read_text()
FORK = DOC[DOC.index("## 3. An in-house fork"):DOC.index("## Custom losses")]
EXAMPLE = (ROOT / "docs" / "examples" / "fork_step.py").read_text()


def _example_blocks() -> dict[str, str]:
    found = re.findall(r"^( *)# --- doc: ([\w-]+)\n(.*?)^\1# --- end\n", EXAMPLE, re.S | re.M)
    return {name: textwrap.dedent(body) for _, name, body in found}


def test_the_fork_recipes_code_blocks_are_the_example_scripts_verbatim():
    blocks = _example_blocks()
    assert set(blocks) == {"set-up", "model", "step"}
    quoted = re.findall(r"```python\n(.*?)```", FORK, re.S)
    assert quoted == [blocks["set-up"], blocks["model"], blocks["step"]]


def _rollouts_table() -> dict[str, str]:
    """field -> its 'shape, dtype' cell, from the table under '### Rollouts'."""
    table = FORK[FORK.index("### Rollouts"):]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, re.M)
    return dict(rows)


def test_the_rollouts_table_lists_every_field_with_the_shape_its_field_doc_gives():
    table = _rollouts_table()
    fields = {f.name: f.metadata["doc"] for f in dataclasses.fields(Rollouts)}
    assert list(table) == list(fields), "docs/integration.md's Rollouts table and step/rollouts.py differ"
    for name, doc in fields.items():
        shape = re.match(r"\[[^\]]*\]", doc).group(0)  # every field doc opens with its shape
        assert table[name].startswith(f"`{shape}`"), (name, table[name], shape)
