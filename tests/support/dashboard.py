"""berth's Grafana dashboard (deploy/grafana/berth.json) as its tests read it: its panels, their queries, and a
query with Grafana's template variables replaced by values, as Grafana would before it asks Prometheus."""

from __future__ import annotations

import json
import re

from tests.support.paths import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "berth.json"

# $name, ${name}, ${name:format} and the old [[name]]
_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]")


def panels() -> list[dict]:
    """Every panel but the rows, those inside collapsed rows too."""
    found, todo = [], list(json.loads(DASHBOARD.read_text())["panels"])
    while todo:
        panel = todo.pop(0)
        todo += panel.get("panels", [])
        if panel["type"] != "row":
            found.append(panel)
    return found


def queries() -> list[tuple[str, str]]:
    """(panel title, query) of every panel's every target."""
    return [(p["title"], t["expr"]) for p in panels() for t in p["targets"]]


def _seconds(s: float) -> str:
    return f"{max(round(s), 1)}s"


def grafana_variables(step: float = 15.0, scrape_interval: float = 15.0, range_seconds: float = 3600.0) -> dict:
    """The values Grafana gives its built-in variables for a graph of ``range_seconds`` drawn a point every
    ``step`` seconds over a Prometheus scraping every ``scrape_interval``, and the dashboard's own variables:
    their current value (a list of them as a regex alternation), or every value (``.+``) where none is set."""
    values = {
        "__interval": _seconds(step), "__interval_ms": str(round(step * 1000)),
        # Grafana: the larger of four scrape intervals and the step plus one scrape interval
        "__rate_interval": _seconds(max(4 * scrape_interval, step + scrape_interval)),
        "__range": _seconds(range_seconds), "__range_s": str(round(range_seconds)),
        "__range_ms": str(round(range_seconds * 1000)),
    }
    for variable in json.loads(DASHBOARD.read_text()).get("templating", {}).get("list", []):
        current = variable.get("current", {}).get("value")
        if isinstance(current, list):
            current = "|".join(current)
        values[variable["name"]] = ".+" if current in (None, "", "$__all") else current
    return values


def with_variables(expr: str, values: dict) -> str:
    """``expr`` with every template variable replaced; a KeyError names one nobody defines."""
    return _VARIABLE.sub(lambda m: values[next(g for g in m.groups() if g)], expr)
