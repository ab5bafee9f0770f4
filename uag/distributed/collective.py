"""The ranks of a sharded run: joining the group, one small collective per decision, and bounded waits.

Every collective can block forever when a peer is gone without closing its connection (stopped, a
cable pulled) or never connected (rank 0 waits in `mx.distributed.init` holding the GIL, so no Python
thread can time it out). A `Watchdog` child process therefore watches each rank: the rank re-arms it on
every sign of progress; when none comes for `timeout_s` the watchdog writes one line naming the rank
and the cause, and ends the rank. A peer that exits or crashes closes its sockets: the ring backend then
raises at once, and `RankLost` turns that into the same kind of line.

`Link.exchange` is the one collective per cycle: an integer `all_sum` in which rank 0 contributes the
message and every other rank zeros. `Link.check_agreement` (a debug option) all-gathers a hash of each
rank's committed tokens and names any rank that holds different ones.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
from mlx_lm.generate import generation_stream

from uag.distributed.options import DEFAULT_CONNECT_TIMEOUT_S
from uag.errors import UserError

# The watchdog: a bare Python child that reads re-arm lines from the rank on stdin. "<seconds> <message>"
# sets the limit and the message, "+" re-arms with the last ones, EOF (the rank exited) ends it quietly.
_WATCHDOG = r"""
import os, select, signal, sys, time
pid, limit, message, deadline, buf = int(sys.argv[1]), None, "", None, b""
while True:
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    if not select.select([0], [], [], wait)[0]:
        os.write(2, (message + "\n").encode("utf-8", "backslashreplace"))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            time.sleep(2)
        sys.exit(0)
    data = os.read(0, 65536)
    if not data:
        sys.exit(0)
    *lines, buf = (buf + data).split(b"\n")
    for line in lines:
        if line != b"+":
            head, _, rest = line.decode("utf-8", "replace").partition(" ")
            limit, message = float(head), rest
        deadline = None if limit is None or limit <= 0 else time.monotonic() + limit
"""


class RankLost(UserError):
    """Another rank died, never connected, or stopped answering: one line naming it and the cause."""


class RanksDisagree(UserError):
    """Ranks hold different committed tokens (the debug check) or were started with different input."""


class Watchdog:
    """Ends this process with one line on stderr when it is not re-armed within the current limit."""

    def __init__(self):
        self._child = subprocess.Popen(
            [sys.executable, "-S", "-c", _WATCHDOG, str(os.getpid())], stdin=subprocess.PIPE, close_fds=True
        )
        self._fd = self._child.stdin.fileno()

    def arm(self, limit_s: float, message: str) -> None:
        """From now on, `message` ends the rank unless progress is reported within `limit_s` (≤ 0: never)."""
        self._write(f"{limit_s} {' '.join(message.split())}\n")

    def progress(self) -> None:
        self._write("+\n")

    def close(self) -> None:
        if self._child.poll() is None:
            self._child.stdin.close()
            self._child.wait(timeout=5)

    def _write(self, line: str) -> None:
        try:
            os.write(self._fd, line.encode())
        except (BrokenPipeError, ValueError, OSError):
            pass  # the watchdog is gone only when it has fired: nothing left to re-arm


def others(rank: int, size: int) -> str:
    """The other ranks, for messages. Example: others(0, 2) -> "rank 1";  others(1, 4) -> "ranks 0, 2, 3" """
    rest = [r for r in range(size) if r != rank]
    return f"rank {rest[0]}" if len(rest) == 1 else "ranks " + ", ".join(map(str, rest))


def join_group(watchdog: Watchdog, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> mx.distributed.Group:
    """This process's place in the group `mlx.launch` (or MLX_RANK / MLX_HOSTFILE) describes; strict, so
    that a missing environment is an error rather than a silent group of one."""
    rank = os.environ.get("MLX_RANK", "?")
    hostfile = os.environ.get("MLX_HOSTFILE", "")
    watchdog.arm(
        connect_timeout_s,
        f"error: rank {rank}: the other ranks did not all connect within {connect_timeout_s:g} s "
        f"(are they running? hostfile {hostfile or 'from mlx.launch'})",
    )
    try:
        group = mx.distributed.init(strict=True)
    except RuntimeError as err:
        if not hostfile and "MLX_RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
            raise UserError(
                "--shard needs several processes: start them with mlx.launch --hostfile hosts.json -- python -m "
                "uag generate|serve --shard …"
            ) from None
        raise RankLost(f"rank {rank}: could not connect to the other ranks ({err}; hostfile {hostfile})") from None
    if group.size() < 2:
        raise UserError("--shard needs at least two ranks; the hostfile names one")
    return group


class Link:
    """Rank 0's decisions to every rank: one fixed-width integer `all_sum` each."""

    def __init__(self, group: mx.distributed.Group, width: int, watchdog: Watchdog | None = None):
        self.group, self.width, self.watchdog = group, width, watchdog
        self.rank, self.size = group.rank(), group.size()
        self.exchanges = 0
        self.phase = "starting"

    def exchange(self, message: Sequence[int] | None) -> list[int]:
        """Rank 0 passes its message (at most `width` integers), the others None; all get rank 0's message."""
        buffer = [0] * self.width
        if self.rank == 0:
            assert message is not None and len(message) <= self.width, (message, self.width)
            buffer[: len(message)] = message
        out = self.collect(lambda: mx.distributed.all_sum(mx.array(buffer, dtype=mx.int32), group=self.group))
        self.exchanges += 1
        return out

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's `values` (all of one length), in rank order."""
        n = len(values)
        flat = self.collect(lambda: mx.distributed.all_gather(mx.array(list(values), dtype=mx.int32), group=self.group))
        return [flat[r * n : (r + 1) * n] for r in range(self.size)]

    def collect(self, op) -> list[int]:
        """Run one collective to the end; a lost peer becomes `RankLost` naming it."""
        try:
            # Work still queued on another stream (mlx-lm's generate_step computes one step past its last
            # token, on its own stream) would run its collectives in a different order on each rank.
            mx.synchronize(generation_stream)
            out = op()
            mx.eval(out)
            result = out.tolist()
        except RuntimeError as err:
            raise self.lost(err) from None
        if self.watchdog is not None:
            self.watchdog.progress()
        return result

    def lost(self, err: Exception) -> RankLost:
        return RankLost(
            f"rank {self.rank}: lost {others(self.rank, self.size)} while {self.phase} ({err}): "
            "it exited, crashed, or its link went down"
        )

    def check_agreement(self, committed: Sequence[int], when: str) -> None:
        """Debug: every rank holds the same committed tokens, or `RanksDisagree` names the ranks that differ."""
        rows = self.gather(fingerprint(committed))
        differ = [r for r, row in enumerate(rows) if row != rows[0]]
        if differ:
            lengths = ", ".join(f"rank {r}: {rows[r][0]}" for r in [0, *differ])
            raise RanksDisagree(
                f"rank {self.rank}: rank {', '.join(map(str, differ))} holds different committed tokens from "
                f"rank 0 {when} (token counts {lengths}): a bug, please report it"
            )


def fingerprint(ids: Sequence[int]) -> list[int]:
    """[count, hash_hi, hash_lo] of token ids, in int32 range for a collective.

    Example: fingerprint([1, 2]) != fingerprint([2, 1]); fingerprint([])[0] == 0
    """
    digest = hashlib.blake2b(b"".join(int(t).to_bytes(4, "little", signed=True) for t in ids), digest_size=8)
    value = int.from_bytes(digest.digest(), "little")
    return [len(ids), (value >> 33) & 0x7FFFFFFF, value & 0x7FFFFFFF]


def wait_ms(ms: float) -> None:
    """Wait `ms` milliseconds precisely (sleep for the bulk, spin the last 0.2 ms)."""
    end = time.perf_counter() + ms / 1000
    if ms > 0.5:
        time.sleep((ms - 0.2) / 1000)
    while time.perf_counter() < end:
        pass


COLLECTIVES = ("all_sum", "all_gather", "send", "recv_like")


@contextmanager
def emulated_link(delay_ms: float) -> Iterator[None]:
    """Every collective of this process (the model's and the decisions') finishes, then waits `delay_ms`,
    as if it had crossed a link that much slower: a benchmark's stand-in for Thunderbolt or Ethernet.
    Each collective is evaluated where it is built, so even 0 ms changes the schedule a little; compare
    runs under the same emulation."""
    originals = {name: getattr(mx.distributed, name) for name in COLLECTIVES}

    def delayed(op):
        def run(*args, **kwargs):
            out = op(*args, **kwargs)
            mx.eval(out)
            wait_ms(delay_ms)
            return out

        return run

    try:
        for name, op in originals.items():
            setattr(mx.distributed, name, delayed(op))
        yield
    finally:
        for name, op in originals.items():
            setattr(mx.distributed, name, op)
