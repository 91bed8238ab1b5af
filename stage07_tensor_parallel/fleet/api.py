"""The OpenAI side of the router: the request bodies it accepts, its error shape, server-sent events, stop
strings, and the chat template that turns messages into a prompt (given code; router.py serves them).

The fields are stage 04's server's where a replica can serve them (max_tokens or max_completion_tokens,
temperature, seed, stop, stream with stream_options.include_usage, ignore_eos); stop strings are matched
here, on the detokenized text, since replicas see token ids only. What the replicas' engine does not compute
(logprobs, echo, n > 1, top_p, penalties, ...) is a 400 that names the field and says why.
"""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from labkit.serving import invalid_field

# The fields stage 04's server takes that this fleet's replicas cannot serve, and why (any other unknown
# field is refused too, as not implemented).
UNSERVED = {
    "logprobs": "the replicas' engine computes no logprobs; stage 04's server does",
    "top_logprobs": "the replicas' engine computes no logprobs; stage 04's server does",
    "echo": "the replicas' engine computes no prompt logprobs; stage 04's server does",
    "n": "the replicas' engine draws one sample per request; send n requests",
    "top_p": "the replicas' engine samples from the whole distribution (temperature only)",
    "top_k": "the replicas' engine samples from the whole distribution (temperature only)",
}
StopString = Annotated[str, Field(min_length=1, max_length=256)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # one last chunk, choices [], with the request's usage


class Sampling(BaseModel):
    """What both endpoints take. A field the fleet does not implement is a 400 that names it."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=256)
    user: str | None = Field(None, max_length=256)  # the session id (SessionAffinity)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: StopString | list[StopString] | None = None  # the output ends before the first one it writes
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class Completion(Sampling):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            raise ValueError(f"a batch of {len(prompt)} prompts; the router takes one per request (stage 04's "
                             "server takes batches)")  # fmt: skip
        return prompt


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletion(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens; wins over it

    @model_validator(mode="after")
    def _newer_name(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


def error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    kind = "rate_limit_exceeded" if status == 429 else kind
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status, headers=headers)


def refusal(e) -> JSONResponse:
    """The 400 of a body that failed validation (a pydantic ValidationError), naming the field."""
    names = {*Completion.model_fields, *ChatCompletion.model_fields, *Message.model_fields, *StreamOptions.model_fields}
    name, first = invalid_field(e.errors(), names)
    if first["type"] == "extra_forbidden":
        why = UNSERVED.get(name, "this router does not implement this field")
        return error(400, f"{name}: {why}; leave it out", name)
    message = first["msg"].removeprefix("Value error, ")
    return error(400, f"{name}: {message}" if name else message, name)


def stop_at(text: str, stops: list[str]) -> int | None:
    """Where the first stop string the text holds begins (the output ends there), or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of text could begin a stop string: a stream holds them until the next
    token tells (vLLM holds them back too)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def plain_chat(turns: list[dict]) -> str:
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"


def chat_template(folder) -> Callable[[list[dict]], str]:
    """messages -> prompt text: the checkpoint's chat_template (tokenizer_config.json) in a sandbox, else
    `role: content` lines ending in `assistant:`."""
    file = Path(folder) / "tokenizer_config.json"
    config = json.loads(file.read_text()) if file.is_file() else {}
    if not isinstance(config.get("chat_template"), str):
        return plain_chat
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    tokens = {k: config[k] for k in ("bos_token", "eos_token") if isinstance(config.get(k), str)}
    template = env.from_string(config["chat_template"], globals=tokens)
    return lambda turns: template.render(messages=turns, add_generation_prompt=True)


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def read_body(request: Request, schema):
    """The request body as `schema`, or the 400 that names the field (or says the JSON is bad)."""
    try:
        return schema.model_validate(json.loads(await request.body()))
    except ValidationError as e:
        return refusal(e)
    except ValueError as e:
        return error(400, f"the body is not valid JSON: {e}")
