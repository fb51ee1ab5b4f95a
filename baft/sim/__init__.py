"""Pure discrete-event simulation of pipeline schedules and checkpoint plans at cluster scale."""

from baft.sim.schedules import SCHEDULES, Action, build_schedule
from baft.sim.simulator import Background, Interval, SimResult, StageTimes, simulate

__all__ = [
    "SCHEDULES",
    "Action",
    "Background",
    "Interval",
    "SimResult",
    "StageTimes",
    "build_schedule",
    "simulate",
]
