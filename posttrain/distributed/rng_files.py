"""The random number generators' state in a checkpoint: one file per process, written and read by Accelerate.

Accelerate's `load_state` skips an RNG file it cannot read with a log line at INFO level, so a resume would go on
without restoring the generators (dropout, sampling) and silently stop being exact. `rng_problem` reads each file
the way Accelerate will, before anything is loaded, so the run can say so instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from accelerate.utils import load
from accelerate.utils.constants import RNG_STATE_NAME


def rng_problem(root: Path, world_size: int) -> Optional[str]:
    """None when random_states_<rank>.pkl of every process that saved the checkpoint reads back as Accelerate's RNG
    state; else what is wrong with the first that does not."""
    for rank in range(world_size):
        path = root / f"{RNG_STATE_NAME}_{rank}.pkl"
        if not path.is_file():
            return f"{path.name} is missing"
        try:
            states = load(path, map_location="cpu")  # weights_only, as Accelerate loads it
        except Exception as e:  # noqa: BLE001 - any failure here is a failure of load_state later
            return f"{path.name} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        if not isinstance(states, dict) or not {"random_state", "torch_manual_seed"} <= states.keys():
            return f"{path.name} holds no RNG state"
    return None
