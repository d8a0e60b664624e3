"""Training budgets given on the command line: "500steps", "90s", "2m", "1h", and (``bench quality``)
a compute budget "2e13flops" that a caller turns into steps once it has measured a step's FLOPs."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

_RE = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\+?\d+)?)\s*(steps?|s|sec|m|min|h|flops)\s*$")


class BudgetError(ValueError):
    pass


@dataclass(frozen=True)
class Budget:
    steps: int | None = None
    seconds: float | None = None
    flops: float | None = None

    @classmethod
    def parse(cls, text: str) -> "Budget":
        m = _RE.match(str(text).lower())
        if not m:
            raise BudgetError(f"budget {text!r} not understood: use e.g. '500steps', '90s', '5m', '1h' "
                              "(bench quality also '2e13flops')")
        value, unit = float(m.group(1)), m.group(2)
        if not (value > 0 and math.isfinite(value)):
            raise BudgetError(f"budget must be a positive finite amount, got {text!r}")
        if unit == "flops":
            return cls(flops=value)
        if unit.startswith("step"):
            if value != int(value):
                raise BudgetError(f"a step budget must be a whole number, got {text!r}")
            return cls(steps=int(value))
        scale = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}[unit]
        return cls(seconds=value * scale)

    def _check_runnable(self) -> None:
        if self.steps is None and self.seconds is None:
            raise BudgetError(f"a {self} budget must be turned into steps before training")

    def done(self, steps: int, elapsed: float) -> bool:
        self._check_runnable()
        if self.steps is not None:
            return steps >= self.steps
        return elapsed >= (self.seconds or 0)

    def fraction(self, steps: int, elapsed: float) -> float:
        self._check_runnable()
        if self.steps is not None:
            return min(1.0, steps / self.steps)
        return min(1.0, elapsed / (self.seconds or 1))

    def __str__(self) -> str:
        if self.flops is not None:
            return f"{self.flops:g}flops"
        return f"{self.steps}steps" if self.steps is not None else f"{self.seconds:g}s"
