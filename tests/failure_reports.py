"""A pytest plugin (tests/conftest.py loads it): a failing test always reports its own failure.

pytest's long traceback re-parses each frame's source file with `ast.parse` to show whole
statements. On CPython 3.11.7 that parse can itself fail (`SystemError: AST constructor
recursion depth mismatch`, a CPython bug); the report then raises inside the xdist worker,
pytest prints INTERNALERROR, and the failure's own message is lost — once the run stopped after
~800 of 1,876 tests, once the failed test was simply missing from the summary (issue 26). Here
the report is made as usual, and only if making it raises is it made again in Python's own
traceback style (`--tb=native`, which parses nothing), with a section saying why.
"""

from __future__ import annotations

import pytest
from _pytest.reports import TestReport
from _pytest.runner import CallInfo


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: CallInfo[None]) -> TestReport:
    try:
        return TestReport.from_item_and_call(item, call)
    except Exception as exc:  # the report's own formatting failed, not the test
        option = item.config.option
        style = option.tbstyle
        option.tbstyle = "native"
        try:
            report = TestReport.from_item_and_call(item, call)
        finally:
            option.tbstyle = style
        report.sections.append(
            (
                "traceback style",
                f"pytest's {style} traceback could not be made ({exc!r}); Python's is shown",
            )
        )
        return report
