"""Figures and how they are shown: metrics, percentiles, the table, machine noise, the JSON report."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ...config.settings import Config


@dataclass
class Metric:
    name: str
    unit: str
    samples: list[float] = field(default_factory=list)
    value: float | None = None  # a single figure (throughput, memory) instead of samples
    target: float | None = None
    better: str = "lower"  # "lower" or "higher"
    failures: int = 0
    note: str = ""

    def percentile(self, q: float) -> float | None:
        return percentile(self.samples, q)

    @property
    def headline(self) -> float | None:
        return self.value if self.value is not None else self.percentile(50)

    @property
    def met(self) -> bool | None:
        if self.target is None or self.headline is None:
            return None
        return self.headline <= self.target if self.better == "lower" else self.headline >= self.target

    def as_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "unit": self.unit,
            "failures": self.failures,
            "target": self.target,
            "better": self.better,
        }
        if self.samples:
            data.update(
                n=len(self.samples),
                p50=self.percentile(50),
                p90=self.percentile(90),
                p99=self.percentile(99),
                mean=sum(self.samples) / len(self.samples),
                min=min(self.samples),
                max=max(self.samples),
            )
        if self.value is not None:
            data["value"] = self.value
        data["met"] = self.met
        if self.note:
            data["note"] = self.note
        return data


def percentile(samples: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None without samples."""
    if not samples:
        return None
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


RATIO_TARGETS = {"docker_run": 40.0, "docker_exec": 10.0}


def ratios(metrics: dict[str, Metric]) -> dict[str, dict[str, Any]]:
    """p50 of the naive ways over p50 of the warm stateless print, measured in the same run."""
    warm = metrics["print"].percentile(50) if "print" in metrics else None
    found: dict[str, dict[str, Any]] = {}
    for key, target in RATIO_TARGETS.items():
        other = metrics[key].percentile(50) if key in metrics else None
        value = other / warm if other and warm else None
        met = None if value is None else value >= target
        found[f"{key}_over_warm_p50"] = {"value": value, "target": target, "met": met}
    return found


def table(metrics: dict[str, Metric], *, with_ratios: bool = True) -> str:
    header = f"{'metric':<48} {'n':>4} {'p50':>9} {'p90':>9} {'p99':>9}  {'target':<14} {''}"
    lines = [header, "-" * len(header)]
    for key, metric in metrics.items():
        lines.append(_row(metric))
        if key == "print":
            p99 = metric.percentile(99)
            ok = None if p99 is None else p99 <= 25.0
            label = "  (p99 of the same)"
            lines.append(f"{label:<48} {'':>4} {'':>9} {'':>9} {fmt(p99):>9}  {'<= 25':<14} {mark_of(ok)}")
    for name, ratio in ratios(metrics).items() if with_ratios else ():
        label = name.replace("_over_warm_p50", "").replace("_", " ") + " p50 / warm print p50"
        figure = fmt(ratio["value"]) + "x"
        target = f">= {fmt(ratio['target'])}x"
        lines.append(f"{label:<48} {'':>4} {figure:>9} {'':>9} {'':>9}  {target:<14} {mark_of(ratio['met'])}")
    return "\n".join(lines)


def _row(metric: Metric) -> str:
    if metric.value is not None:
        figures = f"{'':>4} {fmt(metric.value):>9} {'':>9} {'':>9}"
    else:
        figures = (
            f"{len(metric.samples):>4} {fmt(metric.percentile(50)):>9} {fmt(metric.percentile(90)):>9} "
            f"{fmt(metric.percentile(99)):>9}"
        )
    target = ""
    if metric.target is not None:
        op = "<=" if metric.better == "lower" else ">="
        target = f"{op} {fmt(metric.target)}"
    extra = f" ({metric.failures} failed)" if metric.failures else ""
    return f"{metric.name + ' [' + metric.unit + ']':<48} {figures}  {target:<14} {mark_of(metric.met)}{extra}"


def mark_of(ok: bool | None) -> str:
    return {True: "pass", False: "MISS", None: ""}[ok]


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def cpu_times() -> list[int] | None:
    """The machine's CPU time counters (Linux /proc/stat, in clock ticks), or None elsewhere."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    return [int(value) for value in fields[1:]] if fields and fields[0] == "cpu" else None


def steal_percent(before: list[int] | None, after: list[int] | None) -> float | None:
    """Share of the elapsed CPU time a virtual machine's host gave to other guests (the 8th
    counter): on a busy host every figure is inflated, whatever the load average says."""
    if before is None or after is None or len(before) < 8 or len(after) < 8:
        return None
    total = sum(after[:8]) - sum(before[:8])
    return 100.0 * (after[7] - before[7]) / total if total > 0 else None


def config_for_subprocess(config: Config) -> dict[str, Any]:
    """The config as a server subprocess gets it: no HTTP section (no secrets), quiet logs."""
    data = config.model_dump(mode="json", exclude={"http"}, exclude_none=True)
    data["log_level"] = "warning"
    return data


def to_toml(data: dict[str, Any], prefix: str = "") -> str:
    """A TOML file for a config dump (scalars, lists, nested tables; tables in lists inline)."""
    lines: list[str] = []
    tables: list[str] = []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append(f"\n[{prefix}{key}]\n" + to_toml(value, f"{prefix}{key}."))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n" + "".join(tables)


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {_toml_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return json.dumps(value)
