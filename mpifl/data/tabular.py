"""Tabular fairness datasets: UCI Adult, ProPublica COMPAS and UCI German credit (ALGORITHMS.md §9).

Each reader returns a :class:`TabularPool`: every row of the official files that survives the
documented cleaning, as float32 features (one-hot categoricals, numerical columns still raw),
a binary label and a binary sensitive attribute kept in its own array for fairness metrics and
constraints (ALGORITHMS.md §4, §10). Numerical columns are standardised later by
:func:`standardise_numeric` with statistics of the training pool only (the union of the
clients' local train splits; :func:`mpifl.data.load_federated` does it after partitioning), so
no test sample leaks into the features.

Group ids: **0 = female, 1 = male** in all three datasets.

=========  =====================  ======  ===========================  =========================
dataset    rows kept (of file)    width   label y = 1                  sensitive attribute
=========  =====================  ======  ===========================  =========================
adult      45,222 (of 48,842)     105     income > 50K                 sex
compas     6,172 (of 7,214)       18      two_year_recid (reoffended)  sex
german     1,000 (of 1,000)       63      good credit risk             A9 personal status/sex
=========  =====================  ======  ===========================  =========================

(The widths include the sensitive attribute's one-hot columns; with ``sensitive_feature=False``
they are 103, 16 and 58.)

- **Adult** (Becker & Kohavi, UCI 1996): ``adult.data`` (32,561 rows) then ``adult.test``
  (16,281 rows; its first line is a comment and its labels end with '.'), pooled. Rows with a
  missing value ('?', in workclass, occupation or native-country) are **dropped**, the usual
  practice: 30,162 + 15,060 = 45,222 rows. All 14 attributes are used: 6 numerical (age, fnlwgt,
  education-num, capital-gain, capital-loss, hours-per-week) and 8 categorical one-hot encoded
  with the category lists of ``adult.names`` (99 columns; 'Never-worked' never occurs once '?'
  rows are dropped and stays an all-zero column, so the width does not depend on the rows).
- **COMPAS** (Angwin et al., ProPublica 2016), ``compas-scores-two-years.csv``: ProPublica's own
  cleaning rules are applied (charge within 30 days of the screening,
  ``-30 <= days_b_screening_arrest <= 30``; ``is_recid != -1``; ``c_charge_degree != 'O'``;
  ``score_text != 'N/A'``): 6,172 of 7,214 rows. Features: age, priors_count, juv_fel_count,
  juv_misd_count, juv_other_count (numerical), c_charge_degree (F/M), race (6), sex (2),
  age_cat (3). COMPAS's own scores (decile_score, score_text, v_*) and every field recorded
  after the screening (is_recid, r_*, vr_*, jail and custody dates) are left out: they are the
  tool under audit, or leak the label.
- **German credit** (Hofmann, UCI Statlog): ``german.data``, 1,000 rows, 20 attributes: 7
  numerical (A2, A5, A8, A11, A13, A16, A18) and 13 categorical one-hot encoded with the codes of
  the dataset documentation (56 columns). Sex comes from A9: A92 and A95 are female, A91, A93 and
  A94 male (A95 does not occur: 310 female, 690 male). Label: A21 = 1 (good) -> 1, 2 (bad) -> 0.

**The sensitive attribute as a model input.** By default (``sensitive_feature=True``) its one-hot
columns stay among the features, as in the usual preprocessing of these datasets in the fair-FL
literature that the mFairFL paper (Su et al., AAAI 2024) compares with; the paper does not say
that it removes them. ``sensitive_feature=False`` drops them (for German the whole A9 attribute,
whose every value encodes sex). Proxies remain either way (Adult's relationship = Husband/Wife).

Every file is checked against its SHA-256 (:data:`SHA256`, the values :mod:`mpifl.data.fetch`
also verifies downloads with) before it is parsed. Folders are found like the image datasets'
(:mod:`mpifl.data.roots`): in ``data_root`` or else ``$MPIFL_DATA`` alone when one is set,
else in ``~/.cache/mpifl/data``, ``/usr/share/datasets``; in the subfolders ``adult/``,
``compas/``, ``german/``.
"""

from __future__ import annotations

import csv
import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpifl.data.roots import DatasetLayout, find_folder
from mpifl.core.errors import DataError

TABULAR = ("adult", "compas", "german")

#: dataset -> its folder under a data root and the files the reader needs
LAYOUTS: dict[str, DatasetLayout] = {
    "adult": DatasetLayout("adult", ("adult.data", "adult.test")),
    "compas": DatasetLayout("compas", ("compas-scores-two-years.csv",)),
    "german": DatasetLayout("german", ("german.data",)),
}

#: SHA-256 of the official files as UCI and ProPublica publish them (``mpifl data fetch``).
SHA256: dict[str, dict[str, str]] = {
    "adult": {
        "adult.data": "5b00264637dbfec36bdeaab5676b0b309ff9eb788d63554ca0a249491c86603d",
        "adult.test": "a2a9044bc167a35b2361efbabec64e89d69ce82d9790d2980119aac5fd7e9c05",
        "adult.names": "c248284c0b5de30c9e1958d6cdd168a34a654758b620e68f46aefa83fc0a576a",
    },
    "compas": {
        "compas-scores-two-years.csv":
            "c451db85908b2f7fef1d83203bedf6b71ecda0d5af468d82ae62178f91d0cc7d",
    },
    "german": {
        "german.data": "b21f3d81db8071257d5ff1deaeba1fd4303b62712e6fcc9715c7a86202cb5871",
    },
}

#: where ``mpifl data fetch`` downloads them: UCI's classic file URLs and ProPublica's repository
URLS = {"adult": "https://archive.ics.uci.edu/ml/machine-learning-databases/adult/",
        "compas": "https://raw.githubusercontent.com/propublica/compas-analysis/master/",
        "german": "https://archive.ics.uci.edu/ml/machine-learning-databases/statlog/german/"}

#: rows kept by the readers (see the module docstring)
ROW_COUNTS = {"adult": 45_222, "compas": 6_172, "german": 1_000}

NUM = None  # marks a numerical column in a schema
#: a data set's columns: (name, its categories, or NUM)
Schema = tuple[tuple[str, tuple[str, ...] | None], ...]


@dataclass(frozen=True)
class TabularPool:
    """One tabular dataset, every kept row, before partitioning.

    Attributes:
        name: ``adult``, ``compas`` or ``german``.
        x: (N, F) float32 features; numerical columns raw (standardise them with
            :func:`standardise_numeric`), one-hot columns 0/1.
        y: (N,) int64 binary labels.
        sensitive: (N,) int64 group ids, 0 = female, 1 = male.
        numeric: (F,) bool, True for the numerical columns.
        feature_names: F names, ``"age"`` or ``"workclass=Private"``.
    """

    name: str
    x: np.ndarray
    y: np.ndarray
    sensitive: np.ndarray
    numeric: np.ndarray
    feature_names: tuple[str, ...]


# --------------------------------------------------------------------------- schemas

ADULT_COLUMNS: Schema = (
    ("age", NUM),
    ("workclass", ("Private", "Self-emp-not-inc", "Self-emp-inc", "Federal-gov", "Local-gov",
                   "State-gov", "Without-pay", "Never-worked")),
    ("fnlwgt", NUM),
    ("education", ("Bachelors", "Some-college", "11th", "HS-grad", "Prof-school", "Assoc-acdm",
                   "Assoc-voc", "9th", "7th-8th", "12th", "Masters", "1st-4th", "10th",
                   "Doctorate", "5th-6th", "Preschool")),
    ("education-num", NUM),
    ("marital-status", ("Married-civ-spouse", "Divorced", "Never-married", "Separated",
                        "Widowed", "Married-spouse-absent", "Married-AF-spouse")),
    ("occupation", ("Tech-support", "Craft-repair", "Other-service", "Sales",
                    "Exec-managerial", "Prof-specialty", "Handlers-cleaners",
                    "Machine-op-inspct", "Adm-clerical", "Farming-fishing", "Transport-moving",
                    "Priv-house-serv", "Protective-serv", "Armed-Forces")),
    ("relationship", ("Wife", "Own-child", "Husband", "Not-in-family", "Other-relative",
                      "Unmarried")),
    ("race", ("White", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other", "Black")),
    ("sex", ("Female", "Male")),
    ("capital-gain", NUM),
    ("capital-loss", NUM),
    ("hours-per-week", NUM),
    ("native-country", (
        "United-States", "Cambodia", "England", "Puerto-Rico", "Canada", "Germany",
        "Outlying-US(Guam-USVI-etc)", "India", "Japan", "Greece", "South", "China", "Cuba",
        "Iran", "Honduras", "Philippines", "Italy", "Poland", "Jamaica", "Vietnam", "Mexico",
        "Portugal", "Ireland", "France", "Dominican-Republic", "Laos", "Ecuador", "Taiwan",
        "Haiti", "Columbia", "Hungary", "Guatemala", "Nicaragua", "Scotland", "Thailand",
        "Yugoslavia", "El-Salvador", "Trinadad&Tobago", "Peru", "Hong", "Holand-Netherlands")),
)

COMPAS_COLUMNS: Schema = (
    ("age", NUM),
    ("priors_count", NUM),
    ("juv_fel_count", NUM),
    ("juv_misd_count", NUM),
    ("juv_other_count", NUM),
    ("c_charge_degree", ("F", "M")),
    ("race", ("African-American", "Asian", "Caucasian", "Hispanic", "Native American",
              "Other")),
    ("sex", ("Female", "Male")),
    ("age_cat", ("Less than 25", "25 - 45", "Greater than 45")),
)


def _codes(attr: int, n: int) -> tuple[str, ...]:
    return tuple(f"A{attr}{i}" for i in range(n))


GERMAN_COLUMNS: Schema = (
    ("A1_checking", _codes(1, 5)[1:]),            # A11..A14
    ("A2_duration", NUM),
    ("A3_history", _codes(3, 5)),                 # A30..A34
    ("A4_purpose", _codes(4, 11)),                # A40..A49, A410
    ("A5_amount", NUM),
    ("A6_savings", _codes(6, 6)[1:]),             # A61..A65
    ("A7_employment", _codes(7, 6)[1:]),          # A71..A75
    ("A8_installment_rate", NUM),
    ("A9_status_sex", _codes(9, 6)[1:]),          # A91..A95
    ("A10_debtors", _codes(10, 4)[1:]),           # A101..A103
    ("A11_residence", NUM),
    ("A12_property", _codes(12, 5)[1:]),          # A121..A124
    ("A13_age", NUM),
    ("A14_plans", _codes(14, 4)[1:]),             # A141..A143
    ("A15_housing", _codes(15, 4)[1:]),           # A151..A153
    ("A16_credits", NUM),
    ("A17_job", _codes(17, 5)[1:]),               # A171..A174
    ("A18_liable", NUM),
    ("A19_telephone", _codes(19, 3)[1:]),         # A191..A192
    ("A20_foreign", _codes(20, 3)[1:]),           # A201..A202
)
GERMAN_FEMALE = ("A92", "A95")

#: the column that holds the sensitive attribute in each schema
SENSITIVE_COLUMN = {"adult": "sex", "compas": "sex", "german": "A9_status_sex"}
SCHEMAS = {"adult": ADULT_COLUMNS, "compas": COMPAS_COLUMNS, "german": GERMAN_COLUMNS}


def feature_width(name: str, sensitive_feature: bool = True) -> int:
    """F, the number of feature columns of dataset ``name`` (fixed by its schema, not the rows)."""
    return len(_feature_names(_schema(name, sensitive_feature)))


# --------------------------------------------------------------------------- files

def find_tabular_dir(name: str, data_root: str | os.PathLike[str] | None = None) -> Path:
    """The folder of ``name`` in the data roots (:func:`mpifl.data.roots.find_folder`).

    Raises:
        DataError: unknown name; a named root that does not exist or lacks the files; no
            default root has them (every folder tried is listed).
    """
    if name not in LAYOUTS:
        raise DataError(f"unknown tabular dataset '{name}' (known: {', '.join(TABULAR)})")
    return find_folder(name, LAYOUTS[name], data_root, f"get it with `mpifl data fetch {name}`")


def sha256sum(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_file(name: str, path: Path) -> None:
    """Check ``path`` (a file of dataset ``name``) against :data:`SHA256`.

    Raises:
        DataError: the checksum differs (a damaged file or another version of the data).
    """
    expected = SHA256[name][path.name]
    got = sha256sum(path)
    if got != expected:
        raise DataError(f"{path}: SHA-256 {got} does not match the official file ({expected}); "
                        f"it is damaged or another version: replace it (`mpifl data fetch {name}`)")


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None


# --------------------------------------------------------------------------- readers

def load_tabular(name: str, data_root: str | os.PathLike[str] | None = None, *,
                 sensitive_feature: bool = True) -> TabularPool:
    """Read, verify and encode dataset ``name`` (see the module docstring for the rules).

    Args:
        name: ``adult``, ``compas`` or ``german``.
        data_root: the data root (else ``$MPIFL_DATA``, else the default roots: mpifl.data.roots).
        sensitive_feature: keep the sensitive attribute's one-hot columns among the features.

    Returns:
        :class:`TabularPool` with :data:`ROW_COUNTS` rows and :func:`feature_width` columns.

    Raises:
        DataError: missing files, a checksum mismatch, a malformed row or an unknown category.
    """
    folder = find_tabular_dir(name, data_root)
    for f in LAYOUTS[name].files:
        verify_file(name, folder / f)
    records, y, s = {"adult": _adult_records, "compas": _compas_records,
                     "german": _german_records}[name](folder)
    schema = _schema(name, sensitive_feature)
    x, numeric = _encode(schema, records, name)
    return TabularPool(name, x, np.asarray(y, np.int64), np.asarray(s, np.int64), numeric,
                       _feature_names(schema))


def _adult_records(folder: Path) -> tuple[list[dict[str, str]], list[int], list[int]]:
    """Adult rows without '?', adult.data then adult.test; (records, labels, groups)."""
    names = [c for c, _ in ADULT_COLUMNS]
    records, y, s = [], [], []
    for fname in ("adult.data", "adult.test"):
        path = folder / fname
        for i, line in enumerate(_read_lines(path), start=1):
            if not line.strip() or line.startswith("|"):
                continue                            # blank lines; adult.test's comment line
            fields = [f.strip() for f in line.split(",")]
            if len(fields) != 15:
                raise DataError(f"{path}:{i}: expected 15 fields, got {len(fields)}")
            if "?" in fields:
                continue                            # missing value: the row is dropped
            label = fields[14].rstrip(".")
            if label not in ("<=50K", ">50K"):
                raise DataError(f"{path}:{i}: unknown label {fields[14]!r}")
            rec = dict(zip(names, fields[:14]))
            records.append(rec)
            y.append(int(label == ">50K"))
            s.append(_sex(rec["sex"], path, i))
    return records, y, s


def _compas_records(folder: Path) -> tuple[list[dict[str, str]], list[int], list[int]]:
    """COMPAS rows kept by ProPublica's filter; (records, labels, groups)."""
    path = folder / "compas-scores-two-years.csv"
    wanted = [c for c, _ in COMPAS_COLUMNS]
    filters = ["days_b_screening_arrest", "is_recid", "c_charge_degree", "score_text"]
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    header = rows[0] if rows else []
    missing = [c for c in {*wanted, *filters, "two_year_recid"} if c not in header]
    if missing:
        raise DataError(f"{path}: columns {sorted(missing)} are missing")
    col = {c: header.index(c) for c in {*wanted, *filters, "two_year_recid"}}  # first occurrence
    records, y, s = [], [], []
    for i, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise DataError(f"{path}:{i}: expected {len(header)} fields, got {len(row)}")
        if not _propublica_keeps(row[col["days_b_screening_arrest"]], row[col["is_recid"]],
                                 row[col["c_charge_degree"]], row[col["score_text"]]):
            continue
        rec = {c: row[col[c]] for c in wanted}
        label = row[col["two_year_recid"]]
        if label not in ("0", "1"):
            raise DataError(f"{path}:{i}: two_year_recid must be 0 or 1, got {label!r}")
        records.append(rec)
        y.append(int(label))
        s.append(_sex(rec["sex"], path, i))
    return records, y, s


def _propublica_keeps(days: str, is_recid: str, degree: str, score_text: str) -> bool:
    """ProPublica's row filter (compas-analysis notebook): screening within 30 days of the
    charge, a known recidivism outcome, an ordinary charge degree, a COMPAS score present."""
    try:
        in_window = -30 <= int(days) <= 30
    except ValueError:                              # empty: no arrest date known
        return False
    return in_window and is_recid != "-1" and degree != "O" and score_text != "N/A"


def _german_records(folder: Path) -> tuple[list[dict[str, str]], list[int], list[int]]:
    """All German credit rows; (records, labels 1 = good, groups 0 = female)."""
    path = folder / "german.data"
    names = [c for c, _ in GERMAN_COLUMNS]
    records, y, s = [], [], []
    for i, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 21:
            raise DataError(f"{path}:{i}: expected 21 fields, got {len(fields)}")
        if fields[20] not in ("1", "2"):
            raise DataError(f"{path}:{i}: the label must be 1 (good) or 2 (bad), got "
                            f"{fields[20]!r}")
        rec = dict(zip(names, fields[:20]))
        records.append(rec)
        y.append(int(fields[20] == "1"))
        s.append(0 if rec["A9_status_sex"] in GERMAN_FEMALE else 1)
    return records, y, s


def _sex(value: str, path: Path, line: int) -> int:
    if value not in ("Female", "Male"):
        raise DataError(f"{path}:{line}: sex must be Female or Male, got {value!r}")
    return int(value == "Male")


# --------------------------------------------------------------------------- encoding

def _schema(name: str, sensitive_feature: bool) -> Schema:
    if name not in SCHEMAS:
        raise DataError(f"unknown tabular dataset '{name}' (known: {', '.join(TABULAR)})")
    drop = None if sensitive_feature else SENSITIVE_COLUMN[name]
    return tuple(c for c in SCHEMAS[name] if c[0] != drop)


def _feature_names(schema: Schema) -> tuple[str, ...]:
    return tuple(n for col, cats in schema
                 for n in ([col] if cats is NUM else [f"{col}={c}" for c in cats]))


def _encode(schema: Schema, records: Sequence[dict[str, str]], name: str
            ) -> tuple[np.ndarray, np.ndarray]:
    """(N, F) float32 features and the (F,) numeric mask; categories by position in the schema."""
    blocks, numeric = [], []
    for col, cats in schema:
        values = [r[col] for r in records]
        if cats is NUM:
            blocks.append(_numbers(values, col, name)[:, None])
            numeric.append(True)
            continue
        index = {c: j for j, c in enumerate(cats)}
        codes = np.array([index.get(v, -1) for v in values], dtype=np.int64)
        if (codes < 0).any():
            bad = values[int(np.argmax(codes < 0))]
            raise DataError(f"{name}: unknown {col} category {bad!r} (known: {', '.join(cats)})")
        onehot = np.zeros((len(values), len(cats)), dtype=np.float32)
        onehot[np.arange(len(values)), codes] = 1.0
        blocks.append(onehot)
        numeric.extend([False] * len(cats))
    x = np.concatenate(blocks, axis=1) if blocks else np.zeros((len(records), 0), np.float32)
    return np.ascontiguousarray(x, dtype=np.float32), np.array(numeric, dtype=bool)


def _numbers(values: Iterable[str], col: str, name: str) -> np.ndarray:
    try:
        return np.array([float(v) for v in values], dtype=np.float32)
    except ValueError as exc:
        raise DataError(f"{name}: column {col} is not numeric ({exc})") from None


def standardise_numeric(x: np.ndarray, numeric: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """In place: ``(x - mean) / std`` on the numerical columns, with the mean and population std
    of ``x[rows]`` (the training pool) computed in float64; a constant column is only centred.

    Args:
        x: (N, F) float32 features.
        numeric: (F,) bool, the columns to standardise.
        rows: int64 indices of the training samples (non-empty).
    Returns:
        ``x`` (modified in place).
    Raises:
        ValueError: ``rows`` is empty or the shapes disagree.
    """
    numeric = np.asarray(numeric, dtype=bool)
    if numeric.shape != (x.shape[1],):
        raise ValueError(f"numeric mask {numeric.shape} does not fit x {x.shape}")
    if len(rows) == 0:
        raise ValueError("standardise_numeric needs at least one training row")
    cols = np.flatnonzero(numeric)
    if len(cols):
        train = x[np.asarray(rows)][:, cols].astype(np.float64)
        mean, std = train.mean(axis=0), train.std(axis=0)
        std[std == 0] = 1.0
        x[:, cols] = ((x[:, cols] - mean) / std).astype(np.float32)
    return x
