"""What the coordinator and the groups say to each other: the store's keys and the environment
the launcher gives each group. Every key is written once and never changed, so a group that
reads one sees what every other group sees.

    life/S              the launch count of slot S (0 first, +1 per relaunch)
    beat/S/L            a counter the group of slot S, life L, adds to while it lives
    resume/S/L          the step of the checkpoint slot S's launch L resumes from (null: none)
    join/S              L: slot S's group wants the state to train (at its start)
    admit/S/L           round R: it receives the state from the donor after round R's commit
    arrive/R/S          L: the group reached round R's exchange
    attempt/R/A         {"members": [S...]}: attempt A of round R, among these groups
    done/R/A/S          "ok" or "failed": the group's outcome of that attempt
    commit/R            {"attempt": A, "members": [...], "joiners": [...], "stop": bool}:
                        every member of attempt A succeeded, so every survivor applies its
                        result (and with "stop", checkpoints and ends: the run is preempted)
    healed/R/S          a joiner took the donor's state after round R
    leave/S             L: the group finished its training (not a failure)
    preempt/S           L: the group got a preemption signal: every group stops after a round
    stop                why the coordinator ended the run (FINISHED or PREEMPTED first: it
                        trained to its end, or every group checkpointed for a restart)

Beside the store, rank 0 of each group holds a TCP connection to the launcher (its lifeline,
"S L" sent once): the kernel closes it the moment the process dies, so a killed group is known
to be gone at once instead of when its job's launcher notices (seconds) or its heartbeats stop
(the timeout, which still covers a node that stops without a TCP reset).
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

FINISHED = "finished"  # how "stop" begins when the run ended by training to its end
PREEMPTED = "preempted"  # ... when every group checkpointed for a restart
STORE_VARIABLE = "HVD_LOWCOMM_ELASTIC"  # host:port of the coordinator's store
SLOT_VARIABLE = "HVD_LOWCOMM_ELASTIC_SLOT"
LIFE_VARIABLE = "HVD_LOWCOMM_ELASTIC_LIFE"
GROUPS_VARIABLE = "HVD_LOWCOMM_ELASTIC_GROUPS"
TIMEOUT_VARIABLE = "HVD_LOWCOMM_ELASTIC_TIMEOUT"
LIFELINE_VARIABLE = "HVD_LOWCOMM_ELASTIC_LIFELINE"  # the launcher's lifeline port (0: none)


@dataclass(frozen=True)
class Launch:
    """What the launcher told this process: where the store is, its slot, life, the slots' count
    and the timeout after which a silent peer is out."""

    host: str
    port: int
    slot: int
    life: int
    groups: int
    timeout: float
    lifeline: int = 0

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> "Launch | None":
        env = os.environ if environ is None else environ
        if STORE_VARIABLE not in env:
            return None
        host, _, port = env[STORE_VARIABLE].rpartition(":")
        return cls(
            host,
            int(port),
            int(env[SLOT_VARIABLE]),
            int(env.get(LIFE_VARIABLE, "0")),
            int(env[GROUPS_VARIABLE]),
            float(env.get(TIMEOUT_VARIABLE, "60")),
            int(env.get(LIFELINE_VARIABLE, "0")),
        )

    def environment(self) -> dict[str, str]:
        return {
            STORE_VARIABLE: f"{self.host}:{self.port}",
            SLOT_VARIABLE: str(self.slot),
            LIFE_VARIABLE: str(self.life),
            GROUPS_VARIABLE: str(self.groups),
            TIMEOUT_VARIABLE: str(self.timeout),
            LIFELINE_VARIABLE: str(self.lifeline),
        }


def connect(host: str, port: int, timeout: float) -> Any:
    """A client of the coordinator's store (raises when it is not there within `timeout`)."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))


def put(store: Any, key: str, value: Any) -> None:
    store.set(key, json.dumps(value))


def read(store: Any, key: str) -> Any:
    """The value at `key`, or None where it is not written yet."""
    return json.loads(store.get(key)) if store.check([key]) else None
