"""Model folders that mlx-lm cannot load, said as what is wrong with the folder and how to fix it.

`mlx_lm.load` reports a broken model folder in its own terms: a `KeyError('model_type')` for a config.json
that names no architecture, a `RuntimeError('[load_safetensors] …')` for a truncated weights file. Those are
the user's to fix, so every interface loads through `user_facing_load_errors` (or `load_model` /
`load_drafter_choice`), which turns the known cases into `ModelError` and lets real bugs through.

    with user_facing_load_errors("target", name):
        model = store.get(name)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from uag.core.config import DrafterSpec
from uag.errors import ModelError

# mlx's messages for weights it cannot read (mlx/io/safetensors.cpp, gguf.cpp).
BROKEN_WEIGHTS = ("[load_safetensors]", "[load_gguf]", "[load]")


@contextmanager
def user_facing_load_errors(role: str, name: str) -> Iterator[None]:
    """Turn mlx-lm's known load failures inside the block into a ModelError naming `role` and `name`."""
    what = f"cannot load the {role} {name!r}"
    try:
        yield
    except KeyError as err:
        if err.args and err.args[0] == "model_type":
            raise ModelError(
                f'{what}: its config.json has no "model_type" (the architecture, e.g. "llama" or "qwen2"); '
                "add it, or convert the model again with mlx_lm.convert"
            ) from None
        raise
    except RuntimeError as err:
        if str(err).startswith(BROKEN_WEIGHTS):
            raise ModelError(
                f"{what}: a weights file is incomplete or corrupt (an interrupted download or copy?); "
                "download or convert the model again"
            ) from None
        raise
    except json.JSONDecodeError as err:
        raise ModelError(f"{what}: a JSON file in it is malformed (line {err.lineno}): fix or replace it") from None
    except UnicodeDecodeError:
        raise ModelError(f"{what}: a text file in it (config or tokenizer) is not UTF-8: replace it") from None


def load_model(store, name: str, *, role: str, progress: Callable[[str], None] | None = None):
    """`store.get(name)` with load failures said as ModelError (see `user_facing_load_errors`)."""
    with user_facing_load_errors(role, name):
        return store.get(name, progress=progress)


def load_drafter_choice(store, spec: str | DrafterSpec, *, progress: Callable[[str], None] | None = None):
    """`uag.core.drafters.load_drafter` with load failures said as ModelError; lookup loads nothing."""
    from uag.core.drafters import load_drafter

    spec = spec if isinstance(spec, DrafterSpec) else DrafterSpec.parse(spec)
    with user_facing_load_errors("drafter", spec.model or str(spec)):
        return load_drafter(store, spec, progress=progress)
