"""`python -m uag app` (or `python app.py`): the app's command line. Options, the login (never only on the
command line), the port, the limits (models kept, time per request, requests per client), then serve.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from uag.app.session import Session
from uag.app.ui import api_defaults, build, launch
from uag.command import CommandParser, log_to_stderr, number, port_taken, whole
from uag.errors import UserError
from uag.models.store import ModelStore
from uag.runtime.access import REMOTE_MODELS
from uag.runtime.jobs import DEFAULT_BUDGET_S, DEFAULT_PER_CLIENT
from uag.runtime.presets import DEFAULT

DEFAULT_MAX_MODELS = 4  # a pair and one more pair; the least recently used model is unloaded beyond it
AUTH_ENV = "UAG_AUTH"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(
        prog="python -m uag app",
        description="Serve the uag app: the target alone vs speculative decoding, side by side.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=whole, default=7860, help="port (default 7860)")
    parser.add_argument("--share", action="store_true", help="public link through Gradio's tunnel; needs a login")
    parser.add_argument(
        "--auth",
        metavar="USER:PASS",
        help=f"require this login (visible to other users of this machine: prefer ${AUTH_ENV} or --auth-file)",
    )
    parser.add_argument("--auth-file", metavar="PATH", help="read the login USER:PASS from the first line of this file")
    parser.add_argument("--target", default=DEFAULT.target, help=f"preselected target (default {DEFAULT.target})")
    parser.add_argument("--drafter", default=DEFAULT.drafter, help=f"preselected drafter (default {DEFAULT.drafter})")
    parser.add_argument(
        "--remote-models",
        choices=REMOTE_MODELS,
        default="demo",
        help="what remote users may load: the offline demo models (default), also the hub presets, or any hub id; "
        "never a local folder",
    )
    parser.add_argument("--allow-any-model", action="store_true", help="the same as --remote-models any")
    parser.add_argument(
        "--max-models",
        type=whole,
        default=DEFAULT_MAX_MODELS,
        help=f"models kept loaded; the least recently used is unloaded beyond it (default {DEFAULT_MAX_MODELS})",
    )
    parser.add_argument("--max-gb", type=number, help="also unload beyond this many GB of weights (default: no limit)")
    parser.add_argument(
        "--time-budget",
        type=number,
        default=DEFAULT_BUDGET_S,
        metavar="SECONDS",
        help=f"generation time one request may take before it is stopped (default {DEFAULT_BUDGET_S:.0f})",
    )
    parser.add_argument(
        "--per-client",
        type=whole,
        default=DEFAULT_PER_CLIENT,
        metavar="N",
        help=f"requests one client may have queued or running at once (default {DEFAULT_PER_CLIENT})",
    )
    return parser.parse_args(argv)


def _auth(args: argparse.Namespace) -> tuple[str, str] | None:
    """The login from --auth, --auth-file or $UAG_AUTH (in that order); UserError when it is malformed."""
    if args.auth is not None:
        value, where = args.auth, "--auth"
    elif args.auth_file is not None:
        try:
            value = Path(args.auth_file).expanduser().read_text(encoding="utf-8").splitlines()[0]
        except (OSError, IndexError, UnicodeDecodeError):
            raise UserError(f"--auth-file {args.auth_file}: cannot read a USER:PASS line from it") from None
        where = "--auth-file"
    elif os.environ.get(AUTH_ENV):
        value, where = os.environ[AUTH_ENV], f"${AUTH_ENV}"
    else:
        return None
    user, sep, password = value.strip().partition(":")
    if not (sep and user and password):
        raise UserError(f"{where} takes USER:PASS (a user name, a colon, a password)")
    return user, password


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        auth = _auth(args)
        if args.share and auth is None:
            raise UserError(
                "--share puts the app on a public URL, where anyone could run models on this machine. Give it a "
                f"login: --share with ${AUTH_ENV}=USER:PASS, --auth-file PATH or --auth USER:PASS"
            )
        if args.max_models < 2:
            raise UserError(f"--max-models must be at least 2, a target and its drafter (got {args.max_models})")
        if args.per_client < 1 or args.time_budget <= 0:
            raise UserError("--per-client must be at least 1 and --time-budget more than 0")
        if port_taken(args.host, args.port):
            raise UserError(f"port {args.port} is taken: use --port")
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    log_to_stderr()
    session = Session(
        ModelStore(max_models=args.max_models, max_gb=args.max_gb),
        share=args.share,
        remote_models="any" if args.allow_any_model else args.remote_models,
        target=args.target,
        drafter=args.drafter,
        per_client=args.per_client,
        budget_s=args.time_budget,
    )
    demo = build(session)
    try:
        local_url, share_url = launch(
            demo, host=args.host, port=args.port, share=args.share, auth=auth, defaults=api_defaults(session)
        )
    except OSError as err:  # the address is not this machine's, or the port was taken since the check
        print(
            f"error: cannot serve on {args.host}:{args.port} ({err.strerror or err}): use --host or --port",
            file=sys.stderr,
        )
        return 2
    session.preload()  # in the background, once the page is up: the first run then finds the models loaded
    if args.share and not share_url:
        print(
            f"[uag] No public link: Gradio could not reach its share server (offline?). The app keeps serving "
            f"locally at {local_url}, with the login and the remote-user model rules on.",
            file=sys.stderr,
        )
    elif share_url:
        print(f"[uag] public link: {share_url} (login required; remote users' model choice is restricted)")
    if args.host not in ("127.0.0.1", "localhost", "::1") and auth is None:
        print(f"[uag] note: listening on {args.host} without a login; anyone who can reach it can run models.")
    try:
        demo.block_thread()
    except KeyboardInterrupt:
        pass
    return 0
