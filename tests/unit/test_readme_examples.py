"""The README shows the example gate suite exactly as it ships, so the bound a reader copies is
the one the tests run."""

from __future__ import annotations

from harness.paths import REPO


def test_readme_gate_example_is_the_example_suite():
    suite = (REPO / "examples" / "user_ci" / "test_my_gate.py").read_text()
    code = suite[suite.index("MY_STRATEGY = ") :].rstrip("\n")
    readme = (REPO / "README.md").read_text()
    section = readme.split("### Gate your strategy in your CI", 1)[1]
    shown = section.split("```python\n", 1)[1].split("\n```", 1)[0]
    assert shown == code
