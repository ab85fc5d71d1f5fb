"""The workload simulator behind `kvoffload simulate`: workloads (generated or a trace) replayed
through an engine model around the real offload scheduler and CPU-tier store, with no GPU and no
vLLM. `--verify-data` adds the transfer engine in CPU mode (torch)."""

from kvoffload.simulate.engine import EngineConfig, simulate
from kvoffload.simulate.models import MODELS
from kvoffload.simulate.report import SimResult
from kvoffload.simulate.trace import TraceError, load_trace
from kvoffload.simulate.workloads import (
    WORKLOADS,
    Agentic,
    Chat,
    ReasoningChat,
    SharedPrefix,
    SimRequest,
    Workload,
)

__all__ = [
    "MODELS",
    "WORKLOADS",
    "Agentic",
    "Chat",
    "EngineConfig",
    "ReasoningChat",
    "SharedPrefix",
    "SimRequest",
    "SimResult",
    "TraceError",
    "Workload",
    "load_trace",
    "simulate",
]
