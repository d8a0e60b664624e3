"""Shared click options that build a ModelConfig: --config FILE, --objective, --set KEY=VALUE; and the
benchmarks' per-arm learning rates, --lr ARM=RATE."""
from __future__ import annotations

import dataclasses
import json

import click

from ..blocks.config import ConfigError, ModelConfig


class _ObjectiveOption(click.Option):
    """``--objective``, whose help lists the registered objectives: read from the registry (which loads
    PyTorch) only when the help is shown, so a command that never trains starts without torch."""

    def __init__(self, *args, default_text: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.default_text = default_text

    def get_help_record(self, ctx):
        from ..blocks.objectives import OBJECTIVES
        self.help = f"Objective: {', '.join(OBJECTIVES)} (default: {self.default_text})."
        return super().get_help_record(ctx)


def config_options(fn=None, *, default_objective: str | None = None):
    """--config, --objective, --set. ``default_objective``: the objective when neither the flags nor
    the config file name one (``seed``: a new run's; see :func:`build_config`)."""
    if fn is None:
        return lambda f: config_options(f, default_objective=default_objective)
    default = (f"{default_objective}, unless --set objective=... or the --config file names one"
               if default_objective else "the config's")
    fn = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                      help="Override one config field, e.g. --set n_blocks=4 --set d_model=128.")(fn)
    fn = click.option("--objective", cls=_ObjectiveOption, default=None, default_text=default, help="Objective.")(fn)
    fn = click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                      help="Model/run config file (TOML or JSON).")(fn)
    return fn


def build_config(config_path: str | None, objective: str | None, overrides: tuple[str, ...],
                 default_objective: str | None = None) -> ModelConfig:
    """The config from a file (or the defaults), then --set, then --objective. ``default_objective``
    replaces the config's default objective when none of them names one."""
    raw = ModelConfig.read(config_path) if config_path else {}
    cfg = ModelConfig.from_dict(raw, source=str(config_path)) if config_path else ModelConfig()
    in_file = raw.get("model", raw) if isinstance(raw, dict) and isinstance(raw.get("model"), dict) else raw
    if default_objective and not objective and "objective" not in in_file and \
            not any(item.split("=", 1)[0].strip() == "objective" for item in overrides):
        objective = default_objective
    changes: dict = {}
    fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"extra"}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        key = key.strip()
        if key not in fields:
            raise ConfigError(f"--set: unknown field '{key}'")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        changes[key] = value
    if objective:
        changes["objective"] = objective
    if changes:
        cfg = ModelConfig.from_dict({**cfg.to_dict(), **changes}, source="command line")
    from ..blocks.objectives import get_objective  # validates the objective name
    get_objective(cfg)
    return cfg


def lr_items(items: tuple[str, ...]) -> dict[str, float]:
    """``--lr ARM=RATE`` items (``bench quality``, ``bench pipeline``) as {arm: rate}; a clear error for a
    missing arm or a rate that is not a positive finite number."""
    out = {}
    for item in items:
        arm, _, value = item.partition("=")
        try:
            lr = float(value)
        except ValueError:
            lr = -1.0
        if not arm.strip() or not 0 < lr < float("inf"):
            raise click.BadParameter(f"expected ARM=RATE with a positive rate, got {item!r}", param_hint="--lr")
        out[arm.strip()] = lr
    return out
