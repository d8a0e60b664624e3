"""``bt-node bench simulate``: a discrete-event simulation of a volunteer network under churn.

``model`` (settings, churn presets, what is assumed), ``engine`` (the event loop), ``report``
(figures, the two-policy comparison, the plot). The block policies are the node's own
(``node/routing/selection.py``), not copies.
"""
from .model import ASSUMED, CHURN_PRESETS, SimSettings
from .report import COVERAGE_BAR, POLICIES, plot_simulation, run_simulation, simulate

__all__ = ["ASSUMED", "CHURN_PRESETS", "SimSettings", "COVERAGE_BAR", "POLICIES", "plot_simulation",
           "run_simulation", "simulate"]
