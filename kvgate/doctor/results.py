"""One check's outcome and the table `kvgate doctor` prints."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tabulate import tabulate

# Columns wrap at these widths so a failure's fix stays readable in an 120-column terminal.
_WIDTHS = (20, 10, 6, 44, 44)


@dataclass(frozen=True, slots=True)
class CheckResult:
    check: str
    subject: str  # an instance id, or "store" / "gateway"
    passed: bool
    detail: str
    fix: str = ""


def render(results: Sequence[CheckResult]) -> str:
    rows = [(r.check, r.subject, "PASS" if r.passed else "FAIL", r.detail, r.fix or "-") for r in results]
    failed = sum(1 for r in results if not r.passed)
    summary = f"{len(results) - failed} passed, {failed} failed"
    table = tabulate(rows, headers=("check", "subject", "result", "detail", "fix"), tablefmt="grid",
                     maxcolwidths=list(_WIDTHS))
    return f"{table}\n{summary}"
