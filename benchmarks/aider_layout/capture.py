"""Capture aider's request layout for its `whole` and `diff` edit formats, for benchmarks/serve.py's replay.

Run with aider installed (its own environment: `pip install aider-chat`), not uag's:
    python benchmarks/aider_layout/capture.py benchmarks/aider_layout/aider-0.86.2.json

Aider builds each request from its prompts (aider.coders.*_prompts) for the model it is given; this asks it, through
its own `format_chat_chunks`, for the messages it would send to an OpenAI-compatible server's unknown model
(`openai/<name>`: a system message, reminders in the user's message) with one file in the chat, no git and no repo
map, and keeps the parts that serve.py composes per turn: the fixed head (system prompt and example conversation),
the chat-files message around the file listing, the rules appended to the user's request, and what aider adds to
the history after an edit applies.
"""

import json
import os
import sys
import tempfile
from importlib import metadata

from aider.coders import Coder
from aider.io import InputOutput
from aider.models import Model

FILE, CONTENT, REQUEST = "placeholder.py", "PLACEHOLDER = 1\n", "REQUEST"


def aider_coder(edit_format: str, name: str, content: str) -> Coder:
    """Aider editing one file, `name` holding `content`, in a fresh folder, with an OpenAI-compatible server's
    unknown model (`OPENAI_API_BASE`), no git and no repo map."""
    os.chdir(tempfile.mkdtemp())
    with open(name, "w") as f:
        f.write(content)
    return Coder.create(
        main_model=Model("openai/coder-target"),
        edit_format=edit_format,
        io=InputOutput(yes=True, pretty=False),
        fnames=[name],
        use_git=False,
        map_tokens=0,
        stream=True,
    )


def layout(edit_format: str) -> dict:
    coder = aider_coder(edit_format, FILE, CONTENT)
    coder.cur_messages = [{"role": "user", "content": REQUEST}]
    chunks = coder.format_chat_chunks()
    files, files_reply = chunks.chat_files
    listing = coder.get_files_content()
    assert files["content"].endswith(listing) and listing.startswith(f"\n{FILE}\n"), "aider's file listing moved"
    request = chunks.cur[-1]["content"]
    assert request.startswith(REQUEST), "aider no longer appends its reminder to the user's request"
    prompts = coder.gpt_prompts
    return {
        "head": chunks.system + chunks.examples,
        "files_prefix": files["content"][: -len(listing)],
        "fence": list(coder.fence),
        "files_reply": files_reply["content"],
        "reminder": request[len(REQUEST) :],
        "applied": [
            {"role": "user", "content": prompts.files_content_gpt_edits_no_repo},
            {"role": "assistant", "content": "Ok."},
        ],
    }


if __name__ == "__main__":
    path = os.path.abspath(sys.argv[1])  # aider prints to stdout: the layout goes to a file
    out = {"aider": metadata.version("aider-chat"), "formats": {f: layout(f) for f in ("whole", "diff")}}
    with open(path, "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
