"""Runs the study's mlx-lm fork for benchmarks/peer_fork.py, inside the fork's own venv (imports no uag).

Protocol: one JSON request per line on stdin, one JSON answer per line on the original stdout (anything
the fork prints goes to stderr). Requests:

    {"cmd": "load", "target": DIR, "drafter": DIR, "dtype": "float32", "openblas": PATH}
    {"cmd": "run", "mode": "baseline" | "context" | "naive", "prompt_ids": [...], "k": 2, "window": 10,
     "max_tokens": 48, "temperature": 0.0, "seed": null}

A run answers the committed ids, which came from the drafter, and clock readings (perf_counter) at the
call and at every yield. The fork does not count proposals; its target tokenizer is wrapped so that the
lengths of the re-encodings each cycle makes are recorded, which gives its proposed count and α exactly
(`_translate_to_verifier`: encode(prefix + draft) and encode(prefix), or one encode with no context).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time


def preload(path: str | None) -> str:
    """The same trick as uag/_blas.py: OpenBLAS loaded globally before mlx binds its cblas symbols."""
    if not path:
        return "reference"
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return f"openblas:{path}"


class Recording:
    """A tokenizer whose `encode` lengths are logged per cycle; the draft tokenizer's `decode` (called
    once per cycle, first) opens a new cycle."""

    def __init__(self, inner, log: list, *, opens_cycle: bool):
        self._inner, self._log, self._opens = inner, log, opens_cycle

    def encode(self, *args, **kwargs):
        ids = self._inner.encode(*args, **kwargs)
        if not self._opens:
            self._log[-1].append(len(ids))
        return ids

    def decode(self, *args, **kwargs):
        if self._opens:
            self._log.append([])
        return self._inner.decode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def proposed_per_cycle(log: list[list[int]]) -> list[int]:
    """Verifier tokens proposed per cycle from the recorded encode lengths.

    Example: [[14, 9], [3]] -> [5, 3]   (with a context prefix of 9 tokens; then a cycle without one)
    """
    return [lengths[0] - (lengths[1] if len(lengths) > 1 else 0) for lengths in log if lengths]


def main() -> None:
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the fork's prints must not corrupt the protocol
    state: dict = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = handle(request, state)
        except Exception as err:  # reported to the benchmark, which stops with the message
            answer = {"error": f"{type(err).__name__}: {err}"}
        protocol.write(json.dumps(answer) + "\n")
        protocol.flush()


def handle(request: dict, state: dict) -> dict:
    if request["cmd"] == "load":
        blas = preload(request.get("openblas"))
        import mlx.core as mx
        import mlx_lm
        from mlx_lm import load

        models = {}
        for role in ("target", "drafter"):
            model, tokenizer = load(request[role])
            model.set_dtype(getattr(mx, request.get("dtype", "float32")))
            mx.eval(model.parameters())
            models[role] = (model, tokenizer)
        state["models"] = models
        return {"blas": blas, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "file": mlx_lm.__file__}
    if request["cmd"] == "run":
        return run(request, state["models"])
    raise ValueError(f"unknown command {request['cmd']!r}")


def run(request: dict, models: dict) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    (target, tokenizer), (drafter, draft_tokenizer) = models["target"], models["drafter"]
    prompt = mx.array(request["prompt_ids"])
    mode, max_tokens = request["mode"], request["max_tokens"]
    sampler = make_sampler(request.get("temperature", 0.0))
    if request.get("seed") is not None:
        mx.random.seed(request["seed"])
    log: list[list[int]] = []
    t_call = time.perf_counter()
    if mode == "baseline":
        steps = ((token, False) for token, _ in generate_step(prompt, target, max_tokens=max_tokens, sampler=sampler))
    else:
        window = request["window"] if mode == "context" else 0
        steps = (
            (token, drafted)
            for token, _, drafted in speculative_generate_step(
                prompt,
                target,
                drafter,
                tokenizer=Recording(tokenizer, log, opens_cycle=False),
                draft_tokenizer=Recording(draft_tokenizer, log, opens_cycle=True),
                num_draft_tokens=request["k"],
                max_tokens=max_tokens,
                sampler=sampler,
                translation_prefix_tokens=window,
            )
        )
    ids, from_draft, times = [], [], []
    for token, drafted in steps:  # as the fork's stream_generate: stop after an EOS token
        token = int(token)
        times.append(time.perf_counter())
        ids.append(token)
        from_draft.append(bool(drafted))
        if token in tokenizer.eos_token_ids:
            break
    steps.close()
    proposed = proposed_per_cycle(log)
    return {
        "ids": ids,
        "from_draft": from_draft,
        "t_call": t_call,
        "times": times,
        "proposed": sum(proposed),
        "cycles": len(log),
    }


if __name__ == "__main__":
    main()
