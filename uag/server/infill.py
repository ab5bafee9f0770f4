"""llama.cpp's `POST /infill`, as llama-server answers editor autocomplete (llama.vscode, llama.vim, Continue's
llama.cpp provider): the code before and after the cursor, other files of the project, the text typed after the
prefix; the reply whole (`{"content", "stop": true, "tokens_predicted", "timings", …}`) or streamed as
`data: {"content": …, "stop": false}` lines and a last `"stop": true` one. The prompt is laid out with the target's
FIM tokens on the worker (uag.server.fim). Pure: no mlx, no HTTP.

    INFILL.parse({"input_prefix": "def f(x):\\n    ", "input_suffix": "\\n", "n_predict": 64}, defaults)
        -> Request("completion", fill=Fill("def f(x):\\n    ", "\\n"), config=…max_tokens=64…)

Fields llama-server takes that do not apply here (model: the served one answers; cache_prompt: always on;
samplers, t_max_prompt_ms, t_max_predict_ms, n_indent, id_slot, n_probs, typical_p, mirostat, …) are accepted and
ignored, as llama-server ignores what it does not know; errors are llama-server's `{"error": {"code", "message",
"type"}}`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from uag.server.dialects import Accepted, Dialect, Done
from uag.server.errors import APIError, bad, show
from uag.server.fim import STOPS, Fill
from uag.server.messages import text_of
from uag.server.protocol import Request, ServerDefaults, common_fields
from uag.server.streaming import sse

# llama-server's names for the fields uag's completions take under OpenAI's
RENAMED = {"n_predict": "max_tokens", "repeat_penalty": "repetition_penalty"}
SAMPLING = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty")
TYPES = {401: "authentication_error", 404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error"}
STOP_TYPES = {"stop": "eos", "length": "limit"}


def llama_error(err: APIError) -> dict:
    """llama-server's error object. Example: 400 "n_predict: …" -> {"error": {"code": 400, "message": "n_predict: …",
    "type": "invalid_request_error"}}"""
    kind = TYPES.get(err.status, "server_error" if err.status >= 500 else "invalid_request_error")
    return {"error": {"code": err.status, "message": err.message, "type": kind}}


def parse_infill(body: Any, defaults: ServerDefaults) -> Request:
    """A /infill body as a `Request` whose `fill` the worker lays out; APIError naming the first problem."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    files = _files(body.get("input_extra"))
    # the project's files as Qwen2.5-Coder's repository layout; a file alone as plain FIM (its names would be
    # llama-server's placeholders, which make an instruct-tuned coder ramble on past the middle)
    fill = Fill(_text(body, "input_prefix"), _text(body, "input_suffix"), files, _text(body, "prompt"), bool(files))
    # llama-server serves its one model whatever a client names: `defaults` is the model the body names if this
    # server serves it, else the default one (uag.server.protocol.ModelRouter.pick)
    mapped: dict[str, Any] = {"model": defaults.model}
    for name in (*SAMPLING, "stop", "stream", "speculative"):
        if body.get(name) is not None:
            mapped[name] = body[name]
    predict = body.get("n_predict")
    if predict is not None and not (isinstance(predict, int) and not isinstance(predict, bool) and predict < 0):
        mapped["max_tokens"] = predict  # -1 (llama-server's "until the end"): the server's --max-tokens
    if body.get("seed") not in (None, -1):  # -1: a random seed
        mapped["seed"] = body["seed"]
    if body.get("repeat_penalty") is not None:
        mapped["repetition_penalty"] = body["repeat_penalty"]
    try:
        common = common_fields(mapped, defaults, "max_tokens")
    except APIError as err:
        raise _renamed(err) from None
    common["stop"] = (*common["stop"], *STOPS)
    fields = body.get("response_fields")
    if fields is not None and not (isinstance(fields, list) and all(isinstance(f, str) for f in fields)):
        raise bad(
            "response_fields",
            f'must be a list of field paths like ["content", "timings/prompt_n"] (got {show(fields)})',
        )
    return Request("completion", prompt=fill.prefix, fill=fill, extra={"response_fields": fields or []}, **common)


def _text(body: dict, name: str) -> str:
    value = body.get(name)
    return "" if value is None else text_of(value, name)


def _files(value: Any) -> tuple[tuple[str, str], ...]:
    """input_extra: [{"filename": …, "text": …}, …] as (name, text) pairs (a missing filename is llama-server's
    "tmp")."""
    if value is None:
        return ()
    shape = 'must be a list of {"filename": string, "text": string} objects'
    if not isinstance(value, list):
        raise bad("input_extra", f"{shape} (got {show(value)})")
    files = []
    for i, chunk in enumerate(value):
        where = f"input_extra[{i}]"
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str):
            raise bad(where, f"{shape} (got {show(chunk)})")
        name = chunk.get("filename")
        files.append(
            ("tmp" if name is None else text_of(name, f"{where}.filename"), text_of(chunk.get("text", ""), where))
        )
    return tuple(files)


def _renamed(err: APIError) -> APIError:
    """An error about an OpenAI field, named as llama-server names it (max_tokens -> n_predict)."""
    back = {ours: theirs for theirs, ours in RENAMED.items()}
    if err.param not in back:
        return err
    name = back[err.param]
    return APIError(err.status, name + err.message.removeprefix(err.param), param=name, code=err.code)


class InfillReply:
    """llama-server's completion object for /infill: whole, or streamed as partial objects and a final one."""

    def __init__(self, request: Request):
        self.request = request
        self.fields = request.extra.get("response_fields") or []
        self.prompt_tokens = 0

    def _final(self, done: Done, content: str) -> dict:
        usage, timings = done.report["usage"], done.report["timings"]
        word = done.stop_sequence if done.stop_sequence not in STOPS else None  # a FIM token ends as EOS does
        config = self.request.config
        out = {
            "index": 0,
            "content": content,
            "tokens": [],
            "id_slot": 0,
            "stop": True,
            "model": self.request.model,
            "tokens_predicted": usage["completion_tokens"],
            "tokens_evaluated": usage["prompt_tokens"],
            "generation_settings": {
                "n_predict": config.max_tokens,
                "temperature": config.temperature,
                "top_k": config.top_k,
                "top_p": config.top_p,
                "min_p": config.min_p,
                "seed": config.seed,
                "stop": [s for s in self.request.stop if s not in STOPS],
            },
            "has_new_line": "\n" in done.text,
            "truncated": False,
            "stop_type": "word" if word else STOP_TYPES.get(done.finish, "eos"),
            "stopping_word": word or "",
            "tokens_cached": usage["prompt_tokens_details"]["cached_tokens"],
            "timings": llama_timings(timings),
            "speculative": done.report["speculative"],
        }
        if "uag" in done.report:
            out["uag"] = done.report["uag"]
        return picked(out, self.fields) if self.fields else out

    def whole(self, done: Done) -> dict:
        return self._final(done, done.text)

    def opening(self, accepted: Accepted) -> Iterable[bytes]:
        self.prompt_tokens = accepted.prompt_tokens
        return ()

    def delta(self, text: str) -> Iterable[bytes]:
        yield sse(
            {
                "index": 0,
                "content": text,
                "tokens": [],
                "stop": False,
                "id_slot": 0,
                "tokens_evaluated": self.prompt_tokens,
            }
        )

    def closing(self, done: Done) -> Iterable[bytes]:
        if done.tail:
            yield from self.delta(done.tail)
        yield sse(self._final(done, ""))  # llama-server's last event: the content was streamed; no [DONE]

    def failed(self, err: APIError) -> bytes:
        return sse(llama_error(err))


def llama_timings(timings: dict) -> dict:
    """uag's `timings` with llama-server's per-token figures, every figure a number (0 where none was measured)."""
    out = {name: value or 0 for name, value in timings.items()}
    out["prompt_per_token_ms"] = out["prompt_ms"] / out["prompt_n"] if out["prompt_n"] else 0
    out["predicted_per_token_ms"] = out["predicted_ms"] / out["predicted_n"] if out["predicted_n"] else 0
    return out


def picked(obj: dict, paths: list[str]) -> dict:
    """llama-server's `response_fields`: only the fields named, each under its path.

    Example: picked({"content": "x", "timings": {"prompt_n": 3}}, ["content", "timings/prompt_n"])
             -> {"content": "x", "timings/prompt_n": 3}
    """
    out = {}
    for path in paths:
        value: Any = obj
        for key in path.split("/"):
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            out[path] = value
    return out


INFILL = Dialect("infill", parse_infill, InfillReply, llama_error, label="an API request (infill)", any_model=True)
