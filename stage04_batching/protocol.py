"""The OpenAI wire format: request schemas with every field checked against what the engine can take,
error bodies, server-sent-event framing, and the chat template.

Given code (vLLM keeps the same pieces in vllm/entrypoints/openai/protocol.py).
"""

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import AfterValidator, BaseModel, Field, ValidationError

from .engine import RequestOutput
from .sequence import SamplingParams
from .structured import inline_refs, schema_to_regex


def _encodable(text: str) -> str:
    """JSON may carry a lone surrogate ("\\ud800") that no tokenizer can encode: refuse it here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"is not valid Unicode (a lone surrogate at character {e.start}); send UTF-8 text") from e
    return text


Text = Annotated[str, AfterValidator(_encodable)]
StopString = Annotated[Text, Field(min_length=1, max_length=256)]

MIN_TEMPERATURE = 1e-5  # below this, logits / temperature overflows float32: send 0 for greedy


def _temperature(t: float) -> float:
    if 0 < t < MIN_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
    return t


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    name: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text" (unconstrained), "json_object" (any JSON object), or "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SamplingRequest(BaseModel):
    """The fields both endpoints share. Unknown fields are ignored, as OpenAI and vLLM do."""

    model: Text | None = Field(None, max_length=256)
    max_tokens: int = Field(16, ge=1)  # the handler also checks prompt + max_tokens against the context
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False), AfterValidator(_temperature)] = 1.0
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)  # a vLLM extension; 0 switches it off
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # the range torch.Generator.manual_seed takes
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = None
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # a vLLM extension that load tests use for fixed output lengths
    response_format: ResponseFormat | None = None  # structured output (stage 04 part 2)
    guided_regex: Text | None = Field(None, min_length=1, max_length=4096)  # a vLLM extension

    def guided_pattern(self) -> str | None:
        """The regex the output must match, or None. Raises structured.UnsupportedSchema (a ValueError)
        naming the schema feature it cannot compile: the route answers 400, never an unconstrained 200."""
        fmt = self.response_format
        if fmt is not None and self.guided_regex is not None and fmt.type != "text":
            raise ValueError("send response_format or guided_regex, not both")
        if self.guided_regex is not None:
            return self.guided_regex
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return schema_to_regex({"type": "object"})
        if fmt.json_schema is None:
            raise ValueError('response_format of type "json_schema" needs a json_schema object with a schema')
        return schema_to_regex(inline_refs(fmt.json_schema.schema_))

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            ignore_eos=self.ignore_eos,
            guided_regex=self.guided_pattern(),
        )


class CompletionRequest(SamplingRequest):
    prompt: Text


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: Text


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)


def error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    """An OpenAI-style error response."""
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def validation_error(e: ValidationError) -> JSONResponse:
    """400 naming the first bad field (`messages.0.role`), as OpenAI's `param`."""
    first = e.errors()[0]
    names = {*ChatCompletionRequest.model_fields, *CompletionRequest.model_fields, *ChatMessage.model_fields}
    # pydantic's loc also names union branches ("str", "list[...]"); keep field names and list indices
    field = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or p in names) or None
    return error(400, f"{field}: {first['msg']}" if field else first["msg"], field)


@dataclass
class ResponseBuilder:
    """The OpenAI bodies of one request: a streamed chunk per output, or the final body."""

    request_id: str
    model: str
    chat: bool
    num_prompt_tokens: int
    include_usage: bool = False  # stream_options.include_usage: usage in the last chunk
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self, out: RequestOutput) -> dict:
        n = len(out.token_ids)
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.num_prompt_tokens + n,
        }

    def chunk(self, out: RequestOutput) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": {"role": "assistant", "content": out.delta_text}}
        else:
            choice = {"index": 0, "text": out.delta_text, "logprobs": None}
        body = self._body("chat.completion.chunk" if self.chat else "text_completion", choice, out)
        if out.finished and self.include_usage:
            body["usage"] = self.usage(out)
        return body

    def final(self, out: RequestOutput) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text}}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None}
        return {
            **self._body("chat.completion" if self.chat else "text_completion", choice, out),
            "usage": self.usage(out),
        }

    def _body(self, kind: str, choice: dict, out: RequestOutput) -> dict:
        choice["finish_reason"] = out.finish_reason if out.finished else None
        return {
            "id": self.request_id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }


def sse(data: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


SSE_DONE = sse("[DONE]")


def load_chat_template(folder: str | os.PathLike) -> Template | None:
    """The checkpoint's chat template (`chat_template` in tokenizer_config.json), compiled in a sandbox
    with the variables Hugging Face templates use, or None when it has none."""
    file = Path(folder) / "tokenizer_config.json"
    config = json.loads(file.read_text()) if file.is_file() else {}
    if not isinstance(config.get("chat_template"), str):
        return None

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception)
    tokens = {k: config[k] for k in ("bos_token", "eos_token") if isinstance(config.get(k), str)}
    return env.from_string(config["chat_template"], globals=tokens)


def render_chat(messages: list[ChatMessage], template: Template | None) -> str:
    """The prompt of a chat: `template` (from load_chat_template) when the checkpoint has one,
    else `role: content` lines ending in `assistant:`."""
    turns = [{"role": m.role, "content": m.content} for m in messages]
    if template is None:
        return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"
    return template.render(messages=turns, add_generation_prompt=True)
