"""The coordinator's decisions: who is alive, which groups take part in each round's attempt,
when a round commits, and who joins after it (hvd_lowcomm.elastic.protocol has the keys). It
keeps no training state: it reads what the groups write to the store it serves and writes its
decisions beside them, so the groups agree on every decision by reading the same key.

A group is gone when its process ended (the launcher says so), when it left (finished), or when
its heartbeat has not moved for the timeout (a stopped node sends no TCP reset: only silence
shows it). A round's attempt is named once every expected group has arrived or is gone; it
commits when every member voted ok, else the next attempt is named among the members still
alive. A group that asks to join is admitted at the next commit, and the donor (the commit's
first member) sends it the state.

At the run's start every group joins. On a restart from checkpoints the groups whose checkpoint
is the newest step resume from their own (every group checkpoints after the same rounds) and the
others heal from the first of them. A preempted run (the launcher got the scheduler's signal)
marks its next commit "stop": every group checkpoints after that same round and ends, so the
restart resumes every group exactly.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvd_lowcomm.elastic import protocol


LIFELINE_CLOSED = "its lifeline closed"  # out of the rounds; its exit code is yet to come


@dataclass
class Life:
    """One launch of a slot, as the coordinator sees it."""

    launched: float
    beats: int = 0
    seen: float | None = None  # when its heartbeat last moved
    ended: str = ""  # why it is gone ("" while it lives)
    lifeline: dict[str, Any] = field(default_factory=dict)  # when and at which round its lifeline closed


@dataclass
class Coordinator:
    """Decisions for `groups` slots; `timeout`: seconds of silence after which a group is out;
    `startup`: seconds a new launch may take to its first heartbeat."""

    store: Any
    groups: int
    timeout: float
    startup: float = 300.0
    clock: Any = time.monotonic
    lives: dict[int, int] = field(default_factory=dict)  # slot -> current life
    state: dict[tuple[int, int], Life] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    round: int = 0  # the round being decided (0: the start)
    attempt: int = 0
    attempt_members: list[int] | None = None
    attempt_lives: dict[int, int] = field(default_factory=dict)  # slot -> the life in the attempt
    expected: list[tuple[int, int]] = field(default_factory=list)  # (slot, life) due at this round
    admitted: set[tuple[int, int]] = field(default_factory=set)
    round_began: float = 0.0
    stopped: str = ""
    preempting: bool = False  # the next commit tells every group to checkpoint and stop
    began: float = field(default_factory=time.monotonic)

    # -- what the launcher tells it -------------------------------------------------------
    def launched(self, slot: int, life: int) -> None:
        self.lives[slot] = life
        self.state[(slot, life)] = Life(self.clock())
        protocol.put(self.store, f"life/{slot}", life)
        self._event("launch", slot=slot, life=life)

    def exited(self, slot: int, life: int, code: int) -> None:
        state = self.state.get((slot, life))
        if state is not None and state.ended == LIFELINE_CLOSED:  # out already: its exit says why
            state.ended = "finished" if code == 0 else f"exited with code {code}"
            if code:
                self.events.append({"event": "failure", **state.lifeline, "why": state.ended, "seen": "lifeline"})
            return
        self._gone(slot, life, "finished" if code == 0 else f"exited with code {code}")

    def lifeline_closed(self, slot: int, life: int) -> None:
        """The lifeline of `slot`'s launch `life` closed: its rank 0 ended. It is out of the rounds
        at once; whether it failed (a failure event) or finished, its exit code says later."""
        state = self.state.get((slot, life))
        if state is None or state.ended:
            return
        if protocol.read(self.store, f"leave/{slot}") == life:
            self._gone(slot, life, "left")
            return
        state.ended = LIFELINE_CLOSED
        state.lifeline = {"at": round(self.clock() - self.began, 3), "slot": slot, "life": life, "round": self.round}

    def preempt(self) -> None:
        """The scheduler is about to end the job: every group checkpoints after the next round and ends."""
        if not self.preempting and not self.stopped:
            self.preempting = True
            self._event("preempt", round=self.round)

    def stop(self, why: str) -> None:
        if not self.stopped:
            self.stopped = why
            protocol.put(self.store, "stop", why)
            self._event("stop", why=why)

    # -- liveness -------------------------------------------------------------------------
    def _gone(self, slot: int, life: int, why: str) -> None:
        state = self.state.get((slot, life))
        if state is not None and not state.ended:
            state.ended = why
            if why != "finished" and why != "left":
                self._event("failure", slot=slot, life=life, why=why, round=self.round)

    def alive(self, slot: int, life: int | None = None) -> bool:
        """Whether `slot`'s launch `life` (its current one by default) lives."""
        current = self.lives.get(slot)
        life = current if life is None else life
        return current is not None and life == current and not self.state[(slot, life)].ended

    def _check_lives(self) -> None:
        now = self.clock()
        for (slot, life), s in self.state.items():
            if s.ended:
                continue
            if protocol.read(self.store, f"leave/{slot}") == life:
                self._gone(slot, life, "left")
                continue
            beats = self.store.add(f"beat/{slot}/{life}", 0)
            if beats != s.beats:
                s.beats, s.seen = beats, now
            silent = now - (s.seen if s.seen is not None else s.launched)
            if silent > (self.timeout if s.seen is not None else self.startup):
                self._gone(slot, life, f"silent for {silent:.1f} s")

    # -- decisions ------------------------------------------------------------------------
    def poll(self) -> None:
        """Look at the store once and make every decision now due."""
        if self.stopped:
            return
        self._check_lives()
        if not self.preempting and any(protocol.read(self.store, f"preempt/{s}") == n for s, n in self.lives.items()):
            self.preempt()  # a group got the scheduler's signal: every group stops after one round
        if self.round == 0:
            self._start()
        elif self.attempt_members is None:
            self._name_attempt()
        else:
            self._judge_attempt()

    def _joined(self) -> list[int]:
        """Slots whose current launch asked to join and is not admitted yet."""
        return [
            s
            for s, life in sorted(self.lives.items())
            if self.alive(s) and (s, life) not in self.admitted and protocol.read(self.store, f"join/{s}") == life
        ]

    def _start(self) -> None:
        """The run starts once every launched group joined (or is gone): the groups resuming
        from the newest checkpoint step start from their own state (none: the lowest slot
        alone), and the others heal from the first of them."""
        joined = self._joined()
        waiting = [s for s in self.lives if self.alive(s) and s not in joined]
        if not joined or waiting:
            return
        steps = {s: protocol.read(self.store, f"resume/{s}/{self.lives[s]}") for s in joined}
        newest = max((step for step in steps.values() if step is not None), default=None)
        members = [s for s in joined if steps[s] == newest] if newest is not None else joined[:1]
        joiners = [s for s in joined if s not in members]
        if newest is not None:
            self._event("resume", step=newest, members=members, joiners=joiners)
        self._commit(0, members, joiners, admit_members=True)

    def _name_attempt(self) -> None:
        expected = [s for s, life in self.expected if self.alive(s, life)]
        if not expected:
            if not self._joined():
                return
            ends = [self.state[(s, life)].ended for s, life in self.expected]
            if LIFELINE_CLOSED in ends:  # whether they finished or failed, their exits will say
                return
            if any(end in ("finished", "left") for end in ends):  # a group reached the end
                self.stop(f"{protocol.FINISHED}: the run trained to its end before a relaunched group could join")
            else:
                self.stop("every training group is gone, and a joining group has no donor to heal from")
            return
        arrived = [s for s in expected if protocol.read(self.store, f"arrive/{self.round}/{s}") == self.lives[s]]
        # (a member's life is its slot's current one: a relaunch makes the old one gone)
        if len(arrived) == len(expected):
            if self.attempt == 0:
                self.round_began = self.clock()
            self.attempt_members = arrived = sorted(arrived)
            self.attempt_lives = {s: self.lives[s] for s in arrived}
            protocol.put(self.store, f"attempt/{self.round}/{self.attempt}", {"members": arrived})

    def _judge_attempt(self) -> None:
        members = self.attempt_members or []
        votes = {s: protocol.read(self.store, f"done/{self.round}/{self.attempt}/{s}") for s in members}
        if any(v is None and self.alive(s, self.attempt_lives[s]) for s, v in votes.items()):
            return
        if all(v == "ok" for v in votes.values()):
            self._commit(self.round, members, self._joined())
            return
        survivors = [s for s in members if self.alive(s, self.attempt_lives[s])]
        self.attempt += 1
        self.attempt_members = survivors
        if survivors:
            protocol.put(self.store, f"attempt/{self.round}/{self.attempt}", {"members": survivors})
        else:
            self.attempt_members = None
            self.expected = []

    def _commit(self, round_: int, members: list[int], joiners: list[int], admit_members: bool = False) -> None:
        stop = self.preempting and round_ > 0
        joiners = [] if stop else joiners  # a group joining a run that ends now waits for the restart
        value = {"attempt": self.attempt, "members": members, "joiners": joiners, "stop": stop}
        protocol.put(self.store, f"commit/{round_}", value)
        for s in joiners + (members if admit_members else []):
            self.admitted.add((s, self.lives[s]))
            protocol.put(self.store, f"admit/{s}/{self.lives[s]}", round_)
        if round_:
            self._event(
                "round",
                round=round_,
                members=members,
                attempts=self.attempt + 1,
                seconds=self.clock() - self.round_began,
            )
        if joiners:
            self._event("admit", round=round_, joiners=joiners, donor=members[0])
        self.expected = [(s, self.lives[s]) for s in members + joiners]
        self.round, self.attempt, self.attempt_members = round_ + 1, 0, None
        if stop:
            self.stop(
                f"{protocol.PREEMPTED}: every group checkpointed after round {round_}; restart with --resume auto"
            )

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.append({"event": kind, "at": round(self.clock() - self.began, 3), **fields})

    def write(self, path: Path) -> None:
        """The run's membership history: every launch, failure, round and admission."""
        path.write_text(json.dumps({"groups": self.groups, "timeout": self.timeout, "events": self.events}, indent=1))
