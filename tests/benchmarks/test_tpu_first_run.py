"""benchmarks/tpu_first_run.py runs (the TPU interpreter here) and reports agreement with the jnp twin."""

from __future__ import annotations

import re

import pytest

from paged.benchmarks.tpu_first_run import main


@pytest.mark.tpu_interpreter
def test_interpreted_first_run_agrees_with_the_twin(capsys):
    assert main(["--interpret"]) == 0
    errors = [float(e) for e in re.findall(r"max \|kernel - jnp twin\| = (\S+)", capsys.readouterr().out)]
    assert len(errors) == 2 and all(e < 1.6e-2 for e in errors)  # bf16: a few output ulps


def test_without_a_tpu_it_says_so():
    assert main([]) == 2
