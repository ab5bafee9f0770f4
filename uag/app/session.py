"""The app's logic without a UI: one `Session` serves every user. It decides who may load what, offers the
presets, and runs comparisons and calibrations as jobs on the MLX worker, over a `Host` (uag.runtime.host: the
model store, the worker, the pairs, auto's evidence and its cost policy), its own or the one `uag serve` shares.

Plain data in and out; no gradio. What belongs to one user (their history, their results file) is
passed in and handed back, so the UI can keep it per browser tab.

    session = Session()
    for update in session.compare("Stolica Polski to", Settings.parse(max_tokens=16)):
        print(update.status)                 # loading → target alone → speculative → done
    update.spans                             # [(" jedna z", "target"), (" największych", "accepted draft"), …]
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd

from uag.app.compare_view import Compared, CompareView, Finished, Ready, Started, Streamed, Update
from uag.app.costs_view import Calibrated, CalibrationUpdate, CalibrationView, CostView, cost_view
from uag.app.files import Exports, load_results
from uag.app.history import C_FITTED, PlotView, plot_view
from uag.app.settings import Settings, check_prompt
from uag.costs.calibrate import DEFAULT_CONTEXT, DEFAULT_WIDTHS, calibrate
from uag.costs.pair import MEASURING
from uag.costs.profiles import find_calibration
from uag.costs.profiles import save as save_calibration
from uag.errors import InputError, UserError
from uag.machine import backend
from uag.models import demo
from uag.models.demo import DEMO_NAMES
from uag.models.dtypes import slow_dtype_note
from uag.models.loading import load_model
from uag.models.store import LoadedModel, ModelStore
from uag.runtime.access import (
    LOCAL,
    Access,
    ServedModels,
    check_drafter,
    check_model,
    client_of,
    is_remote,
    names_for_remote,
    note_for,
)
from uag.runtime.host import Host
from uag.runtime.jobs import (
    DEFAULT_BUDGET_S,
    DEFAULT_PER_CLIENT,
    JobRunner,
    OutOfTime,
    Status,
    failure,
    tell,
)
from uag.runtime.pair import Loaded, prompt_ids_for
from uag.runtime.presets import DEFAULT, PRESETS, Preset
from uag.runtime.worker import Job, MLXWorker

log = logging.getLogger(__name__)
LOOPBACK = ("127.0.0.0/8", "::1/128")

CALIBRATION_REPEATS = 5  # timed passes per width (after a warm-up), as `python -m uag calibrate`


class _Cancelled(Exception):
    """Raised from a calibration's progress callback when its job was cancelled."""


class Session:
    """The app's state shared by all users: the rules on what may be loaded, the presets, the exports, over a
    `Host` (its own, on `store` and `worker`, or `host`: uag serve's, which the API shares).

    `served` (uag serve's app at /ui) replaces the app's own rules: every user may load what the API serves,
    no more, and counts as remote for what the app shows (no server paths)."""

    def __init__(
        self,
        store: ModelStore | None = None,
        worker: MLXWorker | None = None,
        *,
        host: Host | None = None,
        share: bool = False,
        remote_models: str = "demo",
        target: str = DEFAULT.target,
        drafter: str = DEFAULT.drafter,
        export_dir: str | Path | None = None,
        per_client: int = DEFAULT_PER_CLIENT,
        budget_s: float | None = DEFAULT_BUDGET_S,
        served: ServedModels | None = None,
    ):
        if host is None:
            runner = JobRunner(worker or MLXWorker(), per_client=per_client, budget_s=budget_s)
            host = Host(store or ModelStore(), runner)  # the app alone: a pair's costs measured on its first use
        self.host = host
        self.exports = Exports(export_dir)
        self.share = share
        self.remote_models = remote_models
        self.served = served
        dtypes = (served.target_dtype, served.drafter_dtype) if served is not None else (None, None)
        self.defaults = Settings(target=target, drafter=drafter, target_dtype=dtypes[0], drafter_dtype=dtypes[1])

    @property
    def store(self) -> ModelStore:
        return self.host.store

    @property
    def worker(self) -> MLXWorker:
        return self.host.worker

    @property
    def runner(self) -> JobRunner:
        return self.host.runner

    # --- who may load what -------------------------------------------------------------------------------
    def access(self, host: str | None, headers: Mapping[str, str] | None = None) -> Access:
        # On uag serve everyone is remote: a web page can reach its loopback port through DNS rebinding.
        remote = self.served is not None or is_remote(host, headers, share=self.share)
        return Access(remote, self.remote_models)

    def client(self, host: str | None, headers: Mapping[str, str] | None = None) -> str:
        """Who a request counts as for the per-client limit. A shared app's users all arrive through the share
        tunnel, which connects from this machine: there (only) loopback is a proxy whose forwarded address is
        believed; elsewhere a forwarded header is anyone's to write (uag serve's front door reads it from
        --trusted-proxy before the app sees the request)."""
        return client_of(host, headers, trusted_proxies=LOOPBACK if self.share and self.served is None else ())

    def check_models(
        self,
        target: str,
        drafter: str,
        *,
        access: Access = LOCAL,
        target_dtype: str | None = None,
        drafter_dtype: str | None = None,
    ) -> tuple[str, str]:
        """(target, drafter) if this user may load them; InputError saying why not, decided before the disk is
        looked at for a remote user or on uag serve. Dtypes count only on uag serve (`served`)."""
        if self.served is not None:
            return self.served.check(target, drafter, target_dtype=target_dtype, drafter_dtype=drafter_dtype)
        loaded = self.store.loaded
        return (
            check_model(target, "target", access=access, loaded=loaded),
            check_drafter(drafter, access=access, loaded=loaded),
        )

    def loaded_names(self, access: Access = LOCAL) -> list[str]:
        """The models loaded now, as this user may see them (no local paths for remote users; on uag serve,
        the served models only)."""
        if self.served is not None:
            return [name for name in self.store.loaded if name in self.served.models]
        return names_for_remote(self.store.loaded) if access.remote else self.store.loaded

    def access_note(self, access: Access) -> str:
        """What this user may load, in a sentence ("" for the local user of the app)."""
        return self.served.note if self.served is not None else note_for(access)

    @property
    def presets(self) -> tuple[Preset, ...]:
        """The pairs offered in the app's list: on uag serve, the served pairs."""
        return self.served.presets() if self.served is not None else PRESETS

    def preset(self, label: str | None) -> Preset | None:
        return next((p for p in self.presets if p.label == label), None)

    def preset_choices(self) -> list[str]:
        return [p.label for p in self.presets]

    def preset_for(self, target: str, drafter: str) -> str | None:
        return next((p.label for p in self.presets if (p.target, p.drafter) == (target, drafter)), None)

    def r_of(self, target: str, drafter: str) -> float | None:
        """Drafter bytes / target bytes of a pair that has run here (None before, or for lookup)."""
        loaded = self.host.opened(target, drafter)
        return loaded.r if loaded is not None else None

    # --- on the worker thread ----------------------------------------------------------------------------
    def preload(self, target: str | None = None, drafter: str | None = None) -> Job:
        """Load and warm up a pair in the background (at app start), so that the first run is quick."""
        settings = replace(
            self.defaults, target=target or self.defaults.target, drafter=drafter or self.defaults.drafter
        )
        first = any(name in DEMO_NAMES and not demo.is_ready(name) for name in (settings.target, settings.drafter))
        label = "preparing the demo models for their first use" if first else f"loading {settings.target}"
        job = self.worker.submit(self._pair_job, settings, label=label)
        threading.Thread(target=self._drain, args=(job,), name="uag-preload", daemon=True).start()
        return job

    @staticmethod
    def _drain(job: Job) -> None:
        try:
            for item in job:
                if isinstance(item, Status):
                    log.info("%s", item.text)
        except UserError as err:  # a bad --target/--drafter: said again when a user runs it
            log.warning("preloading failed: %s", err)
        except Exception:
            log.exception("preloading failed")

    def _load(
        self,
        job: Job,
        store: ModelStore,
        name: str,
        *,
        role: str,
        progress: Any = None,
        keep: Sequence[str] = (),
        dtype: str | None = None,
    ) -> LoadedModel:
        """One model for `open_pair` (uag.models.loading.load_model, a broken folder the user's message), with what
        loading it does said to the user."""
        if store.has(name, dtype):
            return load_model(store, name, role=role, keep=keep, dtype=dtype)
        if name in DEMO_NAMES and not demo.is_ready(name):
            tell(
                job,
                f"First use: converting the offline demo model {name} from its packaged GGUF file, once "
                "(about a minute on a CPU; later starts take seconds)…",
            )
        else:
            tell(job, f"Loading the {role} {name}…")
        tic = time.perf_counter()
        model = load_model(
            store, name, role=role, progress=lambda msg: tell(job, f"{role}: {msg}…"), keep=keep, dtype=dtype
        )
        tell(
            job,
            f"Loaded the {role} {name} ({model.dtype}, {model.weight_bytes / 1e6:.0f} MB) "
            f"in {time.perf_counter() - tic:.0f} s.",
        )
        return model

    def _prepare(self, job: Job, settings: Settings) -> Loaded:
        """Open the pair on the host (loading and checking it as every front end does, reporting progress), warmed
        up once so that the timings are fair."""
        return self.host.open(
            settings.target,
            settings.drafter,
            target_dtype=settings.target_dtype,
            drafter_dtype=settings.drafter_dtype,
            progress=partial(tell, job),
            load=partial(self._load, job),
            warm=True,
        )

    def _pair_job(self, job: Job, settings: Settings) -> Iterator[Any]:
        self._prepare(job, settings)
        yield Status("ready")

    def _compare_job(self, job: Job, prompt: str, settings: Settings) -> Iterator[Any]:
        loaded = self._prepare(job, settings)
        ids = prompt_ids_for(loaded, prompt, settings.generation)  # the target's template and context, the drafter's
        yield Ready(loaded.r)
        if note := slow_dtype_note(loaded.target.dtype, backend()):
            yield Status(f"Note: {note}.")
        auto = None
        if settings.generation.k_policy == "adaptive":  # the host's cost policy, the evidence its runs share
            auto = self.host.open_auto(loaded, settings.drafter, progress=partial(self._measuring, job))
        job.limit(self.runner.budget_s)  # generation time only: loading the models is not the user's doing
        # Never concurrently: the target alone first, then with the drafter, each timed on its own.
        baseline = None
        for mode in ("baseline", settings.strategy):
            if job.cancelled.is_set():
                break
            yield Started(mode)
            pair = loaded if mode != "baseline" else Loaded(loaded.target, None, None)
            learns = auto if mode != "baseline" else None  # finished at the run's end: its evidence saved
            with self.host.running(job, pair, ids, settings.config(mode), auto=learns) as running:
                for event in running:
                    yield Streamed(mode, event.tokens, event.cycle)
            run = running.run
            assert run is not None and run.finish_reason is not None, "a stream ended without a final record"
            if mode != "baseline" and baseline is not None:  # the verdict before the outputs are shown side by side
                checked = self.host.check(loaded, ids, settings.config(mode), run, baseline=baseline)
                yield Compared(checked.divergence)
            baseline = run if mode == "baseline" else baseline
            yield Finished(mode, run)
        if job.out_of_time:
            yield OutOfTime(self.runner.budget_s)

    @staticmethod
    def _measuring(job: Job, message: str) -> None:
        """A first-use calibration's first word, to the user (its steps are too quick to follow)."""
        if message == MEASURING:
            tell(job, f"{MEASURING[0].upper()}{MEASURING[1:]} …")

    def _calibrate_job(self, job: Job, settings: Settings, options: dict[str, Any]) -> Iterator[Any]:
        loaded = self._prepare(job, settings)
        if loaded.pair is None:
            raise InputError("prompt lookup has no drafter model to time: choose a drafter model (or lookup+<model>)")

        def progress(message: str) -> None:
            if job.cancelled.is_set():  # calibrate() reports after each timed width: stop there
                raise _Cancelled
            job.emit(Status(message))

        try:
            result = calibrate(loaded.pair, progress=progress, **options)
        except _Cancelled:
            return
        yield Calibrated(result, save_calibration(result), loaded.pair)

    # --- comparing ---------------------------------------------------------------------------------------
    def compare(
        self,
        prompt: str,
        settings: Settings,
        *,
        access: Access = LOCAL,
        owner: str | None = None,
        client: str | None = None,
    ) -> Iterator[Update]:
        """Target alone, then speculative, streamed as `Update`s; the last one has state done/stopped/error.

        `owner` (a browser tab) lets `stop(owner)` cancel this comparison from another request; `client`
        (an address) counts it against that client's limit of queued jobs. Closing the iterator cancels the
        job. Every failure ends in an error `Update` with a message for the user, never an exception.
        """
        try:
            prompt = check_prompt(prompt)
            dtypes = {"target_dtype": settings.target_dtype, "drafter_dtype": settings.drafter_dtype}
            target, drafter = self.check_models(settings.target, settings.drafter, access=access, **dtypes)
        except UserError as err:
            yield Update(failure(err, "run"), state="error")
            return
        settings = replace(settings, target=target, drafter=drafter)
        items = self.runner.run(
            self._compare_job, prompt, settings, label=f"a comparison on {target}", client=client, owner=owner
        )
        yield from self._follow(items, CompareView(prompt, settings), "run")

    @staticmethod
    def _follow(items: Iterator[Any], view: CompareView | CalibrationView, doing: str) -> Iterator[Any]:
        """The one loop of a user's job: the refreshes `view` makes of the job's items, then its last one;
        an exception from the job ends in the view's error update (`failure`: the user's or an internal
        error), never in the consumer. Closing it, or leaving early, cancels the job."""
        try:
            for item in items:
                if (update := view.take(item)) is not None:
                    yield update
            yield view.finished()
        except Exception as err:
            yield view.failed(failure(err, doing))
        finally:
            items.close()  # cancels the job when the consumer left early (Stop, cancel, a closed connection)

    def stop(self, owner: str | None) -> bool:
        """Cancel `owner`'s running comparison or calibration within a cycle; False when there is none."""
        return self.runner.stop(owner)

    # --- costs on this machine ----------------------------------------------------------------------------
    def cost_view(self, target: str, drafter: str) -> CostView:
        """The saved cost profile of this pair on this machine, if the pair is loaded here (never loads it)."""
        target, drafter = (target or "").strip(), (drafter or "").strip()
        loaded = self.host.opened(target, drafter)
        shown = f"{target or '(no target)'} ← {drafter or '(no drafter)'}"
        if loaded is None:
            return CostView(
                None,
                f"{shown} is not loaded yet, so its saved costs cannot be looked up. Run a comparison with it, or "
                "press **Calibrate this pair** to load it and measure what its steps cost here.",
            )
        if loaded.pair is None:
            return CostView(
                None, f"{shown}: prompt lookup has no drafter model, so there are no drafter costs to show."
            )
        try:
            calibration = find_calibration(loaded.pair)
        except Exception:  # a damaged or foreign file in the cache must not take the tab down
            log.warning("reading the cost profile of %s failed", shown, exc_info=True)
            return CostView(
                None,
                "The saved cost profile of this pair is damaged and could not be read. Press **Calibrate this "
                "pair** to measure it again.",
            )
        if calibration is None:
            return CostView(
                None,
                f"No cost profile for {shown} on this machine yet. Press **Calibrate this pair** to measure what "
                "a target pass over w tokens, a drafter step and translation cost here; the `auto` strategy then "
                "starts from these costs instead of learning them during the run.",
            )
        return cost_view(calibration, loaded.pair)

    def calibrate_pair(
        self,
        target: str,
        drafter: str,
        *,
        access: Access = LOCAL,
        owner: str | None = None,
        client: str | None = None,
        context: int = DEFAULT_CONTEXT,
        widths: Sequence[int] = DEFAULT_WIDTHS,
        repeats: int = CALIBRATION_REPEATS,
    ) -> Iterator[CalibrationUpdate]:
        """Load the pair if needed, measure its costs on the MLX worker and save them in the user cache.

        Streams `CalibrationUpdate`s; the last has state done (with the new `CostView`), stopped or error.
        The same rules as `compare` decide what a user may load; `stop(owner)` cancels it after the width
        being timed. Every failure ends in an error update, never an exception.
        """
        try:
            dtypes = {"target_dtype": self.defaults.target_dtype, "drafter_dtype": self.defaults.drafter_dtype}
            target, drafter = self.check_models(target, drafter, access=access, **dtypes)
        except UserError as err:
            yield CalibrationUpdate(failure(err, "calibrate"), state="error")
            return
        settings = replace(self.defaults, target=target, drafter=drafter)
        options = {"context": context, "widths": tuple(widths), "repeats": repeats}
        label = f"calibrating {target} ← {drafter}"
        items = self.runner.run(self._calibrate_job, settings, options, label=label, client=client, owner=owner)
        yield from self._follow(items, CalibrationView(target, drafter, remote=access.remote), "calibrate")

    # --- history, the plot, files ------------------------------------------------------------------------
    def plot(
        self,
        rows: Sequence[Mapping[str, Any]],
        results: pd.DataFrame | None = None,
        *,
        ks: Sequence[int] = (2, 4),
        c_choice: str = C_FITTED,
        pair: tuple[str, str] | None = None,
    ) -> PlotView:
        """Speedup vs α for this session's runs (and a loaded results file): see `uag.app.history.plot_view`."""
        pair_r = self.r_of(*pair) if pair is not None else None
        return plot_view(rows, results, ks=ks, c_choice=c_choice, pair=pair, pair_r=pair_r)

    @staticmethod
    def load_results(path: str | Path | None) -> tuple[pd.DataFrame | None, str]:
        return load_results(path)

    def export_history(self, rows: Sequence[Mapping[str, Any]]) -> Path:
        return self.exports.history(rows)

    def export_figure(self, figure: Any) -> tuple[list[Path], str]:
        return self.exports.figure(figure)
