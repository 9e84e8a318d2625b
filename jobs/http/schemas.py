"""The objects of the HTTP API, field for field as OpenAI's (they make its OpenAPI document, and
every answer is checked against them on the way out)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                      "cancelled"]


def storable(text: str) -> bool:
    """Text every database stores: no NUL, no lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"]
    expires_at: int | None
    status_details: str | None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchError(BaseModel):
    code: str | None
    message: str | None
    param: str | None
    line: int | None


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    usage: BatchUsage


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class ExpiresAfter(BaseModel):
    """OpenAI's expiration policy of a file: deleted ``seconds`` after it was made (1 hour to 30 days)."""

    anchor: Literal["created_at"]
    seconds: int = Field(ge=3600, le=30 * 86400)


class CreateBatch(BaseModel):
    """``POST /v1/batches``. Fields OpenAI has and berth does not know are ignored."""

    input_file_id: str = Field(max_length=64)
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
    completion_window: str = Field(max_length=16, description='"24h" as OpenAI; berth also takes e.g. "90m", "7d"')
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = Field(
        None, description="the batch's output and error files are deleted this long after the batch ends")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is None:
            return v
        if len(v) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs, not {len(v)}")
        for key, value in v.items():
            if len(key) > MAX_METADATA_KEY:
                raise ValueError(f"key {key[:20]!r}... is {len(key)} characters, over {MAX_METADATA_KEY}")
            if len(value) > MAX_METADATA_VALUE:
                raise ValueError(f"the value of {key[:20]!r} is {len(value)} characters, over {MAX_METADATA_VALUE}")
            if not storable(key) or not storable(value):
                raise ValueError("keys and values must be text without NUL characters or lone surrogates")
        return v

