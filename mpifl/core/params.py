"""The base of every hyper-parameter table: a frozen, strict pydantic model.

A rule declares its hyper-parameters once, as a nested ``Params`` class; the config's
``[rule]`` table, the constructor's defaults and the range checks all come from it.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["Params", "finite", "params_error"]


class Params(BaseModel):
    """Hyper-parameters: unknown keys, wrong types and out-of-range values are refused.

    Subclasses declare fields with ``pydantic.Field`` bounds and a docstring below each field
    (its ``description``, shown in the generated reference) that says what the value does and
    what its degenerate value means (e.g. ``mu = 0`` is FedAvg).
    """

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, validate_default=True,
                              allow_inf_nan=False, use_attribute_docstrings=True)


def finite(x: float) -> float:
    """Field validator helper: ``x`` unchanged if finite, else ValueError."""
    if not math.isfinite(x):
        raise ValueError("must be finite")
    return x


def params_error(owner: str, exc: ValidationError) -> str:
    """One line for the first error of ``exc``: ``"<owner>: <field> <reason> (got <value>)"``."""
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"{owner}: unknown parameter '{key}'"
    msg = err["msg"][0].lower() + err["msg"][1:]
    return f"{owner}: {key}: {msg} (got {err.get('input')!r})"
