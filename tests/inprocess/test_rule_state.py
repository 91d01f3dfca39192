"""The rule state check (:mod:`mpifl.bench.statecheck`): every rule resumes exactly from its
state_dict(), and a rule that keeps state without declaring it is named in one line — in a test and
on the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mpifl.aggregators import available
from mpifl.bench.statecheck import check_rule_state

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugin"

FORGETFUL = '''
from mpifl_example.rules import CenteredClip
from mpifl.plugin import register_rule


@register_rule("forgetful_clip")
class ForgetfulClip(CenteredClip):
    """Centered clipping whose author forgot to checkpoint the centre."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass
'''


@pytest.mark.parametrize("name", available())
def test_every_built_in_rule_resumes_exactly_from_its_state(name):
    res = check_rule_state(name)
    assert res.ok, res.line()
    assert res.step_diff == 0.0 and res.error is None


def _check(tmp_path, *args):
    (tmp_path / "forgetful.py").write_text(FORGETFUL)
    env = {"PYTHONPATH": f"{EXAMPLE}:{tmp_path}", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "mpifl", "check", *args], capture_output=True,
                          text=True, cwd=tmp_path, env=env)


def test_a_rule_that_forgets_its_state_is_named_in_one_line(tmp_path):
    proc = _check(tmp_path, "forgetful_clip,centered_clip", "--plugins", "forgetful",
                  "--set", "tau=0.05")
    assert proc.returncode == 1, proc.stderr
    forgetful, stateful = proc.stdout.splitlines()
    assert forgetful.startswith("forgetful_clip: keeps 'center' between rounds without "
                                "declaring it in state_dict()")
    assert stateful.startswith("centered_clip: resumes exactly from state_dict() "
                               "(state: center;")


@pytest.mark.slow
def test_check_cli_refuses_unknown_rules_and_bad_settings(tmp_path):
    proc = _check(tmp_path, "no_such_rule")
    assert proc.returncode == 2 and "check: " in proc.stderr and "Traceback" not in proc.stderr
    ok = _check(tmp_path, "fedfv", "--set", "alpha=0.2", "--set", "tau=2")
    assert ok.returncode == 0 and ok.stdout.startswith("fedfv: resumes exactly")
    bad = _check(tmp_path, "fedfv", "--set", "alpha=7")
    assert bad.returncode == 2 and "check: fedfv" in bad.stderr and "alpha" in bad.stderr
