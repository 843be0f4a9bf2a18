"""An llmsim process for a test in either backend mode (``loadlab.simulator`` starts it).

Gateway tests can run against both backends the gateway meets:

* ``exact``: ``fast.yaml``, output made of whole o200k tokens (usage == our count);
* ``compat``: ``llm-d-v0.10.2.yaml``, llm-d-inference-sim v0.10.2 on the wire (its dummy
  tokenizer: usage a few % below our o200k count; ``usage: null`` chunks, errors inside
  200 streams, ``n > 1``, tool calls).

    simulator = simulator_fixture("--inter-token-latency", "2ms")  # module-scoped, both modes

    def test_x(simulator: ModeSimulator) -> None:
        if simulator.mode == "compat": ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from loadlab.simulator import Simulator

Mode = Literal["exact", "compat"]
Scope = Literal["session", "package", "module", "class", "function"]
MODES: tuple[Mode, ...] = ("exact", "compat")
MODE_PROFILES: dict[Mode, str] = {"exact": "fast.yaml", "compat": "llm-d-v0.10.2.yaml"}


class ModeSimulator(Simulator):
    """A simulator started from the profile of a backend mode."""

    def __init__(self, mode: Mode, *extra_args: str, **kw: Any) -> None:
        super().__init__(MODE_PROFILES[mode], *extra_args, **kw)
        self.mode: Mode = mode


@contextmanager
def simulator_in_mode(
    mode: Mode, *extra_args: str, log_dir: Path | None = None
) -> Iterator[ModeSimulator]:
    sim = ModeSimulator(mode, *extra_args, log_dir=log_dir)
    try:
        yield sim
    finally:
        sim.stop()


@dataclass(frozen=True)
class ModeTenants:
    """Tenant names of a module whose tests run once per mode against one Redis: the
    module's short names, made the mode's own (``exact-cut``, ``compat-cut``)."""

    mode: Mode

    def name(self, short: str) -> str:
        return f"{self.mode}-{short}"

    def names(self, plans: dict[str, Any]) -> dict[str, Any]:
        return {self.name(short): plan for short, plan in plans.items()}


def max_event_tokens(mode: Mode) -> int:
    """The most o200k tokens one content event of the mode's random answers adds to the
    text: one whole token in exact mode; in compat mode one of v0.10.2's pieces (a word or a
    mark with the whitespace after it), counted alone, plus one for a merge with the text
    before. A budget cut-off stops before the first event that does not fit, so it falls
    short of the budget by less than this."""
    if mode == "exact":
        return 1
    from extproc.tokens.encodings import load_tokenizer
    from llmsim.llmd.answers import STOCK_TOKENS

    o200k = load_tokenizer("o200k_base")
    return 1 + max(len(o200k.encode(piece)) for pieces in STOCK_TOKENS for piece in pieces)


def simulator_fixture(
    *extra_args: str, modes: tuple[Mode, ...] = MODES, scope: Scope = "module"
) -> Callable[..., Iterator[ModeSimulator]]:
    """A fixture parametrised over ``modes``: one simulator per mode, ``extra_args`` added."""

    @pytest.fixture(scope=scope, params=modes)
    def simulator(
        request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[ModeSimulator]:
        mode: Mode = request.param
        log_dir = tmp_path_factory.mktemp(f"sim-{mode}")
        with simulator_in_mode(mode, *extra_args, log_dir=log_dir) as sim:
            yield sim

    return simulator


__all__ = [
    "MODES",
    "MODE_PROFILES",
    "Mode",
    "ModeSimulator",
    "ModeTenants",
    "max_event_tokens",
    "simulator_fixture",
    "simulator_in_mode",
]
