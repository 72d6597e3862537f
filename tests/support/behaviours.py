"""Named checks for a scenario family: one Ray Train run (or one sequence of runs) proves several
behaviours, and a failure must still say which of them broke.

A plain ``assert`` stops at the first broken behaviour and hides whether the others held; here each
check is recorded under the behaviour's name and the scenario fails once, at its end, listing every
broken one with its evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest


@dataclass
class Behaviours:
    """``check(name, ok, evidence)`` per behaviour; ``verify()`` fails the test naming every broken one."""

    scenario: str
    passed: list[str] = field(default_factory=list)
    broken: list[tuple[str, str]] = field(default_factory=list)

    def check(self, name: str, ok: bool, evidence: object = "") -> bool:
        """Record one behaviour; returns ``ok`` so a later stage that needs it can stop early."""
        if ok:
            self.passed.append(name)
        else:
            self.broken.append((name, str(evidence)[-3000:]))
        return ok

    def verify(self) -> None:
        print(f"{self.scenario}: {len(self.passed)} behaviours held: " + "; ".join(self.passed))
        if self.broken:
            pytest.fail(f"{self.scenario}: {len(self.broken)} of {len(self.passed) + len(self.broken)} behaviours "
                        "broke:\n" + "\n".join(f"- {name}\n  {evidence}" for name, evidence in self.broken),
                        pytrace=False)
