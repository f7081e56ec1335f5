"""tests/durations.py reads pytest's junit XML: a module's cases, a class's, and a module skipped whole."""
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("durations", Path(__file__).resolve().parents[1] / "durations.py")
durations = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(durations)

XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.unit.test_a" name="test_one" time="1.5"/>
<testcase classname="tests.unit.test_a.TestGroup" name="test_two" time="0.5"><failure message="x"/></testcase>
<testcase classname="tests.e2e.test_b" name="test_three" time="2.0"><skipped message="no"/></testcase>
<testcase classname="" name="tests.e2e.test_vllm" time="0.000"><skipped message="vLLM is not installed"/></testcase>
</testsuite></testsuites>"""


def test_each_case_is_charged_to_its_module_and_a_module_skipped_whole_keeps_its_name(tmp_path):
    path = tmp_path / "r.xml"
    path.write_text(XML)
    assert durations.read(str(path)) == [
        ("tests/unit/test_a.py", "test_one", 1.5, "passed"),
        ("tests/unit/test_a.py", "test_two", 0.5, "failed"),
        ("tests/e2e/test_b.py", "test_three", 2.0, "skipped"),
        ("tests/e2e/test_vllm.py", "tests.e2e.test_vllm", 0.0, "skipped"),
    ]
