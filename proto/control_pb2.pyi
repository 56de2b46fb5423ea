from swarmavg.proto import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("dtype", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: _tensor_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorBytes(_message.Message):
    __slots__ = ("index", "offset", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class AverageStart(_message.Message):
    __slots__ = ("key", "weight", "group_size", "min_group_size", "timeout", "codec", "tensors", "shm_name", "shm_size", "client_id", "shm_reuse", "state_digest", "aggregation", "inputs_checked", "max_group_size")
    KEY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_SIZE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_REUSE_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    INPUTS_CHECKED_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    key: str
    weight: float
    group_size: int
    min_group_size: int
    timeout: float
    codec: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    shm_name: str
    shm_size: int
    client_id: str
    shm_reuse: bool
    state_digest: bytes
    aggregation: str
    inputs_checked: bool
    max_group_size: int
    def __init__(self, key: _Optional[str] = ..., weight: _Optional[float] = ..., group_size: _Optional[int] = ..., min_group_size: _Optional[int] = ..., timeout: _Optional[float] = ..., codec: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., shm_name: _Optional[str] = ..., shm_size: _Optional[int] = ..., client_id: _Optional[str] = ..., shm_reuse: _Optional[bool] = ..., state_digest: _Optional[bytes] = ..., aggregation: _Optional[str] = ..., inputs_checked: _Optional[bool] = ..., max_group_size: _Optional[int] = ...) -> None: ...

class AverageRequest(_message.Message):
    __slots__ = ("start", "data", "start_before_inputs", "inputs_written")
    START_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    START_BEFORE_INPUTS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    start: AverageStart
    data: TensorBytes
    start_before_inputs: AverageStart
    inputs_written: InputsWritten
    def __init__(self, start: _Optional[_Union[AverageStart, _Mapping]] = ..., data: _Optional[_Union[TensorBytes, _Mapping]] = ..., start_before_inputs: _Optional[_Union[AverageStart, _Mapping]] = ..., inputs_written: _Optional[_Union[InputsWritten, _Mapping]] = ...) -> None: ...

class InputsWritten(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AverageAccepted(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AverageDone(_message.Message):
    __slots__ = ("group_size", "peers", "group_id", "partial", "timings", "bytes_sent", "bytes_received", "local_callers", "codec", "state_digests", "aggregation", "num_adjusted", "weights_clipped", "local_fraction")
    class TimingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class StateDigestsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CALLERS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    NUM_ADJUSTED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FRACTION_FIELD_NUMBER: _ClassVar[int]
    group_size: int
    peers: _containers.RepeatedScalarFieldContainer[str]
    group_id: str
    partial: bool
    timings: _containers.ScalarMap[str, float]
    bytes_sent: int
    bytes_received: int
    local_callers: int
    codec: str
    state_digests: _containers.ScalarMap[str, bytes]
    aggregation: str
    num_adjusted: int
    weights_clipped: int
    local_fraction: float
    def __init__(self, group_size: _Optional[int] = ..., peers: _Optional[_Iterable[str]] = ..., group_id: _Optional[str] = ..., partial: _Optional[bool] = ..., timings: _Optional[_Mapping[str, float]] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., local_callers: _Optional[int] = ..., codec: _Optional[str] = ..., state_digests: _Optional[_Mapping[str, bytes]] = ..., aggregation: _Optional[str] = ..., num_adjusted: _Optional[int] = ..., weights_clipped: _Optional[int] = ..., local_fraction: _Optional[float] = ...) -> None: ...

class AverageResponse(_message.Message):
    __slots__ = ("accepted", "data", "done")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    accepted: AverageAccepted
    data: TensorBytes
    done: AverageDone
    def __init__(self, accepted: _Optional[_Union[AverageAccepted, _Mapping]] = ..., data: _Optional[_Union[TensorBytes, _Mapping]] = ..., done: _Optional[_Union[AverageDone, _Mapping]] = ...) -> None: ...

class DHTStoreRequest(_message.Message):
    __slots__ = ("key", "value", "ttl", "subkey", "has_subkey")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    SUBKEY_FIELD_NUMBER: _ClassVar[int]
    HAS_SUBKEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    ttl: float
    subkey: bytes
    has_subkey: bool
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ..., ttl: _Optional[float] = ..., subkey: _Optional[bytes] = ..., has_subkey: _Optional[bool] = ...) -> None: ...

class DHTStoreResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    def __init__(self, stored: _Optional[bool] = ...) -> None: ...

class DHTGetRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class DHTGetResponse(_message.Message):
    __slots__ = ("found", "value", "is_dict")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    IS_DICT_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    is_dict: bool
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ..., is_dict: _Optional[bool] = ...) -> None: ...

class StateHeader(_message.Message):
    __slots__ = ("metadata", "tensors", "shm_name", "shm_size", "shm_reuse")
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHM_REUSE_FIELD_NUMBER: _ClassVar[int]
    metadata: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    shm_name: str
    shm_size: int
    shm_reuse: bool
    def __init__(self, metadata: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., shm_name: _Optional[str] = ..., shm_size: _Optional[int] = ..., shm_reuse: _Optional[bool] = ...) -> None: ...

class StateMessage(_message.Message):
    __slots__ = ("header", "data", "progress")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    header: StateHeader
    data: TensorBytes
    progress: StateProgress
    def __init__(self, header: _Optional[_Union[StateHeader, _Mapping]] = ..., data: _Optional[_Union[TensorBytes, _Mapping]] = ..., progress: _Optional[_Union[StateProgress, _Mapping]] = ...) -> None: ...

class StateProgress(_message.Message):
    __slots__ = ("bytes_done", "bytes_total", "seconds")
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    bytes_done: int
    bytes_total: int
    seconds: float
    def __init__(self, bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class PublishStateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadStateRequest(_message.Message):
    __slots__ = ("timeout", "max_bytes", "shm_name")
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    timeout: float
    max_bytes: int
    shm_name: str
    def __init__(self, timeout: _Optional[float] = ..., max_bytes: _Optional[int] = ..., shm_name: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CodecStats(_message.Message):
    __slots__ = ("rounds", "bytes_sent", "bytes_received", "seconds")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    bytes_sent: int
    bytes_received: int
    seconds: float
    def __init__(self, rounds: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("peer_id", "run_id", "address", "control", "client_mode", "known_peers", "dht_size_estimate", "rounds_done", "rounds_failed", "bytes_sent", "bytes_received", "codecs", "failures", "uptime", "version", "active_calls", "shm_dir", "shm_dev", "shm_ino", "pid", "bandwidth", "bandwidth_measured", "bandwidth_samples", "rounds_partial", "kind", "stored_records", "reachability", "relay", "relay_id", "observed_host", "relay_moves", "relaying_reservations", "relayed_bytes", "relayed_connections", "direct_peers", "punches_succeeded", "punches_failed", "trainers")
    class CodecsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: CodecStats
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[CodecStats, _Mapping]] = ...) -> None: ...
    class FailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    CLIENT_MODE_FIELD_NUMBER: _ClassVar[int]
    KNOWN_PEERS_FIELD_NUMBER: _ClassVar[int]
    DHT_SIZE_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_DONE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_CALLS_FIELD_NUMBER: _ClassVar[int]
    SHM_DIR_FIELD_NUMBER: _ClassVar[int]
    SHM_DEV_FIELD_NUMBER: _ClassVar[int]
    SHM_INO_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_MEASURED_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STORED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    REACHABILITY_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_HOST_FIELD_NUMBER: _ClassVar[int]
    RELAY_MOVES_FIELD_NUMBER: _ClassVar[int]
    RELAYING_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    RELAYED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RELAYED_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    DIRECT_PEERS_FIELD_NUMBER: _ClassVar[int]
    PUNCHES_SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    PUNCHES_FAILED_FIELD_NUMBER: _ClassVar[int]
    TRAINERS_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    run_id: str
    address: str
    control: str
    client_mode: bool
    known_peers: int
    dht_size_estimate: float
    rounds_done: int
    rounds_failed: int
    bytes_sent: int
    bytes_received: int
    codecs: _containers.MessageMap[str, CodecStats]
    failures: _containers.ScalarMap[str, int]
    uptime: float
    version: str
    active_calls: int
    shm_dir: str
    shm_dev: int
    shm_ino: int
    pid: int
    bandwidth: float
    bandwidth_measured: bool
    bandwidth_samples: int
    rounds_partial: int
    kind: str
    stored_records: int
    reachability: str
    relay: str
    relay_id: str
    observed_host: str
    relay_moves: int
    relaying_reservations: int
    relayed_bytes: int
    relayed_connections: int
    direct_peers: _containers.RepeatedScalarFieldContainer[str]
    punches_succeeded: int
    punches_failed: int
    trainers: _containers.RepeatedCompositeFieldContainer[LocalTrainer]
    def __init__(self, peer_id: _Optional[str] = ..., run_id: _Optional[str] = ..., address: _Optional[str] = ..., control: _Optional[str] = ..., client_mode: _Optional[bool] = ..., known_peers: _Optional[int] = ..., dht_size_estimate: _Optional[float] = ..., rounds_done: _Optional[int] = ..., rounds_failed: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., codecs: _Optional[_Mapping[str, CodecStats]] = ..., failures: _Optional[_Mapping[str, int]] = ..., uptime: _Optional[float] = ..., version: _Optional[str] = ..., active_calls: _Optional[int] = ..., shm_dir: _Optional[str] = ..., shm_dev: _Optional[int] = ..., shm_ino: _Optional[int] = ..., pid: _Optional[int] = ..., bandwidth: _Optional[float] = ..., bandwidth_measured: _Optional[bool] = ..., bandwidth_samples: _Optional[int] = ..., rounds_partial: _Optional[int] = ..., kind: _Optional[str] = ..., stored_records: _Optional[int] = ..., reachability: _Optional[str] = ..., relay: _Optional[str] = ..., relay_id: _Optional[str] = ..., observed_host: _Optional[str] = ..., relay_moves: _Optional[int] = ..., relaying_reservations: _Optional[int] = ..., relayed_bytes: _Optional[int] = ..., relayed_connections: _Optional[int] = ..., direct_peers: _Optional[_Iterable[str]] = ..., punches_succeeded: _Optional[int] = ..., punches_failed: _Optional[int] = ..., trainers: _Optional[_Iterable[_Union[LocalTrainer, _Mapping]]] = ...) -> None: ...

class LocalTrainer(_message.Message):
    __slots__ = ("run", "method", "alone")
    RUN_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    ALONE_FIELD_NUMBER: _ClassVar[int]
    run: str
    method: str
    alone: float
    def __init__(self, run: _Optional[str] = ..., method: _Optional[str] = ..., alone: _Optional[float] = ...) -> None: ...

class PeersRequest(_message.Message):
    __slots__ = ("training_run",)
    TRAINING_RUN_FIELD_NUMBER: _ClassVar[int]
    training_run: str
    def __init__(self, training_run: _Optional[str] = ...) -> None: ...

class PeerView(_message.Message):
    __slots__ = ("peer_id", "address", "mode", "method", "epoch", "samples", "samples_per_second", "processes", "last_seen", "metrics", "this_peer")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    THIS_PEER_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    address: str
    mode: str
    method: str
    epoch: int
    samples: int
    samples_per_second: float
    processes: int
    last_seen: float
    metrics: _containers.ScalarMap[str, float]
    this_peer: bool
    def __init__(self, peer_id: _Optional[str] = ..., address: _Optional[str] = ..., mode: _Optional[str] = ..., method: _Optional[str] = ..., epoch: _Optional[int] = ..., samples: _Optional[int] = ..., samples_per_second: _Optional[float] = ..., processes: _Optional[int] = ..., last_seen: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., this_peer: _Optional[bool] = ...) -> None: ...

class RunProgress(_message.Message):
    __slots__ = ("method", "epoch", "samples", "target", "samples_per_second", "eta", "peers")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ETA_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    method: str
    epoch: int
    samples: int
    target: int
    samples_per_second: float
    eta: float
    peers: int
    def __init__(self, method: _Optional[str] = ..., epoch: _Optional[int] = ..., samples: _Optional[int] = ..., target: _Optional[int] = ..., samples_per_second: _Optional[float] = ..., eta: _Optional[float] = ..., peers: _Optional[int] = ...) -> None: ...

class PeersResponse(_message.Message):
    __slots__ = ("run_id", "peers", "progress", "ignored_records", "training_runs")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    IGNORED_RECORDS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_RUNS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerView]
    progress: _containers.RepeatedCompositeFieldContainer[RunProgress]
    ignored_records: int
    training_runs: _containers.RepeatedCompositeFieldContainer[TrainingRunView]
    def __init__(self, run_id: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerView, _Mapping]]] = ..., progress: _Optional[_Iterable[_Union[RunProgress, _Mapping]]] = ..., ignored_records: _Optional[int] = ..., training_runs: _Optional[_Iterable[_Union[TrainingRunView, _Mapping]]] = ...) -> None: ...

class TrainingRunView(_message.Message):
    __slots__ = ("run", "method", "trainers", "alone")
    RUN_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TRAINERS_FIELD_NUMBER: _ClassVar[int]
    ALONE_FIELD_NUMBER: _ClassVar[int]
    run: str
    method: str
    trainers: int
    alone: int
    def __init__(self, run: _Optional[str] = ..., method: _Optional[str] = ..., trainers: _Optional[int] = ..., alone: _Optional[int] = ...) -> None: ...
