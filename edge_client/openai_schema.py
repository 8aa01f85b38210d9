"""The OpenAI-compatible API's shapes: requests (pydantic), responses, errors.

Fields that SpecEdge cannot honour exactly are declared, so that a request
using them is refused with a message naming the field, never silently
answered with something else (`n=2` would otherwise return one choice).
Fields that change nothing here (`user`, `metadata`, ...) are ignored, as
vLLM and llama.cpp's server do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specedge.types import FinishReason

if TYPE_CHECKING:
    from specedge.edge_client.answer import AnswerResult

# Token ids and token counts travel as uint32 (protos/specedge/v1): bounded here, a value past it is a
# 400 naming its field, not a protobuf ValueError deep inside the answer (a 500).
UINT32_END = 2**32


class APIError(Exception):
    """An error answered as OpenAI does: an HTTP status and {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s  # sent as Retry-After

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": f"{self.retry_after_s:.0f}"}


def unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


class StreamOptions(BaseModel):
    include_usage: bool = False  # a last chunk with `usage` and no choices


class GenerationRequest(BaseModel):
    """What chat and text completions share: the model, sampling, limits, stop strings, streaming."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1, lt=UINT32_END)
    temperature: float | None = Field(None, ge=0, le=2)  # None: the edge's --temperature (default 0, greedy)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, lt=UINT32_END)  # an extension, as in vLLM (pass it in extra_body)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Declared to be refused when used (see check_supported).
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        """Raise APIError (400) for a request that SpecEdge cannot answer as asked."""
        if self.n != 1:
            raise unsupported("n", f"only n=1 is supported (one answer per request), got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise unsupported(name, "penalties are not supported; leave it at 0")
        if self.logit_bias:
            raise unsupported("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None

    def text(self, param: str) -> str:
        """The message's text; content parts must all be text."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                why = f"only text content parts are supported, got {part.get('type')!r}"
                raise unsupported(f"{param}.content[{i}]", why)
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, lt=UINT32_END)  # the newer name of max_tokens; wins over it
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise unsupported("logprobs", "logprobs are not supported")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise unsupported(name, "tool and function calling are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise unsupported("response_format", "only the text response format is supported")

    def template_messages(self) -> list[dict[str, str]]:
        """Messages for the chat template; "developer" is the newer name of "system"."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text(f"messages[{i}]")}
            for i, m in enumerate(self.messages)
        ]


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _token_ids_fit_the_wire(cls, prompt: str | list[int] | list[str]) -> str | list[int] | list[str]:
        # Not list[Annotated[int, Field(ge=0)]]: inside the union, pydantic would report first that
        # the prompt is not a string. (Ids past the target's vocabulary are the server's to refuse.)
        for index, token in enumerate(prompt if isinstance(prompt, list) else ()):
            if isinstance(token, int) and not 0 <= token < UINT32_END:
                raise ValueError(f"token id {token} at index {index} is not in [0, 2^32)")
        return prompt

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise unsupported("logprobs", "logprobs are not supported")
        if self.echo:
            raise unsupported("echo", "echo is not supported")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", f"only best_of=1 is supported, got {self.best_of}")
        if self.suffix:
            raise unsupported("suffix", "suffix (insertion) is not supported")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) > 1:
            raise unsupported("prompt", f"one prompt per request, got {len(self.prompt)}")


# -- responses ---------------------------------------------------------------


def usage(result: AnswerResult) -> dict:
    return {
        "prompt_tokens": result.num_prompt_tokens,
        "completion_tokens": result.num_completion_tokens,
        "total_tokens": result.num_prompt_tokens + result.num_completion_tokens,
    }


class Shape:
    """How one endpoint's responses look; subclasses say how a choice looks."""

    id_prefix: str
    object: str
    chunk_object: str
    prompt_param: str  # the request field an error about the prompt names

    def completion(self, result: AnswerResult) -> dict:
        """The non-streamed response (less id, created and model)."""
        return {
            "object": self.object,
            "choices": [self.choice(result.text, self.finish_reason(result))],
            "usage": usage(result),
            "specedge": result.stats.as_dict(),
        }

    @staticmethod
    def finish_reason(result: AnswerResult) -> str:
        return "stop" if result.finish is FinishReason.STOP else "length"  # LENGTH, or CONTEXT: the slot is full

    def choice(self, text: str, finish_reason: str | None) -> dict:
        raise NotImplementedError

    def chunk_choice(self, text: str, finish_reason: str | None, first: bool = False) -> dict:
        raise NotImplementedError


class ChatShape(Shape):
    id_prefix, object, chunk_object, prompt_param = "chatcmpl", "chat.completion", "chat.completion.chunk", "messages"

    def choice(self, text: str, finish_reason: str | None) -> dict:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, text: str, finish_reason: str | None, first: bool = False) -> dict:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


class TextShape(Shape):
    id_prefix, object, chunk_object, prompt_param = "cmpl", "text_completion", "text_completion", "prompt"

    def choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def chunk_choice(self, text: str, finish_reason: str | None, first: bool = False) -> dict:
        return self.choice(text, finish_reason)


CHAT, TEXT = ChatShape(), TextShape()
