"""Serving core: requests, latency model, threshold/load control, scheduler, engine, router.

Kept light on purpose: importing this package imports no JAX and no runner; the policy modules
(request, latency, threshold, scheduler) are pure Python + numpy so the simulator can reuse them.
"""
from dilaserve_jax.serving.latency import FitReport, LatencyModel, Profile, ProfilePoint, fit
from dilaserve_jax.serving.request import IllegalTransition, Request, RequestState
from dilaserve_jax.serving.scheduler import POLICIES, AddResult, Scheduler, SchedulerConfig
from dilaserve_jax.serving.threshold import DEFAULT_PRIOR, TAU_GRID, ThresholdConfig, ThresholdController
from dilaserve_jax.serving.types import Admission, Runner, SlotOutcome, StepKind, StepPlan

__all__ = [
    "Admission", "AddResult", "DEFAULT_PRIOR", "FitReport", "IllegalTransition", "LatencyModel", "POLICIES",
    "Profile", "ProfilePoint", "Request", "RequestState", "Runner", "Scheduler", "SchedulerConfig",
    "SlotOutcome", "StepKind", "StepPlan", "TAU_GRID", "ThresholdConfig", "ThresholdController", "fit",
]
