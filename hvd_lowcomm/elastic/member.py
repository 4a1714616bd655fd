"""One group's side of elastic DiLoCo: heartbeats, each round's membership, the exchange redone
until an attempt succeeds for every member, and healing (the state a joining group takes from a
member). Every rank of the group runs it; rank 0 of the group speaks for it in the store, and
the group's ranks agree on every outcome over MPI before rank 0 reports it.

A round (hvd_lowcomm.elastic.protocol has the keys):

1. the group arrives; the coordinator names an attempt's members once every expected group has
   arrived or is gone (dead: exited, or silent for the timeout; or left);
2. rank i of every member joins the attempt's own process group for column i and runs the
   exchange; the group's ranks agree whether all of theirs succeeded, and rank 0 votes;
3. the coordinator commits the attempt when every member voted ok, else names the next attempt
   among those still alive: the survivors restore what the failed attempt changed (error
   feedback) and redo it with their pseudo-gradients as they were. So a round's result is applied
   by all survivors or by none, and no one waits longer than the timeout on a dead peer.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

from hvd_lowcomm.comm.traffic import meter
from hvd_lowcomm.elastic import protocol
from hvd_lowcomm.elastic.peers import peer_group

T = TypeVar("T")
POLL_SECONDS = 0.01
# Failed attempts of a round with no group lost before the groups end (a glitch is retried; a
# bug in the exchange fails every time, and retrying it would never end)
FAILURES_WITHOUT_LOSS = 2


class RunEnded(RuntimeError):
    """The coordinator ended the run, or counted this group out of it."""


class RunFinished(RunEnded):
    """The run trained to its end, or stopped for a restart, before this group could join it:
    nothing is left to do."""


@dataclass(frozen=True)
class Commit:
    """A round's outcome: who took part, and who joins from the next round."""

    round: int
    attempt: int
    members: tuple[int, ...]
    joiners: tuple[int, ...]
    stop: bool = False  # the run is preempted: checkpoint after this round and end

    @property
    def donor(self) -> int:
        return self.members[0]


class Member:
    """This process in an elastic run: `position` is its rank inside its group (its column),
    `comm` the group's MPI communicator (its ranks agree over it)."""

    def __init__(self, launch: protocol.Launch, position: int, comm: Any) -> None:
        self.launch, self.position, self.comm = launch, position, comm
        self.slot, self.life = launch.slot, launch.life
        self.store = self._connect()
        self.round = 0  # the last committed round
        self.events: list[dict[str, Any]] = []  # rounds and heals as this group saw them
        self._beating = position == 0
        self._stop_asked = False
        if self._beating:
            threading.Thread(target=self._beat, name="elastic-heartbeat", daemon=True).start()
        self._lifeline = self._hold_lifeline() if self._beating else None

    def _hold_lifeline(self) -> socket.socket | None:
        """Rank 0's lifeline to the launcher (protocol), open until this process ends."""
        if not self.launch.lifeline:
            return None
        try:
            line = socket.create_connection((self.launch.host, self.launch.lifeline), timeout=self.launch.timeout)
            line.sendall(f"{self.slot} {self.life}\n".encode())
            return line
        except OSError:  # without it a death is still seen, later: by the job's exit or the heartbeats
            return None

    def _connect(self) -> Any:
        try:
            return protocol.connect(self.launch.host, self.launch.port, self.launch.timeout)
        except Exception as exc:  # noqa: BLE001 - say which coordinator was not there
            raise RunEnded(
                f"elastic: cannot reach the coordinator at {self.launch.host}:{self.launch.port} ({exc}); "
                f"start groups with python -m hvd_lowcomm.elastic"
            ) from exc

    def _beat(self) -> None:
        """Tell the coordinator this group lives; if the coordinator is gone, end the group (the
        MPI job), as it can never agree on another round."""
        store = self._connect()
        key = f"beat/{self.slot}/{self.life}"
        while self._beating:
            try:
                store.add(key, 1)
            except Exception as exc:  # noqa: BLE001 - any store failure means the coordinator is gone
                print(
                    f"elastic: group {self.slot} lost the coordinator ({exc}); ending this group. "
                    f"Restart the run with --resume auto to continue from its last checkpoint",
                    file=sys.stderr,
                    flush=True,
                )
                _end_process(3)
            time.sleep(self.launch.timeout / 10)

    # -- store helpers ------------------------------------------------------------------------
    def _put(self, key: str, value: Any) -> None:
        if self.position == 0:
            protocol.put(self.store, key, value)

    def _wait(self, keys: list[str], what: str) -> tuple[str, Any]:
        """The first of `keys` written (checked in order); raises RunEnded when the coordinator
        stops the run or is gone."""
        while True:
            try:
                for key in keys:
                    value = protocol.read(self.store, key)
                    if value is not None:
                        return key, value
                stop = protocol.read(self.store, "stop")
            except Exception as exc:  # noqa: BLE001 - the store's process is the coordinator
                raise RunEnded(f"elastic: group {self.slot} lost the coordinator while waiting for {what}: {exc}")
            if stop is not None:
                ended = RunFinished if stop.startswith((protocol.FINISHED, protocol.PREEMPTED)) else RunEnded
                raise ended(f"elastic: the coordinator ended the run: {stop}")
            time.sleep(POLL_SECONDS)

    def _agree(self, ok: bool) -> bool:
        """Whether every rank of this group succeeded."""
        if self.comm is None or self.comm.Get_size() == 1:
            return ok
        from mpi4py import MPI

        return bool(self.comm.allreduce(int(ok), op=MPI.MIN))

    # -- joining ------------------------------------------------------------------------------
    def join(self, resume_step: int | None = None) -> Commit:
        """Ask for the run's state and wait to be admitted: the commit after which the donor
        sends it. At the run's start every group joins, saying from which checkpoint step it
        would resume (None: it has none); the commit's members start from their own state."""
        self._put(f"resume/{self.slot}/{self.life}", resume_step)
        self._put(f"join/{self.slot}", self.life)
        _, round_ = self._wait([f"admit/{self.slot}/{self.life}"], "admission to the run")
        _, commit = self._wait([f"commit/{round_}"], f"round {round_}'s commit")
        self.round = round_
        return _commit(round_, commit)

    def heal(self, commit: Commit, state: memoryview | None) -> bytes | None:
        """The donor sends `state` to the commit's joiners (rank i of each to rank i); a joiner
        gets it (None elsewhere). A failed heal on the donor's side is the joiner's loss only."""
        donor = self.slot == commit.donor
        if not commit.joiners or not (donor or self.slot in commit.joiners):
            return None
        began = time.perf_counter()
        members = (commit.donor, *commit.joiners)
        try:
            group = peer_group(
                self.store,
                f"heal/{commit.round}/c{self.position}/",
                members.index(self.slot),
                len(members),
                self.launch.timeout,
                label="heal",
            )
            length = torch.tensor([len(state) if donor else 0], dtype=torch.int64)
            group.peers.broadcast_(length, 0, "elastic.heal.length", None)
            payload = (
                torch.frombuffer(state, dtype=torch.uint8) if donor else torch.empty(int(length), dtype=torch.uint8)
            )
            group.peers.broadcast_(payload, 0, "elastic.heal.state", None)
        except Exception as exc:  # noqa: BLE001 - a joiner that died only misses the round
            if not donor:
                raise RunEnded(f"elastic: group {self.slot} could not take the run's state: {exc}") from exc
            print(f"elastic: group {self.slot}: healing {list(commit.joiners)} failed ({exc})", file=sys.stderr)
            return None
        meter.record("broadcast", "elastic.heal", int(length) if donor else 0, group)
        self.events.append(
            {
                "event": "heal",
                "round": commit.round,
                "joiners": list(commit.joiners),
                "bytes": int(length),
                "seconds": time.perf_counter() - began,
            }
        )
        if donor:
            return None
        if self._agree(True):
            self._put(f"healed/{commit.round}/{self.slot}", self.life)
        return bytes(payload.numpy())

    # -- rounds ---------------------------------------------------------------------------------
    def exchange(
        self, attempt: Callable[[Any, int], T], snapshot: Callable[[], Any], restore: Callable[[Any], None]
    ) -> tuple[T, Commit]:
        """The next round: `attempt(column, members)` runs the exchange over a column of the
        attempt's members until one attempt succeeds for every member; `snapshot()`/`restore()`
        undo what a failed attempt changed. Returns its result and the round's commit."""
        r = self.round + 1
        began = time.perf_counter()
        self._put(f"arrive/{r}/{self.slot}", self.life)
        a, previous, unexplained, error = 0, None, 0, ""
        while True:
            _, chosen = self._wait([f"attempt/{r}/{a}"], f"round {r}'s members")
            members = chosen["members"]
            if members == previous:  # the last attempt failed, yet no group was lost
                unexplained += 1
                if unexplained >= FAILURES_WITHOUT_LOSS:
                    raise RuntimeError(
                        f"elastic: round {r} failed {unexplained} times with every group alive: an error in "
                        f"the exchange, not a failure to survive (this group's last: {error or 'none'})"
                    )
            previous, error = members, ""
            if self.slot not in members:
                raise RunEnded(
                    f"elastic: group {self.slot} was counted out of round {r} (silent for over "
                    f"{self.launch.timeout:g} s); it ends here, and a relaunch rejoins the run"
                )
            saved = snapshot()
            try:
                column = peer_group(
                    self.store,
                    f"round/{r}/{a}/c{self.position}/",
                    members.index(self.slot),
                    len(members),
                    self.launch.timeout,
                )
                _test_failure(self, r, "before")
                result, ok = attempt(column, len(members)), True
                _test_failure(self, r, "after")
            except Exception as exc:  # noqa: BLE001 - a peer failed: the coordinator decides what next
                result, ok, error = None, False, str(exc)
                print(f"elastic: group {self.slot}: round {r} attempt {a} failed ({exc})", file=sys.stderr)
            ok = self._agree(ok)
            self._put(f"done/{r}/{a}/{self.slot}", "ok" if ok else "failed")
            key, value = self._wait([f"commit/{r}", f"attempt/{r}/{a + 1}"], f"round {r}'s outcome")
            if key == f"commit/{r}" and value["attempt"] == a:
                self.round = r
                self.events.append(
                    {
                        "event": "round",
                        "round": r,
                        "members": list(members),
                        "attempts": a + 1,
                        "seconds": time.perf_counter() - began,
                    }
                )
                return result, _commit(r, value)
            restore(saved)
            a += 1

    def request_stop(self) -> None:
        """Ask the coordinator to have every group checkpoint after the next round and end."""
        if not self._stop_asked:
            self._put(f"preempt/{self.slot}", self.life)
            self._stop_asked = True

    def leave(self) -> None:
        """This group finished: it is no longer expected at a round."""
        self._put(f"leave/{self.slot}", self.life)
        self._beating = False


# Tests and benchmarks end a group inside a round: "slot/life/round/before" (before its exchange)
# or ".../after" (after its exchange succeeded, before it voted: the others may have succeeded
# too); ".../error" raises in every attempt of that round, as a bug in the exchange would.
# Several, comma-separated.
TEST_FAILURE_VARIABLE = "HVD_LOWCOMM_ELASTIC_TEST_FAILURE"


def _test_failure(member: Member, round_: int, where: str) -> None:
    wanted, here = os.environ.get(TEST_FAILURE_VARIABLE, "").split(","), f"{member.slot}/{member.life}/{round_}"
    if f"{here}/{where}" in wanted:
        os.kill(os.getpid(), signal.SIGKILL)
    if f"{here}/error" in wanted and where == "before":
        raise RuntimeError("an error raised by the test hook")


def _commit(round_: int, value: dict[str, Any]) -> Commit:
    return Commit(round_, value["attempt"], tuple(value["members"]), tuple(value["joiners"]), value["stop"])


def _end_process(code: int) -> None:
    """End this process now (the heartbeat thread cannot raise into the training thread)."""
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def serialize(state: Any) -> memoryview:
    """`state` pickled by torch.save, as a view of the buffer it was written to (no copy: a
    heal's state is the size of several models)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getbuffer()


def deserialize(data: bytes) -> Any:
    """What `serialize` pickled, on the CPU: the donor's device numbering is not the joiner's,
    and the joiner copies every tensor into its own (on its model's device) anyway."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
