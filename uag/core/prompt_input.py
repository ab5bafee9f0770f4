"""Where a prompt comes from and whether it fits: text checks every interface shares. Standard library only.

`check_text` refuses text that cannot be encoded (lone surrogates: the CLI's way of carrying invalid
UTF-8 bytes from argv, or a raw JSON "\\ud800"); `read_prompt` takes the prompt from an argument, stdin
(`-`) or a file; `check_context` says whether a prompt fits a model's context, for the target and the
drafter alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from uag.errors import InputError

STDIN = "-"


def check_text(text: str, source: str) -> str:
    """`text` unchanged, or InputError naming the first character that is not valid Unicode text.

    Example: check_text("Ala", "the prompt") -> "Ala"
             check_text("Ala \\udcff", "the prompt") -> InputError("the prompt is not valid UTF-8: … byte 0xff …")
    """
    for i, char in enumerate(text):
        if "\ud800" <= char <= "\udfff":
            code = ord(char)
            what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
            raise InputError(
                f"{source} is not valid UTF-8: {what} at character {i + 1}; "
                "save it as UTF-8 (e.g. iconv -t UTF-8) or remove that character"
            )
    return text


def decode_utf8(data: bytes, source: str) -> str:
    """Bytes as UTF-8 text, or InputError with the offset of the first bad byte and how to fix it.

    Example: decode_utf8(b"Ala \\xff", "a.txt") -> InputError("a.txt is not valid UTF-8: byte 0xff at byte 5 …")
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(
            f"{source} is not valid UTF-8: byte 0x{data[err.start]:02x} at byte {err.start + 1}; "
            "save it as UTF-8 (e.g. iconv -t UTF-8) or remove that byte"
        ) from None


def read_prompt(argument: str | None, prompt_file: str | None, stdin: BinaryIO) -> str:
    """The prompt from the positional argument, `-` (stdin) or `--prompt-file PATH`: exactly one of them.

    Example: read_prompt("Ala ma kota", None, stdin) -> "Ala ma kota";  read_prompt("-", None, stdin) -> stdin's text
    """
    if argument is not None and prompt_file is not None:
        raise InputError("give the prompt once: as an argument, as - (stdin) or with --prompt-file, not two of them")
    if prompt_file is not None:
        path = Path(prompt_file)
        shown = repr(prompt_file)
        if path.is_dir():
            raise InputError(f"--prompt-file {shown} is a folder; give a text file")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise InputError(f"--prompt-file {shown}: no such file") from None
        except OSError as err:
            raise InputError(f"--prompt-file {shown} cannot be read ({err.strerror}); check its permissions") from None
        return decode_utf8(data, f"--prompt-file {shown}")
    if argument == STDIN:
        return decode_utf8(stdin.read(), "the prompt on stdin")
    if argument is None:
        raise InputError("no prompt given: pass it as an argument, as - to read stdin, or with --prompt-file PATH")
    return check_text(argument, "the prompt")


def check_context(n_prompt_tokens: int, context_length: int | None, role: str, name: str) -> None:
    """InputError when a prompt of `n_prompt_tokens` leaves no room to generate in a context of
    `context_length` tokens (None: the model states no limit).

    Example: check_context(9432, 8192, "drafter", "demo-drafter") -> InputError("the prompt is 9432 tokens for
             the drafter 'demo-drafter', whose context is 8192 tokens: …")
    """
    if context_length is None or n_prompt_tokens < context_length:
        return
    fix = "shorten the prompt"
    if role == "drafter":
        fix += ", pick a drafter with a longer context, or draft with prompt lookup (drafter: lookup)"
    raise InputError(
        f"the prompt is {n_prompt_tokens} tokens for the {role} {name!r}, whose context is {context_length} "
        f"tokens: {fix}"
    )
