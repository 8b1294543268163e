"""The docs show the example gate suite exactly as it ships (docs/writing-a-strategy.md, "Gate
your strategy in your CI"), so the bound a reader copies is the one the tests run."""

from __future__ import annotations

from harness.paths import REPO


def test_docs_gate_example_is_the_example_suite():
    suite = (REPO / "examples" / "user_ci" / "test_my_gate.py").read_text()
    code = suite[suite.index("MY_STRATEGY = ") :].rstrip("\n")
    page = (REPO / "docs" / "writing-a-strategy.md").read_text()
    section = page.split("## Gate your strategy in your CI", 1)[1]
    shown = section.split("```python\n", 1)[1].split("\n```", 1)[0]
    assert shown == code
