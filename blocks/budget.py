"""Training budgets given on the command line: "500steps", "90s", "2m", "1h"."""
from __future__ import annotations

import re
from dataclasses import dataclass

_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(steps?|s|sec|m|min|h)\s*$")


class BudgetError(ValueError):
    pass


@dataclass(frozen=True)
class Budget:
    steps: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str) -> "Budget":
        m = _RE.match(str(text).lower())
        if not m:
            raise BudgetError(f"budget {text!r} not understood: use e.g. '500steps', '90s', '5m', '1h'")
        value, unit = float(m.group(1)), m.group(2)
        if value <= 0:
            raise BudgetError(f"budget must be positive, got {text!r}")
        if unit.startswith("step"):
            if value != int(value):
                raise BudgetError(f"a step budget must be a whole number, got {text!r}")
            return cls(steps=int(value))
        scale = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}[unit]
        return cls(seconds=value * scale)

    def done(self, steps: int, elapsed: float) -> bool:
        if self.steps is not None:
            return steps >= self.steps
        return elapsed >= (self.seconds or 0)

    def fraction(self, steps: int, elapsed: float) -> float:
        if self.steps is not None:
            return min(1.0, steps / self.steps)
        return min(1.0, elapsed / (self.seconds or 1))

    def __str__(self) -> str:
        return f"{self.steps}steps" if self.steps is not None else f"{self.seconds:g}s"
