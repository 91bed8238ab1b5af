"""The OpenAI side of the router: the request bodies it accepts, its error shape, server-sent events, and the
chat template that turns messages into a prompt (given code; router.py serves them).
"""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Sampling(BaseModel):
    """What both endpoints take. A field the fleet does not implement is a 400 that names it."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=256)
    user: str | None = Field(None, max_length=256)  # the session id (SessionAffinity)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    ignore_eos: bool = False


class Completion(Sampling):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletion(Sampling):
    messages: list[Message] = Field(min_length=1)


def error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    kind = "rate_limit_exceeded" if status == 429 else kind
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status, headers=headers)


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
        first = e.errors()[0]
        name = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("str", "list[")))
        if first["type"] == "extra_forbidden":
            return error(400, f"{name}: this router does not implement this field; leave it out", name)
        return error(400, f"{name}: {first['msg']}", name or None)
    except ValueError as e:
        return error(400, f"the body is not valid JSON: {e}")
