"""Loading a model folder, with what mlx-lm cannot load said as what to fix, and checking first that it fits.

`mlx_lm.load` reports a broken model folder in its own terms: a `KeyError('model_type')` for a config.json
that names no architecture, a `RuntimeError('[load_safetensors] …')` for a truncated weights file. Those are
the user's to fix, so every interface loads through `load_model` (uag.core.drafters.load_drafter_choice for a
drafter; or, around its own loading, `user_facing_load_errors`), which turn the known cases into `ModelError`
and let real bugs through. `check_memory` refuses a pair that would not fit before anything loads.

    check_memory(store, [("target", "demo-target", None), ("drafter", "demo-drafter", None)])
    target = load_model(store, "demo-target", role="target")
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from uag.errors import ModelError
from uag.models import demo, memory

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


def load_model(
    store,
    name: str,
    *,
    role: str,
    progress: Callable[[str], None] | None = None,
    keep: Collection[str] = (),
    dtype: str | None = None,
):
    """`store.get(name, dtype=dtype)` with load failures said as ModelError (see `user_facing_load_errors`);
    `keep`: the models the store must not unload to make room (uag.models.store.ModelStore.get)."""
    with user_facing_load_errors(role, name):
        return store.get(name, dtype=dtype, progress=progress, keep=keep)


def check_memory(store, models: Sequence[tuple[str, str | None, str | None]], *, available: int | None = None) -> None:
    """ModelError naming each model's size and the fix when the `models` — (role, name, dtype); a None name
    (prompt lookup) loads nothing — that `store` does not hold yet would not fit in memory (uag.models.memory).

    Sizes come from the models' safetensors headers, so nothing is loaded to find out; a model whose files
    are not here yet (a hub id not downloaded, an offline model not converted) is not counted. `available`
    replaces what this machine has free (tests).
    """
    named = []
    for role, name, dtype in models:
        if name:
            with user_facing_load_errors(role, name):
                named.append((role, name, dtype, store.has(name, dtype)))
    if all(loaded for *_, loaded in named):
        return  # all in memory: nothing to load, nothing to fit (a server asks at every request)
    needs = []
    for role, name, dtype, loaded in named:
        with user_facing_load_errors(role, name):
            identity, dtype = store.key(name, dtype)
            folder = local_folder(identity)
            if folder is not None:
                needs.append(memory.Need(role, name, dtype, memory.model_bytes(folder, dtype), loaded))
    available = memory.available_bytes() if available is None else available
    if available is not None:  # a store with a budget unloads its least recently used models to make room first
        keep = [name for _, name, _ in models if name]
        available += sum(m.weight_bytes for m in store.unloads_for([n.bytes for n in needs if not n.loaded], keep))
    memory.check_fits(needs, available)


def local_folder(identity: str):
    """The folder a model's files are in on this machine, without fetching or converting anything; None if none."""
    if identity in demo.DEMO_NAMES:
        return demo.model_dir(identity) if demo.is_ready(identity) else None
    if Path(identity).is_absolute():
        return Path(identity) if (Path(identity) / "config.json").is_file() else None
    import mlx_lm.utils
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return mlx_lm.utils.hf_repo_to_path(identity)
    except (LocalEntryNotFoundError, HFValidationError, OSError):  # not downloaded: mlx-lm fetches it, unsized
        return None
