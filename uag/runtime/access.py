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
from uag.models.demo import DEMO_NAMES
from uag.runtime.presets import PRESETS, Preset, preset_models

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


def is_trusted(address: str, networks: Collection[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> bool:
    """Whether `address` is in one of `networks` (an IPv4 address written as IPv6 counts as itself).

    Example: is_trusted("::ffff:10.0.0.1", [ip_network("10.0.0.0/8")]) -> True;  is_trusted("name", [...]) -> False
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    ip = getattr(ip, "ipv4_mapped", None) or ip
    return any(ip in network for network in networks)


def client_of(
    host: str | None,
    headers: Mapping[str, str] | None = None,
    *,
    trusted_proxies: Collection[str | ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
) -> str:
    """Who a request counts as for the per-client limits: the connecting address, or, when that is a trusted
    proxy (IP networks, or their texts), the address it forwarded for: the last one in X-Forwarded-For that is
    not itself a trusted proxy (a client may write any it likes before its proxy's), else X-Real-IP. Anyone
    else's forwarded headers are ignored.

    Example: client_of("10.0.0.1", {"X-Forwarded-For": "6.6.6.6, 203.0.113.9"}, trusted_proxies=["10.0.0.0/8"])
             -> "203.0.113.9";  client_of("198.51.100.7", {"X-Forwarded-For": "203.0.113.9"}) -> "198.51.100.7"
    """
    networks = [ipaddress.ip_network(n, strict=False) if isinstance(n, str) else n for n in trusted_proxies]
    trusted = lambda address: is_trusted(address, networks)  # noqa: E731

    if host is None or not trusted(host):
        return host or "unknown"
    pairs = [(name.lower(), value) for name, value in (headers or {}).items()]
    forwarded = [a.strip() for name, value in pairs if name == "x-forwarded-for" for a in value.split(",") if a.strip()]
    for address in reversed(forwarded):
        if not trusted(address):
            return address
    real = [value.strip() for name, value in pairs if name == "x-real-ip" and value.strip()]
    return forwarded[0] if forwarded else real[0] if real else host


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
    if name not in DEMO_NAMES and (not HUB_ID.match(name) or ".." in name):  # by its shape: the disk is not asked
        raise InputError(
            f"{role} {name!r} is not a hub id (org/name): model folders on the server can be chosen only by "
            "someone on that machine. Choose a preset or a hub id."
        )
    allowed = {*DEMO_NAMES, *names_for_remote(loaded)}
    if access.remote_models in ("presets", "any"):
        allowed |= preset_models()
    # A hub id that is also a folder here would load the folder: refused with the words a name not served gets,
    # so that the answer does not say whether the folder exists.
    if (name in allowed or access.remote_models == "any") and not is_local_name(name):
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


# --- `uag serve`'s app at /ui: what the API serves, for everyone ---------------------------------------------
@dataclass(frozen=True)
class ServedModels:
    """What the app mounted on `uag serve` may load, for every user of it, local or remote: the served target
    and the drafters the API allows (uag.server.protocol.ServerDefaults.allowed), in the dtypes the API loads
    them in. Decided by the names as typed, before the disk is looked at: no answer says whether a path exists.

        ServedModels("demo-target", ("lookup",)).check("demo-target", "lookup")  -> ("demo-target", "lookup")
        ServedModels("demo-target", ("lookup",)).check("/etc", "lookup")         -> InputError("this server's …")
    """

    target: str
    drafters: tuple[str, ...]  # normalised DrafterSpec strings: "lookup", "demo-drafter", "lookup+demo-drafter"
    target_dtype: str | None = None  # None: as stored
    drafter_dtype: str | None = None

    def check(
        self, target: str, drafter: str, *, target_dtype: str | None = None, drafter_dtype: str | None = None
    ) -> tuple[str, str]:
        """(target, drafter as a normalised DrafterSpec) if they are what this server serves; InputError naming
        what it serves otherwise. A drafter's dtype matters only where it has a model."""
        target = (target or "").strip() if isinstance(target, str) else target
        try:
            spec = DrafterSpec.parse(drafter)
        except InputError:
            spec = None
        served = (
            target == self.target
            and spec is not None
            and str(spec) in self.drafters
            and target_dtype == self.target_dtype
            and (spec.model is None or drafter_dtype == self.drafter_dtype)
        )
        if not served:
            dtypes = any((target_dtype, drafter_dtype, self.target_dtype, self.drafter_dtype))
            got = f"target {_shown(target)}{_in(target_dtype, dtypes)}, drafter {_shown(drafter)}"
            if dtypes and spec is not None and spec.model is not None:
                got += _in(drafter_dtype, True)
            raise InputError(f"{self.rule(dtypes)}. Choose one of them (got {got})")
        return target, str(spec)

    @property
    def models(self) -> set[str]:
        """The model names this server may load: the target and the drafters' models."""
        return {self.target} | {m for d in self.drafters if (m := DrafterSpec.parse(d).model) is not None}

    def rule(self, dtypes: bool = False) -> str:
        """What it serves, in a sentence; with `dtypes` (or dtypes set), in which dtypes.

        Example: "this server's app runs the served pair only: target 'demo-target', drafters 'lookup'"
        """
        return f"this server's app runs the served pair only: {self._listed(dtypes)}"

    @property
    def note(self) -> str:
        """What every user of the app is told on opening it."""
        return f"This app runs what this server's API serves: {self._listed()} (uag serve's --target and --drafters)."

    def _listed(self, dtypes: bool = False) -> str:
        drafters = ", ".join(repr(d) for d in self.drafters) or "none (speculation is off on this server)"
        dtypes = dtypes or bool(self.target_dtype or self.drafter_dtype)
        models = f" (drafter models{_in(self.drafter_dtype, True)})" if dtypes and self.models - {self.target} else ""
        return f"target {self.target!r}{_in(self.target_dtype, dtypes)}, drafters {drafters}{models}"

    def presets(self) -> tuple[Preset, ...]:
        """The served pairs as presets: a bundled preset's label and note where one matches, else the names."""
        bundled = {(p.target, p.drafter): p for p in PRESETS}
        return tuple(
            bundled.get((self.target, d)) or Preset(f"{self.target} ← {d}", self.target, d, "served by this server")
            for d in self.drafters
        )


def _shown(value: object) -> str:
    """A name as typed, cut for a one-line message. Example: _shown("x" * 100) -> "'xxxx…'" """
    text = value if isinstance(value, str) else repr(value)
    return repr(text[:80] + ("…" if len(text) > 80 else ""))


def _in(dtype: str | None, shown: bool) -> str:
    """Example: _in("q4", True) -> " in q4";  _in(None, True) -> " as stored";  _in("q4", False) -> "" """
    return "" if not shown else f" in {dtype}" if dtype else " as stored"
