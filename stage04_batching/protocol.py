"""The OpenAI wire format: request schemas with every field checked against what the engine can take,
error bodies, server-sent-event framing, and the chat template.

Given code (vLLM keeps the same pieces in vllm/entrypoints/openai/protocol.py).
"""

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from labkit.serving import invalid_field

from .sequence import RequestOutput, SamplingParams, TokenLogprob
from .structured import inline_refs, schema_to_regex


def _encodable(text: str) -> str:
    """JSON may carry a lone surrogate ("\\ud800") that no tokenizer can encode: refuse it here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"is not valid Unicode (a lone surrogate at character {e.start}); send UTF-8 text") from e
    return text


Text = Annotated[str, AfterValidator(_encodable)]
StopString = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_encodable)]

MIN_TEMPERATURE = 1e-5  # below this, logits / temperature overflows float32: send 0 for greedy


def _temperature(t: float) -> float:
    if 0 < t < MIN_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
    return t


MAX_LOGPROBS = 20  # the most top logprobs one position may ask for (vLLM's default max_logprobs)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # vLLM's continuous_usage_stats is not implemented: a 400 names it

    include_usage: bool = False  # one last chunk, choices [], with the whole request's usage


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
    """The fields both endpoints share. A field this server does not implement (tools, best_of, min_p, ...)
    is a 400 that names it, as OpenAI answers, rather than silently ignored as vLLM does."""

    model_config = ConfigDict(extra="forbid")

    model: Text | None = Field(None, max_length=256)
    user: str | None = Field(None, max_length=256)  # OpenAI's end-user id: accepted, changes nothing
    max_tokens: int = Field(16, ge=1)  # the handler also checks prompt + max_tokens against the context
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False), AfterValidator(_temperature)] = 1.0
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)  # a vLLM extension; 0 switches it off
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # the range torch.Generator.manual_seed takes
    stop: StopString | list[StopString] | None = None  # OpenAI allows 4; vLLM (and lm-eval's tasks) send more
    n: int = Field(1, ge=1)  # the handler checks it against the engine's max_num_seqs
    stream: bool = False
    stream_options: StreamOptions | None = None  # without stream it changes nothing: the body holds the usage
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    # token id (a JSON key, so a string) -> bias; the handler checks the ids against the vocabulary
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = Field(
        None, max_length=1024
    )
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

    def num_logprobs(self) -> int | None:
        """How many top logprobs each output token reports (None: no logprobs)."""
        return None

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=max(
                self.max_tokens, 1
            ),  # echo with max_tokens 0 samples one token, as vLLM does; the reply drops it
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            ignore_eos=self.ignore_eos,
            guided_regex=self.guided_pattern(),
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=dict(self.logit_bias or {}),
            logprobs=self.num_logprobs(),
        )


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingRequest):
    # text or token ids, or a batch of them (lm-evaluation-harness sends [[ids], [ids], ...]): each prompt is
    # its own request in the engine's batch, its n choices indexed prompt * n + sample, as vLLM does
    prompt: Text | TokenIds | Annotated[list[Text | TokenIds], Field(min_length=1)]
    max_tokens: int = Field(16, ge=0)  # 0 only with echo: score the prompt, generate nothing
    echo: bool = False  # the prompt (and, with logprobs, its logprobs) before the output
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top logprobs per token; the chosen one always

    @model_validator(mode="after")
    def _echo_only(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo (the prompt's logprobs, nothing generated)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch's prompts, each text or token ids (a single prompt is a batch of one)."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str | list):
            return list(self.prompt)
        return [self.prompt]

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def to_sampling_params(self) -> SamplingParams:
        return dataclasses.replace(super().to_sampling_params(), prompt_logprobs=self.logprobs if self.echo else None)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: Text


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens; wins over it
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _chat_fields(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only allowed when logprobs is true")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    """An OpenAI-style error response."""
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def validation_error(e: ValidationError) -> JSONResponse:
    """400 naming the bad field (`messages.0.role`) as OpenAI's `param`, with the reason of the union branch
    the value's shape chose (labkit.serving.invalid_field)."""
    names = {*ChatCompletionRequest.model_fields, *CompletionRequest.model_fields, *ChatMessage.model_fields}
    field, first = invalid_field(e.errors(), names | set(StreamOptions.model_fields))
    if first["type"] == "extra_forbidden":
        return error(400, f"{field}: this server does not implement this field; leave it out", field)
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "value_error" and message.split(": ", 1)[0] in names:  # a check across fields names it
        return error(400, message, message.split(": ", 1)[0])
    return error(400, f"{field}: {message}" if field else message, field)


@dataclass
class ResponseBuilder:
    """The OpenAI bodies of one request: a streamed chunk per output, the usage chunk, or the final body.
    A request has one or more prompts (a completions batch) and n choices per prompt: the output of
    sample out.index of prompt p is choice p * n + out.index, as vLLM numbers them."""

    request_id: str
    model: str
    chat: bool
    num_prompt_tokens: int  # of every prompt of the request
    n: int = 1
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage, choices []
    token_text: Callable[[int], str] = str  # a token id's text, for logprobs (the tokenizer's decode of it)
    echo: list[str] | None = None  # completions with echo: each prompt's text, which its choices start with
    echo_only: bool = False  # echo with max_tokens 0: the one token the engine sampled is left out
    created: int = field(default_factory=lambda: int(time.time()))
    sent: dict[int, int] = field(default_factory=dict)  # choice -> output tokens already streamed
    offset: dict[int, int] = field(default_factory=dict)  # choice -> characters already streamed
    completion_tokens: dict[int, int] = field(default_factory=dict)  # choice -> output tokens so far
    cached_tokens: dict[int, int] = field(default_factory=dict)  # prompt -> its tokens read from the prefix cache

    def usage(self) -> dict:
        n = sum(self.completion_tokens.values())
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.num_prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }

    def chunk(self, out: RequestOutput, prompt: int = 0) -> dict:
        """The streamed chunk of one output of prompt `prompt`: its new text and the logprobs of its tokens
        not sent yet."""
        index = self._choice(out, prompt)
        first = index not in self.sent
        tokens, text = self._new(out, index, self.sent.get(index, 0), out.delta_text)
        if first and self.echo is not None:
            text = self.echo[prompt] + text
        self.sent[index] = len(out.token_ids)
        if self.chat:
            choice = {"index": index, "delta": {"role": "assistant", "content": text}}
        else:
            choice = {"index": index, "text": text}
        choice["logprobs"] = self._logprobs(out, index, tokens, first)
        return self._body("chat.completion.chunk" if self.chat else "text_completion", choice, out)

    def usage_chunk(self) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.request_id, "object": kind, "created": self.created, "model": self.model, "choices": []}
        return {**body, "usage": self.usage()}

    def final(self, outs: list[list[RequestOutput]]) -> dict:
        """The whole body of a non-streaming request from the final output of each choice, by prompt."""
        choices = []
        for prompt, prompt_outs in enumerate(outs):
            for out in prompt_outs:
                index = self._choice(out, prompt)
                tokens, text = self._new(out, index, 0, out.text)
                text = (self.echo[prompt] if self.echo is not None else "") + text
                if self.chat:
                    choice = {"index": index, "message": {"role": "assistant", "content": text}}
                else:
                    choice = {"index": index, "text": text}
                choice["logprobs"] = self._logprobs(out, index, tokens, True)
                choice["finish_reason"] = out.finish_reason
                choices.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        body = {"id": self.request_id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        return {**body, "usage": self.usage()}

    def _choice(self, out: RequestOutput, prompt: int) -> int:
        """out's choice index; notes how many of the prompt's tokens came from the prefix cache (the forked
        samples report 0: the first one computed the prompt)."""
        self.cached_tokens[prompt] = max(self.cached_tokens.get(prompt, 0), out.num_cached_tokens)
        return prompt * self.n + out.index

    def _new(self, out: RequestOutput, index: int, start: int, text: str) -> tuple[list[TokenLogprob], str]:
        """The logprobs of out's tokens from `start` on, and its text; neither for an echo-only request."""
        self.completion_tokens[index] = 0 if self.echo_only else len(out.token_ids)
        if self.echo_only:
            return [], ""
        return (out.logprobs or [])[start:], text

    def _logprobs(self, out: RequestOutput, index: int, tokens: list[TokenLogprob], first: bool) -> dict | None:
        if out.logprobs is None:
            return None
        entries: list[TokenLogprob | None] = list(tokens)
        if first and self.echo is not None:
            entries = [*(out.prompt_logprobs or []), *entries]
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        offset = self.offset.get(index, 0)
        result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            token_id = e.token_id if e is not None else out.prompt_token_ids[0]  # None: the first prompt token
            text = self.token_text(token_id)
            result["tokens"].append(text)
            result["text_offset"].append(offset)
            offset += len(text)
            result["token_logprobs"].append(e.logprob if e is not None else None)
            # OpenAI: the `logprobs` most likely tokens and always the chosen one
            top = {self.token_text(t): lp for t, lp in e.top} | {text: e.logprob} if e is not None else None
            result["top_logprobs"].append(top)
        self.offset[index] = offset
        return result

    def _chat_entry(self, e: TokenLogprob) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}

    def _body(self, kind: str, choice: dict, out: RequestOutput) -> dict:
        choice["finish_reason"] = out.finish_reason
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
