"""Benchmarks of the server's aggregation cost (``mpifl bench aggregation``).

Times ``aggregate()`` of every registered rule (or a chosen few) on synthetic, conflicting
client updates, over a grid of clients per round m, model sizes d and history lengths tau.
FedFV's Gram form is also timed against the direct per-pair loop
(:class:`~mpifl.aggregators.fedfv_direct.DirectFedFV`) on the same inputs in the same run, and
reported as a ratio with the largest difference between the two steps: ratios measured side by
side carry over between machines, absolute times do not (docs/BENCHMARKS.md).

Results go to a table, one JSON object (:meth:`AggregationBench.to_json`) and an HDF5 file
(:func:`write_hdf5`, read back by :func:`read_hdf5` and ``analysis/agg_scaling.py``).

HDF5 layout (no pickled objects; every dataset is 1-D with one entry per timed case)::

    /                 attrs: benchmark="aggregation", repeats, warmup, baseline_repeats, seed,
                      machine info (cpu_count, affinity_cpus, cpu_model, torch_version, numpy_version,
                      python_version, platform, device, device_name, torch_threads,
                      loadavg_start, loadavg_end), skipped_names / skipped_reasons (str arrays)
    /<algorithm>/     attrs: form ("default", "gram" or "direct"), tau_applies (bool)
        m, d, tau            int64   (tau = -1 where the rule takes no tau)
        median_s             float64 median seconds of one aggregate() over the repeats
        min_s, max_s, iqr_s  float64 spread: fastest, slowest, interquartile range (p75 - p25,
                                     0 with fewer than 2 repeats)
        bytes                int64   input bytes touched, see :func:`bench_aggregation`
        ratio, max_abs_diff  float64 only in groups that have a baseline (fedfv, fedfv_direct)

FedFV's Gram form is the group ``fedfv``; the direct oracle beside it is ``fedfv_direct``.

FedFV's m x m projection recursion alone, the GEMV loop against the blocked solve on the same
Gram matrix (and split over shard ranks under mpiexec), is :func:`bench_fedfv_recursion`:
``python -m mpifl.bench.aggregation --m 1000,2000 --threads 1`` (``--help``).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from threadpoolctl import threadpool_limits
from tqdm.auto import tqdm

from mpifl.aggregators import BenchInputs, ObservesParams, RoundUpdates, available, rule
from mpifl.aggregators.fedfv_batched import po_coefficients, row_block
from mpifl.core.registry import import_object

COLUMNS = ("algorithm", "form", "m", "d", "tau", "median_s", "min_s", "max_s", "iqr_s", "bytes",
           "ratio", "max_abs_diff")
#: the datasets of every HDF5 group, in order (``ratio``/``max_abs_diff`` only with a baseline)
H5_DATASETS = ("m", "d", "tau", "median_s", "min_s", "max_s", "iqr_s", "bytes")
H5_BASELINE_DATASETS = ("ratio", "max_abs_diff")
BASELINE = "fedfv_direct"     # the HDF5 group / JSON algorithm name of the direct FedFV rows

_RANK = 8          # directions the synthetic updates live in (plus small full-rank noise)
_STATE_WIDTH = "d"            # marker: a stats column as wide as the model


@dataclass(frozen=True)
class Extras:
    """What a rule needs besides updates, losses and sample counts (:func:`extras_for`).

    Attributes:
        params: constructor keyword arguments (besides ``seed``, ``tau``, ``num_clients``).
        stats: ``RoundUpdates.stats`` columns as name -> trailing shape; ``()`` gives (m,),
            ``("d",)`` gives (m, d) (e.g. Ditto's personal-model rows).
        loss_at: give ``RoundUpdates.loss_at`` the synthetic probe of :func:`_loss_probe`.
        all_clients: every client takes part in every round (K = m, ids 0..m-1), as AFL needs.
        baseline: import path of ``function(rule, seed)`` building a reference implementation
            timed beside the rule (FedFV's direct form), or None.
        forms: the rows' ``form`` for the rule and its baseline.
    """

    params: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, tuple] = field(default_factory=dict)
    loss_at: bool = False
    all_clients: bool = False
    baseline: str | None = None
    forms: tuple[str, str] = ("default", "baseline")


def extras_for(cls: type) -> Extras:
    """The inputs rule class ``cls`` asks for: its ``needs.all_clients`` and, for a rule with
    :class:`~mpifl.aggregators.BenchInputs`, its ``bench_inputs()``; the common inputs only
    (plus ``num_clients`` when ``needs.num_clients``) otherwise. A rule that still cannot be
    built or run is reported as skipped with the error, never a crash."""
    spec = cls.bench_inputs() if isinstance(cls, BenchInputs) else None
    all_clients = cls.needs.all_clients
    if spec is None:
        return Extras(all_clients=all_clients)
    return Extras(params=dict(spec.params), stats=dict(spec.stats), loss_at=spec.loss_at,
                  all_clients=all_clients, baseline=spec.baseline, forms=tuple(spec.forms))


@dataclass
class AggregationBench:
    """Result of :func:`bench_aggregation`.

    Attributes:
        rows: one dict per timed case with keys :data:`COLUMNS` (see :func:`bench_aggregation`).
        skipped: rule name -> one-line reason, for rules that could not be built or run.
        machine: :func:`machine_info` at the start, plus ``loadavg_end``.
        settings: repeats, warmup, baseline_repeats, seed.
    """

    rows: list[dict]
    skipped: dict[str, str]
    machine: dict[str, Any]
    settings: dict[str, Any]

    def to_json(self) -> dict:
        """One JSON-serialisable object: benchmark, machine, settings, rows, skipped."""
        return {"benchmark": "aggregation", "machine": self.machine, "settings": self.settings,
                "rows": self.rows, "skipped": self.skipped}


def bench_aggregation(algorithms: Sequence[str] | None, ms: Sequence[int],
                      d: int | Sequence[int], *, tau: int | Sequence[int] = 1, repeats: int = 5,
                      warmup: int = 1, baseline_repeats: int | None = None,
                      device: str = "cpu", seed: int = 0, threads: int | None = None,
                      progress: bool = False) -> AggregationBench:
    """Time each rule's ``aggregate()`` for every (m, d, tau) of the grid.

    Inputs (fixed by ``seed``, m and d): float32 updates ``u_k = z_k B + noise`` with B 8 random
    directions of norm ~1; the first coefficient ~ 1 is shared, the other 7 are standard normal,
    so about 40% of the pairs conflict. Losses are uniform in [1, 2), sample counts in
    [50, 500), lr = 0.01. Rules whose constructor takes ``tau`` get it and first aggregate
    ``tau`` earlier rounds of m other clients, so FedFV's history step works on ``tau * m``
    stored updates; other rules aggregate one earlier round first (their steady state, e.g.
    AFL's and mFairFL's multipliers). Every timed call starts from a copy of that state.
    Round t holds the clients ``t*m .. t*m+m-1`` of K = (rounds fed + 1) * m (``num_clients=K``
    where the rule needs it); AFL's rounds hold all of K = m clients. Extra inputs follow
    :func:`extras_for` (mFairFL: (m, 4) constraint values in [-0.05, 0.05); FedFa: training
    accuracies in [0, 1); Ditto: (m, d) personal-model rows; FedMDFG: :func:`_loss_probe`).

    ``bytes`` = ``4 * d * (m + h + s)``: the float32 d-vectors the call is given or may read,
    each counted once — the m updates, the h = tau * m history rows of a tau rule (0 otherwise)
    and the s = m rows of a (m, d) stats column (Ditto). A lower bound on the memory traffic.

    Args:
        algorithms: registered names (see :func:`mpifl.aggregators.available`); None = all.
        ms: clients per round to try. d: parameter dimension(s). tau: history length(s).
        repeats / warmup: timed / untimed calls per case.
        baseline_repeats: timed calls of the direct FedFV per case (default ``repeats``; it is
            the slow one: seconds per call at m = 200, d = 199,210 on 2 CPU cores).
        device: torch device of the updates, e.g. ``"cuda"`` (synchronised around each call).
        seed: seeds the inputs and the rules. progress: show a tqdm bar on stderr.
        threads: ``torch.set_num_threads`` for the benchmark (None: leave torch's default).

    Returns:
        :class:`AggregationBench`. Its rows have keys :data:`COLUMNS`: ``form`` is ``"gram"``
        for FedFV's registered Gram form and ``"direct"`` for the oracle timed beside it,
        ``"default"`` for other rules; ``median_s``/``min_s``/``max_s`` are seconds over the
        repeats and ``iqr_s`` their interquartile range; ``ratio`` = direct median / this
        median (speed-up over the direct loop, 1.0 on the direct row, None for rules without a
        baseline); ``max_abs_diff`` = max |s_gram - s_direct| (0.0 on the direct row, None
        without baseline); ``tau`` is None for rules without a tau parameter. A rule that
        raises anything while being built or run is not a failure of the benchmark: its
        ``skipped`` entry says where and why (one line), its rows measured before stay, and
        no further case of it is tried.

    Raises:
        ValueError: an unknown algorithm, a non-positive size, repeats < 1, warmup < 0,
            threads < 1, or an unavailable device.
    """
    algorithms = list(available()) if algorithms is None else list(algorithms)
    ds = [int(d)] if isinstance(d, (int, np.integer)) else [int(x) for x in d]
    taus = [int(tau)] if isinstance(tau, (int, np.integer)) else [int(x) for x in tau]
    baseline_repeats = repeats if baseline_repeats is None else baseline_repeats
    if threads is not None and int(threads) < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    dev = _check_args(algorithms, ms, ds, taus, repeats, warmup, baseline_repeats, device)
    with torch_threads(threads):
        return _bench_grid(algorithms, ms, ds, taus, repeats, warmup, baseline_repeats, dev,
                           seed, progress)


def _bench_grid(algorithms, ms, ds, taus, repeats, warmup, baseline_repeats, dev, seed,
                progress) -> AggregationBench:
    machine = machine_info(dev)
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    cases = [(int(m), dd) for m in ms for dd in ds]
    with tqdm(total=len(cases) * len(algorithms), disable=not progress, desc="aggregation",
              unit="case") as bar:
        for m, dd in cases:
            inputs = _Inputs(m, dd, max(max(taus), 1), dev, seed)
            for alg in algorithms:
                bar.set_postfix_str(f"{alg} m={m} d={dd}")
                if alg not in skipped:
                    for t in (taus if _takes(alg, "tau") else [None]):
                        try:
                            rows.extend(_bench_case(alg, inputs, t, repeats, warmup,
                                                    baseline_repeats, dev, seed))
                        except Exception as exc:   # noqa: BLE001 - reported, not fatal
                            # the rows already measured stay; no further case is tried
                            where = f"m={m} d={dd}" + ("" if t is None else f" tau={t}")
                            skipped[alg] = f"{where}: {_one_line(exc)}"
                            break
                bar.update(1)
            del inputs
    machine["loadavg_end"] = _loadavg()
    settings = dict(repeats=repeats, warmup=warmup, baseline_repeats=baseline_repeats, seed=seed)
    return AggregationBench(rows, skipped, machine, settings)


def format_table(rows: Sequence[dict]) -> str:
    """The rows of :func:`bench_aggregation` as a plain, aligned text table."""
    cells = [[_cell(k, row.get(k)) for k in COLUMNS] for row in rows]
    return aligned(COLUMNS, cells, left={"algorithm", "form"})


def aligned(head: Sequence[str], cells: Sequence[Sequence[str]], left: set[str]) -> str:
    """Text cells as columns: a header, a rule, one line per row; the columns named in
    ``left`` flush left, the others right."""
    table = [list(head), *map(list, cells)]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if k in left else c.rjust(w)
                       for k, c, w in zip(head, r, widths)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_report(result: AggregationBench) -> str:
    """The table, then one line per skipped rule and the machine in one line."""
    lines = [format_table(result.rows)]
    for name, why in result.skipped.items():
        lines.append(f"skipped {name}: {why}")
    mi = result.machine
    lines.append(f"machine: {mi['device_name']} ({mi['device']}), {mi['torch_threads']} torch "
                 f"threads, {mi['affinity_cpus']} usable CPUs, torch {mi['torch_version']}, "
                 f"load average {mi['loadavg_start'][0]:.2f} -> {mi['loadavg_end'][0]:.2f}")
    return "\n".join(lines)


def write_hdf5(result: AggregationBench, path: str | Path) -> None:
    """Write ``result`` to ``path`` in the layout of the module docstring (replacing it)."""
    import h5py

    with h5py.File(path, "w") as f:
        write_attrs(f, "aggregation", {**result.settings, **result.machine})
        names = list(result.skipped)
        f.attrs["skipped_names"] = np.array(names, dtype=h5py.string_dtype())
        f.attrs["skipped_reasons"] = np.array([result.skipped[n] for n in names],
                                              dtype=h5py.string_dtype())
        for name, rows in _groups(result.rows).items():
            g = f.create_group(name)
            g.attrs["form"] = rows[0]["form"]
            g.attrs["tau_applies"] = rows[0]["tau"] is not None
            g.create_dataset("m", data=np.array([r["m"] for r in rows], dtype=np.int64))
            g.create_dataset("d", data=np.array([r["d"] for r in rows], dtype=np.int64))
            g.create_dataset("tau", data=np.array([-1 if r["tau"] is None else r["tau"]
                                                   for r in rows], dtype=np.int64))
            for k in ("median_s", "min_s", "max_s", "iqr_s"):
                g.create_dataset(k, data=np.array([r[k] for r in rows], dtype=np.float64))
            g.create_dataset("bytes", data=np.array([r["bytes"] for r in rows], dtype=np.int64))
            if rows[0]["ratio"] is not None:
                for k in H5_BASELINE_DATASETS:
                    g.create_dataset(k, data=np.array([r[k] for r in rows], dtype=np.float64))


def write_attrs(f, benchmark: str, values: dict[str, Any]) -> None:
    """A benchmark file's root attributes: its kind, settings and machine (None left out)."""
    f.attrs["benchmark"] = benchmark
    for k, v in values.items():
        if v is None:
            continue
        f.attrs[k] = (np.asarray(v) if isinstance(v, (list, tuple))
                      else str(v) if isinstance(v, str) else v)   # TorchVersion is a str


def read_hdf5(path: str | Path) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
    """Read a file of :func:`write_hdf5`: ``({group: {dataset: array}}, root attrs)``.

    Raises:
        ValueError: not an HDF5 file, or not an aggregation benchmark (with the reason).
    """
    import h5py

    try:
        f = h5py.File(path, "r")
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read as HDF5 ({_one_line(exc)})") from None
    with f:
        if f.attrs.get("benchmark") != "aggregation":
            raise ValueError(f"{path}: not an aggregation benchmark (root attribute "
                             f"benchmark={f.attrs.get('benchmark')!r})")
        attrs = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in f.attrs.items()}
        groups = {}
        for name, g in f.items():
            missing = [k for k in H5_DATASETS if k not in g]
            if missing:
                raise ValueError(f"{path}: group {name!r} lacks datasets {missing}")
            groups[name] = {k: np.asarray(g[k]) for k in g}
            groups[name]["form"] = str(g.attrs.get("form", "default"))
    return groups, attrs


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Torch's threads and the BLAS threads of numpy (which computes the Gram matrices on the
    CPU, :func:`mpifl.aggregators.gram.gram`) set to n inside the block, restored after
    (None: unchanged).

    Raises:
        ValueError: n < 1.
    """
    if n is None:
        yield
        return
    if int(n) < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    old = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        with threadpool_limits(limits=int(n), user_api="blas"):
            yield
    finally:
        torch.set_num_threads(old)


def machine_info(dev: torch.device | str = "cpu") -> dict[str, Any]:
    """What the figures were measured on: CPUs, versions, the device and threads, and the
    1/5/15-minute load average (other processes sharing the CPUs distort timings)."""
    dev = torch.device(dev)
    cpu_model = _cpu_model()
    name = (torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model)
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:          # not on Linux
        affinity = os.cpu_count() or 0
    return dict(cpu_count=os.cpu_count() or 0, affinity_cpus=affinity, cpu_model=cpu_model,
                torch_version=str(torch.__version__), numpy_version=np.__version__,
                python_version=platform.python_version(), platform=platform.platform(),
                device=str(dev), device_name=name, torch_threads=torch.get_num_threads(),
                loadavg_start=_loadavg())


# ---- internals -------------------------------------------------------------------------------

def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return [float("nan")] * 3


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:300]


def _cell(key: str, v) -> str:
    if v is None:
        return "-"
    if key in ("median_s", "min_s", "max_s", "iqr_s"):
        return f"{v:.4g}"
    if key == "ratio":
        return f"{v:.3g}"
    if key == "max_abs_diff":
        return f"{v:.1e}"
    if key == "bytes":
        return f"{v / 2**20:.1f}MiB"
    return str(v)


def _groups(rows: Sequence[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(BASELINE if r["form"] == "direct" else r["algorithm"], []).append(r)
    return out


def _check_args(algorithms, ms, ds, taus, repeats, warmup, baseline_repeats,
                device) -> torch.device:
    unknown = [a for a in algorithms if a not in available()]
    if not algorithms or unknown:
        raise ValueError(f"algorithms must be registered names, got {list(algorithms)}; "
                         f"known: {', '.join(available())}")
    if not ms or not ds or any(int(m) < 1 for m in ms) or any(x < 1 for x in ds):
        raise ValueError(f"m and d must be >= 1, got m={list(ms)}, d={ds}")
    if not taus or min(taus) < 0 or repeats < 1 or warmup < 0 or baseline_repeats < 0:
        raise ValueError(f"need tau >= 0, repeats >= 1, warmup >= 0, baseline repeats >= 0; "
                         f"got {taus}, {repeats}, {warmup}, {baseline_repeats}")
    return bench_device(device)


def bench_device(device: str) -> torch.device:
    """The torch device a benchmark runs on.

    Raises:
        ValueError: not ``cpu`` or ``cuda[:N]``, or CUDA asked for but absent.
    """
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"bad device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda[:N], got {device!r}")
    return dev


def _takes(alg: str, param: str) -> bool:
    """Whether the rule has hyper-parameter ``param`` (its Params) or takes it as a keyword."""
    cls = rule(alg)
    return param in cls.Params.model_fields or param in inspect.signature(cls).parameters


class _Inputs:
    """The rounds of one (m, d) case, shared by every rule: ``rounds[t]`` for t = 0..h, the last
    one timed; stats columns and ids are attached per rule by :meth:`round`."""

    def __init__(self, m: int, d: int, history: int, dev: torch.device, seed: int) -> None:
        self.m, self.d, self.history, self.dev, self.seed = m, d, history, dev, seed
        key = int(np.random.SeedSequence([seed, m, d]).generate_state(1)[0])
        gen = torch.Generator().manual_seed(key)
        basis = torch.randn(_RANK, d, generator=gen) / math.sqrt(d)
        self.base: list[dict] = []
        for _ in range(history + 1):
            z = torch.randn(m, _RANK, generator=gen)
            z[:, 0] = 1.0 + 0.3 * z[:, 0]                   # the direction clients share
            U = z @ basis + 0.1 * torch.randn(m, d, generator=gen) / math.sqrt(d)
            self.base.append(dict(updates=U.to(dev), losses=1.0 + torch.rand(m, generator=gen),
                                  num_samples=torch.randint(50, 500, (m,), generator=gen)))
        self._gen = gen
        self._state: torch.Tensor | None = None

    def stat(self, name: str, shape: tuple, t: int) -> torch.Tensor:
        """A stats column (m, *shape) for round t (deterministic in the case's seed)."""
        if shape == (_STATE_WIDTH,):
            if self._state is None:         # one (m, d) tensor: rows near the global model
                g = torch.Generator().manual_seed(self.seed + 1)
                self._state = (0.01 * torch.randn(self.m, self.d, generator=g)).to(self.dev)
            return self._state
        g = torch.Generator().manual_seed(self.seed * 1_000 + t)
        if name == "constraints":           # c = gap - eps: small, of both signs
            return (0.1 * torch.rand(self.m, *shape, generator=g) - 0.05).to(self.dev)
        return torch.rand(self.m, *shape, generator=g).to(self.dev)

    def rounds(self, ex: Extras, fed: int) -> tuple[list[RoundUpdates], int]:
        """``fed`` history rounds then the timed one (round index ``fed``), and K."""
        m = self.m
        K = m if ex.all_clients else (fed + 1) * m
        out = []
        for t, base in enumerate(self.base[len(self.base) - fed - 1:]):
            ids = np.arange(m) if ex.all_clients else np.arange(t * m, (t + 1) * m)
            stats = {k: self.stat(k, shape, t) for k, shape in ex.stats.items()}
            r = RoundUpdates(round=t, client_ids=ids, updates=base["updates"],
                             losses=base["losses"].to(self.dev),
                             num_samples=base["num_samples"].to(self.dev), lr=0.01, stats=stats)
            if ex.loss_at:
                r.loss_at = _loss_probe(r)
            out.append(r)
        return out, K


def _loss_probe(r: RoundUpdates) -> Callable[[torch.Tensor], torch.Tensor]:
    """A cheap stand-in for asking the clients their loss at ``w - step``: the quadratic model
    ``l_k - (u_k . s) / lr + ||s||^2 / (2 lr)`` (first order in the update, with curvature
    1/lr, minimal at s = u_k), clamped at 0. One GEMV per call; real probes cost a forward
    pass on every client's data, which this benchmark of the server does not time."""
    U, losses, lr = r.updates, r.losses, r.lr

    def loss_at(step: torch.Tensor) -> torch.Tensor:
        step = step.to(U)
        val = losses - (U @ step) / lr + float(step @ step) / (2 * lr)
        return val.clamp(min=0).to(torch.float32)

    return loss_at


def _bench_case(alg, inputs: _Inputs, tau, repeats, warmup, baseline_repeats, dev,
                seed) -> list[dict]:
    cls = rule(alg)
    ex = extras_for(cls)
    fed = tau if tau is not None else 1
    rounds, K = inputs.rounds(ex, fed)
    params = dict(ex.params, seed=seed)
    if tau is not None:
        params["tau"] = tau
    if cls.needs.num_clients or _takes(alg, "num_clients"):
        params["num_clients"] = K
    agg = cls(**params)
    history, current = rounds[:-1], rounds[-1]
    for r in history:                  # as the server does: aggregate, then show the new model
        agg.aggregate(r)
        if isinstance(agg, ObservesParams):
            agg.observe_params(torch.zeros(inputs.d, device=dev))
    times, step = _time(agg, current, repeats, warmup, dev)
    m, d = inputs.m, inputs.d
    state_rows = sum(m for shape in ex.stats.values() if shape == (_STATE_WIDTH,))
    hist_rows = tau * m if tau is not None else 0
    base = dict(algorithm=alg, m=m, d=d, tau=tau, bytes=4 * d * (m + hist_rows + state_rows))
    if ex.baseline is None or baseline_repeats == 0:  # 0: the direct form is not run
        return [_row(base, ex.forms[0], times, None, None)]
    direct = import_object(ex.baseline)(agg, seed)   # e.g. FedFV's direct form
    for r in history:
        direct.observe(r)      # same history as aggregating those rounds, without the cost
    d_times, d_step = _time(direct, current, baseline_repeats, warmup, dev)
    ratio = statistics.median(d_times) / statistics.median(times)
    diff = float((step - d_step).abs().max())
    return [_row(base, ex.forms[0], times, ratio, diff),
            _row(base, ex.forms[1], d_times, 1.0, 0.0)]


def _time(agg, r: RoundUpdates, repeats: int, warmup: int, dev: torch.device):
    """Seconds of ``repeats`` calls after ``warmup``, each on a fresh copy of ``agg``'s state."""
    times, step = [], None
    for k in range(warmup + repeats):
        fresh = copy.deepcopy(agg)                      # untimed: history is mutated per call
        _sync(dev)
        t0 = time.perf_counter()
        step = fresh.aggregate(r)
        _sync(dev)
        if k >= warmup:
            times.append(time.perf_counter() - t0)
        del fresh
    return times, step


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _iqr(times: list[float]) -> float:
    if len(times) < 2:
        return 0.0
    q = statistics.quantiles(times, n=4, method="inclusive")
    return q[2] - q[0]


def _row(base: dict, form: str, times: list[float], ratio, diff) -> dict:
    row = dict(base, form=form, median_s=statistics.median(times), min_s=min(times),
               max_s=max(times), iqr_s=_iqr(times), ratio=ratio, max_abs_diff=diff)
    return {k: row[k] for k in COLUMNS}



# ---- FedFV's projection recursion alone: the GEMV loop against the blocked solve --------------

RECURSION_COLUMNS = ("m", "conflicts", "density", "shards", "rows", "loop_s", "blocked_s",
                     "blocked_max_s", "ratio", "max_rel_diff")


def fedfv_recursion_inputs(m: int, d: int, conflicts: str, seed: int = 0):
    """The m x m inputs of FedFV's recursion (same on every rank): ``(G, po, kept)``.

    ``conflicts="few"``: the updates of :func:`bench_aggregation` (8 shared directions plus
    noise; 1-2% of the coefficients are non-zero). ``"many"``: independent Gaussian updates
    (about half of them are). ``G`` (m, m) float64 is the rule's Gram matrix of the (m, d)
    float32 updates, ``po`` the loss order, ``kept`` FedFV's default alpha = 0.1.

    Raises:
        ValueError: ``conflicts`` is neither.
    """
    from mpifl.aggregators.fedfv import num_kept, projection_order
    from mpifl.aggregators.gram import gram

    if conflicts == "few":
        base = _Inputs(m, d, 0, torch.device("cpu"), seed).base[0]
        U, losses = base["updates"], base["losses"].numpy()
    elif conflicts == "many":
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, m, d, 1])
                                                .generate_state(1)[0]))
        U, losses = torch.randn(m, d, generator=gen), torch.rand(m, generator=gen).numpy()
    else:
        raise ValueError(f"conflicts must be 'few' or 'many', got {conflicts!r}")
    po = projection_order(np.arange(m), losses, "loss", seed, 0)
    kept = np.zeros(m, dtype=bool)
    kept[po[m - num_kept(m, 0.1):]] = True
    return gram(U), po, kept


def bench_fedfv_recursion(ms: Sequence[int], d: int = 1000,
                          conflicts: Sequence[str] = ("few", "many"), *, repeats: int = 3,
                          seed: int = 0, threads: int | None = None, group=None) -> list[dict]:
    """Time FedFV's m x m projection recursion both ways on the same Gram matrix: the GEMV loop
    (:func:`mpifl.aggregators.fedfv.internal_coefficients`, what every shard ran before) and
    the blocked solve the rule now picks from ``BATCHED_MIN_CLIENTS`` clients
    (:mod:`mpifl.aggregators.fedfv_batched`), both through ``FedFV.coefficient_sums``.

    Args:
        ms: clients per round. d: the synthetic updates' width (the Gram product is not
            timed). conflicts: input kinds of :func:`fedfv_recursion_inputs`.
        repeats: timed calls of each (median). threads: torch and BLAS threads.
        group: a :class:`~mpifl.aggregators.shards.ShardGroup` of P > 1 shards (every rank
            calls this with the same arguments): each shard times the loop on all rows and the
            blocked solve on its block of rows plus the allsum of the column sums.

    Returns:
        One dict per (m, conflicts) with keys :data:`RECURSION_COLUMNS`: ``density`` the
        share of non-zero coefficients, ``rows`` the free rows this rank solved, ``loop_s`` and
        ``blocked_s`` this rank's medians, ``blocked_max_s`` the slowest shard's, ``ratio`` =
        loop_s / blocked_max_s, ``max_rel_diff`` = max |a_blocked - a_loop| / max |a_loop| of
        the coefficient sums.
    """
    from mpifl.aggregators.fedfv import FedFV

    loop, blocked = FedFV(), FedFV()
    loop.batched_from, blocked.batched_from = 2**62, 1
    P = 1 if group is None else group.size
    rows = []
    with torch_threads(threads):
        for m in ms:
            for kind in conflicts:
                G, po, kept = fedfv_recursion_inputs(int(m), d, kind, seed)
                r = RoundUpdates(0, np.arange(m), torch.zeros(m, 1), np.ones(m),
                                 np.ones(m, dtype=np.int64), 0.1, shards=group)
                t_loop, a_loop = _time_call(lambda: loop.coefficient_sums(G, po, kept, r), repeats)
                t_new, a_new = _time_call(lambda: blocked.coefficient_sums(G, po, kept, r),
                                          repeats)
                mine = np.zeros(P)
                mine[0 if group is None else group.index] = t_new
                slowest = float((mine if group is None else group.allsum(mine)).max())
                n_free = m - int(kept.sum())
                lo, hi = (0, n_free) if group is None else row_block(n_free, P, group.index)
                rows.append(dict(
                    m=int(m), conflicts=kind, density=_density(G, po, n_free), shards=P,
                    rows=hi - lo, loop_s=t_loop, blocked_s=t_new, blocked_max_s=slowest,
                    ratio=t_loop / slowest,
                    max_rel_diff=float(np.abs(a_new - a_loop).max() / np.abs(a_loop).max())))
    return rows


def format_recursion(rows: Sequence[dict]) -> str:
    """The rows of :func:`bench_fedfv_recursion` as a text table."""
    fmt = {"density": "{:.3f}", "loop_s": "{:.4g}", "blocked_s": "{:.4g}",
           "blocked_max_s": "{:.4g}", "ratio": "{:.3g}", "max_rel_diff": "{:.1e}"}
    cells = [[fmt.get(k, "{}").format(r[k]) for k in RECURSION_COLUMNS] for r in rows]
    return aligned(RECURSION_COLUMNS, cells, left={"conflicts"})


def _time_call(fn: Callable[[], np.ndarray], repeats: int) -> tuple[float, np.ndarray]:
    """Median seconds of ``repeats`` calls of ``fn`` and its last result."""
    times = []
    for _ in range(max(int(repeats), 1)):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _density(G: np.ndarray, po: np.ndarray, n_free: int) -> float:
    """Share of non-zero coefficients (solved again untimed, by the blocked form)."""
    C = po_coefficients(np.take(np.take(G, po, axis=0), po, axis=1), n_free)
    return float(np.count_nonzero(C) / max(C.size, 1))


def recursion_main(argv: Sequence[str] | None = None) -> int:
    """``python -m mpifl.bench.aggregation [--m 1000,2000] [--conflicts few,many] ...``, or
    under ``mpiexec -n P ... --shards P``: :func:`bench_fedfv_recursion`'s table (or JSON) on
    rank 0, with the machine's load before and after."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m mpifl.bench.aggregation",
                                 description="FedFV's projection recursion: loop vs blocked")
    ints = lambda s: [int(x) for x in s.split(",")]            # noqa: E731
    ap.add_argument("--m", type=ints, default=[1000, 2000])
    ap.add_argument("--d", type=int, default=1000)
    ap.add_argument("--conflicts", type=lambda s: s.split(","), default=["few", "many"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1, help="under mpiexec -n P: P shards")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    group = None
    if args.shards > 1:
        from mpifl.aggregators.shards import ShardGroup
        from mpifl.runtime.comm import world
        from mpifl.runtime.shard_comm import MPIShardCollectives

        comm = world()
        if comm is None or comm.Get_size() != args.shards:
            raise SystemExit(f"--shards {args.shards}: start with mpiexec -n {args.shards}")
        group = ShardGroup(MPIShardCollectives(comm), 1)
    machine = machine_info("cpu")
    rows = bench_fedfv_recursion(args.m, args.d, args.conflicts, repeats=args.repeats,
                                 seed=args.seed, threads=args.threads, group=group)
    machine["loadavg_end"] = _loadavg()
    if group is not None and group.index != 0:
        return 0
    if args.json:
        print(json.dumps({"benchmark": "fedfv-recursion", "machine": machine, "rows": rows}))
    else:
        print(format_recursion(rows))
        print(f"machine: {machine['cpu_model']}, {args.threads or machine['torch_threads']} "
              f"threads, load average {machine['loadavg_start']} -> {machine['loadavg_end']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(recursion_main())
