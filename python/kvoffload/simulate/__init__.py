"""The workload simulator behind `kvoffload simulate`: workloads (generated or a trace) replayed
through an engine model around the real offload scheduler and CPU-tier store, one engine or a
fleet behind a router, with no GPU and no vLLM. `--verify-data` adds the transfer engine in CPU
mode (torch)."""

from kvoffload.simulate.fleet import FleetResult, simulate, simulate_fleet
from kvoffload.simulate.instance import EngineConfig
from kvoffload.simulate.models import MODELS
from kvoffload.simulate.report import SimResult
from kvoffload.simulate.routers import ROUTERS, TierWeights
from kvoffload.simulate.trace import (
    FORMATS,
    HashIdsRequest,
    Trace,
    TraceError,
    TraceOptions,
    load_trace,
)
from kvoffload.simulate.workloads import (
    WORKLOADS,
    Agentic,
    Chat,
    ReasoningChat,
    Request,
    SharedPrefix,
    SimRequest,
    Workload,
)

__all__ = [
    "FORMATS",
    "MODELS",
    "ROUTERS",
    "WORKLOADS",
    "Agentic",
    "Chat",
    "EngineConfig",
    "FleetResult",
    "HashIdsRequest",
    "ReasoningChat",
    "Request",
    "SharedPrefix",
    "SimRequest",
    "SimResult",
    "TierWeights",
    "Trace",
    "TraceError",
    "TraceOptions",
    "Workload",
    "load_trace",
    "simulate",
    "simulate_fleet",
]
