from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORTED: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "max_new_tokens", "block_length", "slo_ms", "tau_min", "tau_max", "temperature", "seed", "request_id", "max_accuracy_drop", "strict_admission")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TAU_MIN_FIELD_NUMBER: _ClassVar[int]
    TAU_MAX_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_ACCURACY_DROP_FIELD_NUMBER: _ClassVar[int]
    STRICT_ADMISSION_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    max_new_tokens: int
    block_length: int
    slo_ms: float
    tau_min: float
    tau_max: float
    temperature: float
    seed: int
    request_id: str
    max_accuracy_drop: float
    strict_admission: bool
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., block_length: _Optional[int] = ..., slo_ms: _Optional[float] = ..., tau_min: _Optional[float] = ..., tau_max: _Optional[float] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., request_id: _Optional[str] = ..., max_accuracy_drop: _Optional[float] = ..., strict_admission: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "steps", "mean_tau", "queue_ms", "decode_ms", "total_ms", "deadline_met", "deadline_ms", "instance", "moves", "taus", "predicted_accuracy_loss")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    MEAN_TAU_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MET_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    TAUS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ACCURACY_LOSS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    steps: int
    mean_tau: float
    queue_ms: float
    decode_ms: float
    total_ms: float
    deadline_met: bool
    deadline_ms: float
    instance: str
    moves: int
    taus: _containers.RepeatedScalarFieldContainer[float]
    predicted_accuracy_loss: float
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., steps: _Optional[int] = ..., mean_tau: _Optional[float] = ..., queue_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., deadline_met: _Optional[bool] = ..., deadline_ms: _Optional[float] = ..., instance: _Optional[str] = ..., moves: _Optional[int] = ..., taus: _Optional[_Iterable[float]] = ..., predicted_accuracy_loss: _Optional[float] = ...) -> None: ...

class StepUpdate(_message.Message):
    __slots__ = ("step", "canvas", "tokens_committed", "total_committed", "tau", "step_kind")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CANVAS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    STEP_KIND_FIELD_NUMBER: _ClassVar[int]
    step: int
    canvas: str
    tokens_committed: int
    total_committed: int
    tau: float
    step_kind: str
    def __init__(self, step: _Optional[int] = ..., canvas: _Optional[str] = ..., tokens_committed: _Optional[int] = ..., total_committed: _Optional[int] = ..., tau: _Optional[float] = ..., step_kind: _Optional[str] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("update", "final")
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    update: StepUpdate
    final: GenerateResponse
    def __init__(self, update: _Optional[_Union[StepUpdate, _Mapping]] = ..., final: _Optional[_Union[GenerateResponse, _Mapping]] = ...) -> None: ...

class ClusterStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceState(_message.Message):
    __slots__ = ("name", "tp_degree", "device_ids", "slots", "running", "waiting", "steps_done", "state", "error", "quality", "host")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TP_DEGREE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    STEPS_DONE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    name: str
    tp_degree: int
    device_ids: _containers.RepeatedScalarFieldContainer[int]
    slots: int
    running: int
    waiting: int
    steps_done: int
    state: str
    error: str
    quality: QualityState
    host: str
    def __init__(self, name: _Optional[str] = ..., tp_degree: _Optional[int] = ..., device_ids: _Optional[_Iterable[int]] = ..., slots: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., steps_done: _Optional[int] = ..., state: _Optional[str] = ..., error: _Optional[str] = ..., quality: _Optional[_Union[QualityState, _Mapping]] = ..., host: _Optional[str] = ...) -> None: ...

class QualityState(_message.Message):
    __slots__ = ("budget", "mode", "served", "predicted_loss_mean", "predicted_loss_spent", "allowance", "mean_tau", "pressure")
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_LOSS_MEAN_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_LOSS_SPENT_FIELD_NUMBER: _ClassVar[int]
    ALLOWANCE_FIELD_NUMBER: _ClassVar[int]
    MEAN_TAU_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_FIELD_NUMBER: _ClassVar[int]
    budget: float
    mode: str
    served: int
    predicted_loss_mean: float
    predicted_loss_spent: float
    allowance: float
    mean_tau: float
    pressure: bool
    def __init__(self, budget: _Optional[float] = ..., mode: _Optional[str] = ..., served: _Optional[int] = ..., predicted_loss_mean: _Optional[float] = ..., predicted_loss_spent: _Optional[float] = ..., allowance: _Optional[float] = ..., mean_tau: _Optional[float] = ..., pressure: _Optional[bool] = ...) -> None: ...

class ClusterState(_message.Message):
    __slots__ = ("layout", "policy", "model", "instances", "serving", "family", "failures", "migrations", "reloads", "in_flight", "controller_mode", "decisions", "reconfigurations", "recent_migrations", "weight_updates", "checkpoint_watch")
    class FailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class MigrationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class WeightUpdatesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    RELOADS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_MODE_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    RECONFIGURATIONS_FIELD_NUMBER: _ClassVar[int]
    RECENT_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_UPDATES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_WATCH_FIELD_NUMBER: _ClassVar[int]
    layout: str
    policy: str
    model: str
    instances: _containers.RepeatedCompositeFieldContainer[InstanceState]
    serving: bool
    family: str
    failures: _containers.ScalarMap[str, str]
    migrations: _containers.ScalarMap[str, int]
    reloads: int
    in_flight: int
    controller_mode: str
    decisions: _containers.RepeatedScalarFieldContainer[str]
    reconfigurations: _containers.RepeatedScalarFieldContainer[str]
    recent_migrations: _containers.RepeatedScalarFieldContainer[str]
    weight_updates: _containers.ScalarMap[str, int]
    checkpoint_watch: CheckpointWatch
    def __init__(self, layout: _Optional[str] = ..., policy: _Optional[str] = ..., model: _Optional[str] = ..., instances: _Optional[_Iterable[_Union[InstanceState, _Mapping]]] = ..., serving: _Optional[bool] = ..., family: _Optional[str] = ..., failures: _Optional[_Mapping[str, str]] = ..., migrations: _Optional[_Mapping[str, int]] = ..., reloads: _Optional[int] = ..., in_flight: _Optional[int] = ..., controller_mode: _Optional[str] = ..., decisions: _Optional[_Iterable[str]] = ..., reconfigurations: _Optional[_Iterable[str]] = ..., recent_migrations: _Optional[_Iterable[str]] = ..., weight_updates: _Optional[_Mapping[str, int]] = ..., checkpoint_watch: _Optional[_Union[CheckpointWatch, _Mapping]] = ...) -> None: ...

class CheckpointWatch(_message.Message):
    __slots__ = ("directory", "last_step", "reloads", "skipped", "last_error", "last_reload_seconds", "polls")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    RELOADS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_RELOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLLS_FIELD_NUMBER: _ClassVar[int]
    directory: str
    last_step: int
    reloads: int
    skipped: int
    last_error: str
    last_reload_seconds: float
    polls: int
    def __init__(self, directory: _Optional[str] = ..., last_step: _Optional[int] = ..., reloads: _Optional[int] = ..., skipped: _Optional[int] = ..., last_error: _Optional[str] = ..., last_reload_seconds: _Optional[float] = ..., polls: _Optional[int] = ...) -> None: ...

class ReloadWeightsRequest(_message.Message):
    __slots__ = ("directory", "step")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    directory: str
    step: int
    def __init__(self, directory: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class ReloadWeightsResponse(_message.Message):
    __slots__ = ("model", "seconds")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    seconds: float
    def __init__(self, model: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class ReconfigureRequest(_message.Message):
    __slots__ = ("mesh",)
    MESH_FIELD_NUMBER: _ClassVar[int]
    mesh: str
    def __init__(self, mesh: _Optional[str] = ...) -> None: ...

class ControllerModeRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    def __init__(self, mode: _Optional[str] = ...) -> None: ...
