"""The environment of a child process that must run alone: a child of an mpirun'd (or torchrun'd) test rank
would otherwise read the launcher's variables, take itself for a rank and wait for a world that never forms."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "HYDRA_")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "MPI_LOCALRANKID", "MPI_LOCALNRANKS")


def single_process_env(**extra: str) -> dict:
    """os.environ without any launcher's variables, this checkout's commfuse first on PYTHONPATH, then `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES) and k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env
