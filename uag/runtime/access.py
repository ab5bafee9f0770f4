"""Who may load what: the local user anything, remote users only names (never a folder on the server).

A request is remote when it comes from another machine, through a proxy, or through a share link. A remote
user may pick the offline demo models, the drafter kind `lookup`, and hub models that are already loaded;
the operator decides whether they may also load the hub presets or any hub id (`remote_models`). Remote
users never see or use a local path, also not through the names of loaded models. Standard library only.

    check_model("demo-target", "target", access=Access(remote=True))            -> "demo-target"
    check_model("/etc", "target", access=Access(remote=True))                   -> InputError
    check_drafter("lookup+demo-drafter", access=Access(remote=True))            -> "lookup+demo-drafter"
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from uag.core.config import DrafterSpec
from uag.errors import InputError
from uag.models.store import DEMO_NAMES
from uag.runtime.presets import preset_models

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
FORWARDED = ("forwarded", "x-forwarded-for", "x-real-ip")  # a proxy in front: the real client is elsewhere
REMOTE_MODELS = ("demo", "presets", "any")  # what remote users may load beyond the models already loaded
REMOTE_RULES = {
    "demo": "the offline demo models, lookup and the hub models already loaded",
    "presets": "the presets' models, lookup and the hub models already loaded",
    "any": "any hub model (org/name), the offline demo models and lookup",
}


@dataclass(frozen=True)
class Access:
    """What one request may load. `remote_models` is the operator's choice for remote users: "demo"
    (offline demo models only), "presets" (also the hub presets) or "any" (any hub id); never a folder."""

    remote: bool = False
    remote_models: str = "demo"

    def __post_init__(self):
        if self.remote_models not in REMOTE_MODELS:
            raise ValueError(f"remote_models must be one of {REMOTE_MODELS} (got {self.remote_models!r})")


LOCAL = Access()


def is_remote(host: str | None, headers: Mapping[str, str] | None = None, *, share: bool = False) -> bool:
    """Whether a request comes from somewhere other than this machine.

    A shared app's users all arrive through the share tunnel, which connects from localhost, so with
    `share` everyone counts as remote; so does any request forwarded by a proxy.
    Example: is_remote("127.0.0.1") -> False;  is_remote("192.168.1.7") -> True;  is_remote(None) -> True
    """
    if share or host is None:
        return True
    if headers is not None and any(name.lower() in FORWARDED for name in headers.keys()):
        return True
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def client_of(host: str | None, headers: Mapping[str, str] | None = None) -> str:
    """Who a request counts as for the per-client job limit: the address a proxy forwarded for, else the
    connecting address.

    Example: client_of("127.0.0.1", {"X-Forwarded-For": "203.0.113.9, 10.0.0.1"}) -> "203.0.113.9"
    """
    for name, value in (headers or {}).items():
        if name.lower() in ("x-forwarded-for", "x-real-ip") and value.strip():
            return value.split(",")[0].strip()
    return host or "unknown"


def is_local_name(name: str) -> bool:
    """Whether `name` would be read from this machine's disk rather than by name (a folder, not a hub id).

    Example: is_local_name("org/model") -> False (unless ./org/model exists);  is_local_name("./x") -> True
    """
    if name in DEMO_NAMES:
        return False
    return not HUB_ID.match(name) or ".." in name or Path(name).expanduser().exists()


def names_for_remote(loaded: Collection[str]) -> list[str]:
    """The loaded models a remote user may see and use: names, never local paths."""
    return sorted(name for name in loaded if not is_local_name(name))


def check_model(name: str, role: str, *, access: Access, loaded: Collection[str] = ()) -> str:
    """The model name if this user may use it; InputError saying why not otherwise."""
    name = (name or "").strip()
    if not name:
        kinds = (
            "a preset or a hub id (org/name)" if access.remote else "a preset, a hub id (org/name) or a model folder"
        )
        raise InputError(f"choose a {role}: {kinds}")
    if not access.remote:
        return name
    if is_local_name(name):
        raise InputError(
            f"{role} {name!r} is not a hub id (org/name): model folders on the server can be chosen only by "
            "someone on that machine. Choose a preset or a hub id."
        )
    allowed = {*DEMO_NAMES, *names_for_remote(loaded)}
    if access.remote_models in ("presets", "any"):
        allowed |= preset_models()
    if name in allowed or access.remote_models == "any":
        return name
    raise InputError(
        f"{role} {name!r} is not available to remote users of this app, which serves them "
        f"{REMOTE_RULES[access.remote_models]}: {', '.join(sorted(allowed))}. The person running the app "
        "decides which models remote users may load."
    )


def check_drafter(text: str, *, access: Access, loaded: Collection[str] = ()) -> str:
    """The drafter as a normalised `DrafterSpec` string ("demo-drafter", "lookup", "lookup+demo-drafter")
    if this user may use it; InputError otherwise. Lookup drafts from the prompt: open to everyone."""
    spec = DrafterSpec.parse(text)
    if spec.model is not None:
        model = check_model(spec.model, "drafter", access=access, loaded=loaded)
        spec = DrafterSpec(spec.lookup, model)
    return str(spec)


def note_for(access: Access) -> str:
    """What this user may choose, in a sentence ("" for the local user)."""
    if not access.remote:
        return ""
    return f"You are connected remotely: this app serves you {REMOTE_RULES[access.remote_models]} (no local folders)."
