from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_NONE: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT: _ClassVar[FinishReason]
FINISH_REASON_NONE: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CONTEXT: FinishReason

class AttachRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerNotice(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class TokenizerFingerprint(_message.Message):
    __slots__ = ("vocab_size", "num_tokens", "vocab_sha256", "bos_token_id", "eos_token_ids")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SHA256_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    num_tokens: int
    vocab_sha256: str
    bos_token_id: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, vocab_size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., vocab_sha256: _Optional[str] = ..., bos_token_id: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class ServerLimits(_message.Message):
    __slots__ = ("max_context_tokens", "max_draft_tokens", "max_sessions", "max_prompt_tokens", "max_draft_prob_tokens", "max_sessions_per_identity", "max_rounds_per_second", "round_burst", "max_message_bytes", "idle_session_timeout_s", "idle_connection_timeout_s", "max_attach_streams_per_identity")
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_PROB_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_PER_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    MAX_ROUNDS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ROUND_BURST_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDLE_SESSION_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_CONNECTION_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTACH_STREAMS_PER_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    max_context_tokens: int
    max_draft_tokens: int
    max_sessions: int
    max_prompt_tokens: int
    max_draft_prob_tokens: int
    max_sessions_per_identity: int
    max_rounds_per_second: float
    round_burst: int
    max_message_bytes: int
    idle_session_timeout_s: float
    idle_connection_timeout_s: float
    max_attach_streams_per_identity: int
    def __init__(self, max_context_tokens: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., max_draft_prob_tokens: _Optional[int] = ..., max_sessions_per_identity: _Optional[int] = ..., max_rounds_per_second: _Optional[float] = ..., round_burst: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., idle_session_timeout_s: _Optional[float] = ..., idle_connection_timeout_s: _Optional[float] = ..., max_attach_streams_per_identity: _Optional[int] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("protocol_version", "draft_tokenizer", "client_name")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    draft_tokenizer: TokenizerFingerprint
    client_name: str
    def __init__(self, protocol_version: _Optional[int] = ..., draft_tokenizer: _Optional[_Union[TokenizerFingerprint, _Mapping]] = ..., client_name: _Optional[str] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("protocol_version", "server_version", "model_name", "target_tokenizer", "limits")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    server_version: str
    model_name: str
    target_tokenizer: TokenizerFingerprint
    limits: ServerLimits
    def __init__(self, protocol_version: _Optional[int] = ..., server_version: _Optional[str] = ..., model_name: _Optional[str] = ..., target_tokenizer: _Optional[_Union[TokenizerFingerprint, _Mapping]] = ..., limits: _Optional[_Union[ServerLimits, _Mapping]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("tokenizer", "prompt_token_ids", "max_new_tokens", "sampling")
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    tokenizer: TokenizerFingerprint
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: SamplingParams
    def __init__(self, tokenizer: _Optional[_Union[TokenizerFingerprint, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "first_token_id", "finish_reason", "limits", "advised_draft_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    ADVISED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    first_token_id: int
    finish_reason: FinishReason
    limits: ServerLimits
    advised_draft_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., limits: _Optional[_Union[ServerLimits, _Mapping]] = ..., advised_draft_tokens: _Optional[int] = ...) -> None: ...

class ContinueSessionRequest(_message.Message):
    __slots__ = ("session_id", "keep_tokens", "token_ids", "max_new_tokens", "sampling")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keep_tokens: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: SamplingParams
    def __init__(self, session_id: _Optional[str] = ..., keep_tokens: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "draft_token_ids", "draft_parents", "num_generated", "draft_probs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    num_generated: int
    draft_probs: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    def __init__(self, session_id: _Optional[str] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_parents: _Optional[_Iterable[int]] = ..., num_generated: _Optional[int] = ..., draft_probs: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class RoundTiming(_message.Message):
    __slots__ = ("queue_ms", "forward_ms", "batch_size", "batch_tokens")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    forward_ms: float
    batch_size: int
    batch_tokens: int
    def __init__(self, queue_ms: _Optional[float] = ..., forward_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., batch_tokens: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted_nodes", "token_ids", "finish_reason", "num_generated", "advised_draft_tokens", "timing", "num_verified_nodes")
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    ADVISED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIED_NODES_FIELD_NUMBER: _ClassVar[int]
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    num_generated: int
    advised_draft_tokens: int
    timing: RoundTiming
    num_verified_nodes: int
    def __init__(self, accepted_nodes: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_generated: _Optional[int] = ..., advised_draft_tokens: _Optional[int] = ..., timing: _Optional[_Union[RoundTiming, _Mapping]] = ..., num_verified_nodes: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("tokenizer", "prompt_token_ids", "max_new_tokens", "sampling", "server_draft_tokens")
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SERVER_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokenizer: TokenizerFingerprint
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: SamplingParams
    server_draft_tokens: int
    def __init__(self, tokenizer: _Optional[_Union[TokenizerFingerprint, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., server_draft_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...
