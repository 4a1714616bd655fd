"""Elastic DiLoCo groups (hvd_lowcomm.elastic): three groups, each its own MPI job, started by
the elastic launcher around a user's own DiLoCo loop (mpi_tests/elastic_job.py: H = 5, a small
MLP, a hash of the parameters recorded after every round and heal). A group that fails costs
the round it fails in, never the run, and nothing waits past the timeout.

Runs in the np 1 suite (each test starts its own launcher; under mpirun -np N it would run N
times at once)."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import SIZE, clean_env

pytestmark = pytest.mark.skipif(SIZE != 1, reason="starts its own jobs: the np 1 suite runs it")

JOB = Path(__file__).with_name("elastic_job.py")
TIMEOUT = 5.0  # the launcher's --timeout: seconds of silence before a group is out


def launcher(out: Path, steps: int, extra: list[str], env: dict[str, str] | None = None, ranks: int = 1) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hvd_lowcomm.elastic",
        "--groups",
        "3",
        "--ranks-per-group",
        str(ranks),
        "--timeout",
        str(TIMEOUT),
        "--backoff",
        "0",
        "--launcher-args=--oversubscribe",
        "--record",
        str(out / "record.json"),
        *extra,
        "--",
        sys.executable,
        str(JOB),
        str(out),
        str(steps),
        "5",
        "0.05",
    ]


def environment(**variables: str) -> dict[str, str]:
    env = clean_env()
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **variables})
    return env


def run(out: Path, steps: int, extra: list[str], ranks: int = 1, **variables: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        launcher(out, steps, extra, ranks=ranks),
        env=environment(**variables),
        capture_output=True,
        text=True,
        timeout=240,
    )
    print(done.stdout[-3000:], done.stderr[-3000:])
    return done


def records(out: Path, slot: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"slot{slot}.jsonl").read_text().splitlines()]


def rounds(out: Path, slot: int, life: int | None = None) -> dict[int, dict]:
    """Round -> the record of `slot` (its launch `life` alone, where given) after that round."""
    return {r["round"]: r for r in records(out, slot) if r["event"] == "round" and life in (None, r["life"])}


def assert_survivors_agree(out: Path, slots: list[int], last_round: int) -> None:
    """Every survivor recorded every round up to the last, with bitwise the same parameters."""
    seen = [rounds(out, s) for s in slots]
    for r in range(1, last_round + 1):
        assert all(r in mine for mine in seen), f"round {r} missing on a survivor"
        hashes = {mine[r]["hash"] for mine in seen}
        assert len(hashes) == 1, f"after round {r} the survivors' parameters differ"
        members = {tuple(map(tuple, mine[r]["members"])) for mine in seen}
        assert len(members) == 1, f"round {r}: the survivors disagree on its members"


def members(record: dict) -> list[int]:
    return [slot for (slot,) in record["members"]]


def test_a_killed_group_costs_its_round_and_a_relaunch_heals_bitwise(tmp_path):
    """(a) kill -9 one group in its inner steps: the others finish every round, 3 -> 2 members,
    bitwise equal; (d) its relaunch heals from a member to exactly the member's global copy and
    every group matches after every later round; (e) the same membership replayed in one process
    without the elastic machinery gives the same model."""
    done = run(tmp_path, 200, ["--max-restarts", "1"], ELASTIC_JOB_SIGNAL="1/0/12/KILL")
    assert done.returncode == 0, done.stderr[-2000:]
    assert_survivors_agree(tmp_path, [0, 2], 40)
    by_round = rounds(tmp_path, 0)
    assert members(by_round[2]) == [0, 1, 2] and members(by_round[3]) == [0, 2]  # killed at step 12
    healed = next(r for r in records(tmp_path, 1) if r["event"] == "healed")
    assert healed["life"] == 1 and healed["hash"] == by_round[healed["round"]]["hash"]
    after = rounds(tmp_path, 1, life=1)
    assert sorted(after) == list(range(healed["round"] + 1, 41))
    for r, mine in after.items():
        assert mine["hash"] == by_round[r]["hash"] and members(by_round[r]) == [0, 1, 2]
    history = json.loads((tmp_path / "record.json").read_text())["events"]
    (failure,) = [e for e in history if e["event"] == "failure"]
    # known from the lifeline the kernel closed, not seconds later from its job's exit
    assert failure["slot"] == 1 and failure["seen"] == "lifeline" and failure["round"] == 3, failure
    assert any(e["event"] == "admit" and e["joiners"] == [1] for e in history)
    # (e) the run's membership 3 -> 2 -> 3, replayed without any failure machinery, ends alike
    expected = replayed(tmp_path, 200, 5)
    for slot in range(3):
        final = torch.load(tmp_path / f"final-slot{slot}.pt")
        for name, value in expected.items():
            assert torch.allclose(final[name], value, rtol=1e-5, atol=1e-6), f"group {slot}: {name} differs"


def replayed(out: Path, steps: int, every: int) -> dict[str, torch.Tensor]:
    """The global model of elastic_job.py's run in one process, following the membership its
    groups recorded: each member trains its round's steps on its own data, the round averages
    the members' pseudo-gradients (DiLoCo's plain outer step), and a healed group takes the
    global model and the donor's inner optimiser state."""
    torch.manual_seed(0)  # hl.init(seed=0) in the job
    start = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    models = {s: copy.deepcopy(start) for s in range(3)}
    optimizers = {s: torch.optim.AdamW(models[s].parameters(), lr=1e-2) for s in range(3)}
    data = {}
    for s in range(3):
        x = torch.randn(steps, 16, 8, generator=torch.Generator().manual_seed(100 + s))
        data[s] = (x, x.sum(-1, keepdim=True).sin())
    heals = {r["round"]: r for s in range(3) for r in records(out, s) if r["event"] == "healed"}
    global_model = [p.detach().clone() for p in start.parameters()]
    for number, record in sorted(rounds(out, 0).items()):
        group = members(record)
        for s in group:
            for step in range((number - 1) * every, number * every):
                optimizers[s].zero_grad()
                x, y = data[s]
                ((models[s](x[step]) - y[step]) ** 2).mean().backward()
                optimizers[s].step()
        deltas = [[g - p.detach() for g, p in zip(global_model, models[s].parameters())] for s in group]
        global_model = [g - sum(d[i] for d in deltas) / len(group) for i, g in enumerate(global_model)]
        healed = [r for r in records(out, 1) if r["event"] == "healed" and r["round"] == number]
        for s in group + [1] * bool(healed):
            with torch.no_grad():
                for p, g in zip(models[s].parameters(), global_model):
                    p.copy_(g)
        if healed:
            optimizers[1].load_state_dict(copy.deepcopy(optimizers[group[0]].state_dict()))
    assert heals, "no group healed"
    return dict(zip(models[0].state_dict(), global_model))


def test_a_group_that_dies_inside_an_exchange_is_applied_by_no_one(tmp_path):
    """(b) a group killed after its part of round 3's exchange succeeded, before it voted (the
    others' collectives may have succeeded with its data): no survivor applies that attempt, the
    round is redone among the survivors, and it is the same on each. Two ranks a group, the
    torch engine inside the groups, int2 between them (the owners' error feedback, cut for 3
    members, restarts for 2)."""
    done = run(
        tmp_path,
        30,
        ["--max-restarts", "0"],
        ranks=2,
        HVD_LOWCOMM_ELASTIC_TEST_FAILURE="1/0/3/after",
        HVD_LOWCOMM_ENGINE="torch",
        ELASTIC_JOB_COMPRESSION="int2",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert_survivors_agree(tmp_path, [0, 2], 6)
    assert members(rounds(tmp_path, 0)[3]) == [0, 2]
    history = json.loads((tmp_path / "record.json").read_text())["events"]
    third = next(e for e in history if e["event"] == "round" and e["round"] == 3)
    assert third["attempts"] == 2 and third["members"] == [0, 2]


def test_an_error_in_the_exchange_ends_the_groups_instead_of_retrying_forever(tmp_path):
    """A round whose attempts fail with every group alive is a bug, not a lost group: after two
    such attempts every group ends non-zero with the error."""
    began = time.monotonic()
    done = run(tmp_path, 30, ["--max-restarts", "0"], HVD_LOWCOMM_ELASTIC_TEST_FAILURE="1/0/3/error")
    assert done.returncode != 0
    assert "round 3 failed 2 times with every group alive" in done.stderr, done.stderr[-2000:]
    assert "an error raised by the test hook" in done.stderr
    assert time.monotonic() - began < 90


def test_a_stopped_group_is_out_after_the_timeout(tmp_path):
    """(c) SIGSTOP (a dead node: no TCP reset): the survivors go on once the timeout has passed,
    and the launcher ends the stalled job."""
    began = time.monotonic()
    done = run(tmp_path, 30, ["--max-restarts", "0"], ELASTIC_JOB_SIGNAL="1/0/12/STOP")
    assert done.returncode == 0, done.stderr[-2000:]
    assert_survivors_agree(tmp_path, [0, 2], 6)
    assert members(rounds(tmp_path, 0)[3]) == [0, 2]
    history = json.loads((tmp_path / "record.json").read_text())["events"]
    (failure,) = [e for e in history if e["event"] == "failure"]
    assert failure["slot"] == 1 and failure["why"].startswith("silent")
    assert time.monotonic() - began < 120


def test_the_groups_end_with_a_clear_message_when_the_coordinator_dies(tmp_path):
    """(f) the coordinator killed: every group exits non-zero within the timeout, saying why."""
    log = open(tmp_path / "log", "w")
    process = subprocess.Popen(launcher(tmp_path, 2000, []), env=environment(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if all((tmp_path / f"slot{s}.jsonl").exists() and len(records(tmp_path, s)) >= 3 for s in range(3)):
            break
        time.sleep(0.2)
    pids = [records(tmp_path, s)[0]["pid"] for s in range(3)]
    process.kill()
    killed = time.monotonic()
    while any(_alive(pid) for pid in pids) and time.monotonic() - killed < 3 * TIMEOUT:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), "a group outlived its coordinator by more than the timeout"
    time.sleep(1)
    text = (tmp_path / "log").read_text()
    assert text.count("lost the coordinator") >= 3, text[-2000:]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (an ended child not yet reaped) is gone too
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return False


def test_the_built_in_trainer_refuses_a_per_step_method_before_training(tmp_path):
    """A per-step method under the launcher is refused in every group, not trained apart."""
    command = [sys.executable, "-m", "hvd_lowcomm.elastic", "--groups", "3", "--timeout", str(TIMEOUT)]
    command += ["--max-restarts", "0", "--launcher-args=--oversubscribe", "--", sys.executable, "-m"]
    command += ["hvd_lowcomm.train", "--run.dir", str(tmp_path), "--method", "ddp", "--train.max_steps", "5"]
    refused = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=240)
    assert refused.returncode != 0 and "only diloco trains there" in refused.stderr


def test_a_preempted_run_checkpoints_every_group_after_one_round_and_resumes_exactly(tmp_path):
    """`python -m hvd_lowcomm.train --method diloco` under the launcher, and SIGUSR1 to the
    launcher (a scheduler's warning): every group checkpoints after the same round and exits 0;
    `--resume auto` under a new launcher resumes each group from its own checkpoint, and the run
    ends bitwise where an uninterrupted one does."""
    train = [sys.executable, "-m", "hvd_lowcomm.train", "--run.dir", str(tmp_path), "--method", "diloco"]
    train += ["--train.max_steps", "120", "--diloco.sync_every", "5", "--run.checkpoint_every", "10"]
    train += ["--run.progress", "false"]

    def launch(name: str, *more: str) -> list[str]:
        head = [sys.executable, "-m", "hvd_lowcomm.elastic", "--groups", "3", "--timeout", str(TIMEOUT)]
        head += ["--max-restarts", "0", "--launcher-args=--oversubscribe", "--record", str(tmp_path / f"{name}.json")]
        return [*head, "--", *train, "--run.name", name, *more]

    reference = subprocess.run(launch("ref"), env=environment(), capture_output=True, text=True, timeout=240)
    assert reference.returncode == 0, reference.stderr[-2000:]
    # the built-in trainer across groups: a run directory each, one final model on all
    finals = [torch.load(tmp_path / f"ref-group{s}-life0" / "model.pt") for s in range(3)]
    for other in finals[1:]:
        assert all(torch.equal(finals[0][k], other[k]) for k in finals[0]), "the groups' final models differ"
    assert json.loads((tmp_path / "ref-group0-life0" / "summary.json").read_text())["outer_steps"] == 24
    log = open(tmp_path / "log", "w")
    process = subprocess.Popen(launch("el"), env=environment(), stdout=log, stderr=subprocess.STDOUT)
    first = tmp_path / "el-group0-life0" / "checkpoints" / "step-00000010"
    deadline = time.monotonic() + 120
    while not first.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGUSR1)
    assert process.wait(timeout=120) == 0, (tmp_path / "log").read_text()[-3000:]
    newest = {s: sorted((tmp_path / f"el-group{s}-life0" / "checkpoints").iterdir())[-1].name for s in range(3)}
    assert len(set(newest.values())) == 1, f"the groups stopped at different steps: {newest}"
    step = int(newest[0].split("-")[1])
    assert 10 <= step < 120 and step % 5 == 0
    assert all((tmp_path / f"el-group{s}-life0" / "PREEMPTED").exists() for s in range(3))
    history = json.loads((tmp_path / "el.json").read_text())["events"]
    assert [e["event"] for e in history].count("preempt") == 1 and history[-1]["event"] == "stop"

    resumed = subprocess.run(launch("el", "--resume", "auto"), env=environment(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    (resume,) = [e for e in json.loads((tmp_path / "el.json").read_text())["events"] if e["event"] == "resume"]
    assert resume["step"] == step and resume["members"] == [0, 1, 2] and resume["joiners"] == []
    expected = torch.load(tmp_path / "ref-group0-life0" / "model.pt")
    for s in range(3):
        final = torch.load(tmp_path / f"el-group{s}-life0" / "model.pt")
        assert all(torch.equal(final[k], expected[k]) for k in expected), f"group {s} did not resume exactly"


def test_sharded_groups_heal_shard_by_shard(tmp_path):
    """Two ranks a group with FSDP2 inside (--diloco.shard true, the torch engine): group 1,
    killed at round 2, is relaunched and heals from a member's shards (rank i from rank i: its
    rank 0 takes about half the state), and every group ends with the same model."""
    train = [sys.executable, "-m", "hvd_lowcomm.train", "--run.dir", str(tmp_path), "--run.name", "sh"]
    train += ["--method", "diloco", "--diloco.shard", "true", "--train.max_steps", "250", "--diloco.sync_every", "5"]
    train += ["--train.epochs", "100"]
    train += ["--run.progress", "false"]
    head = [sys.executable, "-m", "hvd_lowcomm.elastic", "--groups", "3", "--ranks-per-group", "2"]
    head += ["--timeout", str(TIMEOUT), "--max-restarts", "1", "--backoff", "0", "--launcher-args=--oversubscribe"]
    env = environment(HVD_LOWCOMM_ENGINE="torch", HVD_LOWCOMM_ELASTIC_TEST_FAILURE="1/0/2/before")
    done = subprocess.run([*head, "--", *train], env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    runs = ["sh-group0-life0", "sh-group1-life1", "sh-group2-life0"]
    finals = [torch.load(tmp_path / run / "model.pt") for run in runs]
    for run, other in zip(runs[1:], finals[1:]):
        assert all(torch.equal(finals[0][k], other[k]) for k in finals[0]), f"{run}'s final model differs"
    summary = json.loads((tmp_path / "sh-group1-life1" / "summary.json").read_text())
    (sent,) = summary["elastic_heal_bytes"]
    whole = 4 * summary["parameters"] * 3  # the global copy and AdamW's two moments, gathered
    assert 0.4 * whole < sent < 0.6 * whole, f"rank 0 took {sent} bytes of {whole}: not its shards"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
