"""A user's own DiLoCo loop, started by the elastic launcher in mpi_tests/test_elastic.py:

    python elastic_job.py OUT STEPS SYNC_EVERY SECONDS_PER_STEP

An MLP on its slot's own random data; a joining group skips the steps the run had taken. After
every outer step, and after a heal, rank 0 of the group appends to OUT/slot<S>.jsonl the round,
the members, and a hash of the parameters (the global model, right after a round), and at the
end saves them to OUT/final-slot<S>.pt. The
variable ELASTIC_JOB_SIGNAL "slot/life/step/KILL|STOP" signals this group at that step."""

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

import hvd_lowcomm as hl
from hvd_lowcomm.comm.runtime import exit_process

out, steps, every, pause = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
hl.init(seed=0)
slot, life = int(os.environ["HVD_LOWCOMM_ELASTIC_SLOT"]), int(os.environ["HVD_LOWCOMM_ELASTIC_LIFE"])
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
diloco = hl.DiLoCo(model, opt, sync_every=every, compression=os.environ.get("ELASTIC_JOB_COMPRESSION", "none"))
data = torch.Generator().manual_seed(100 + slot)
x = torch.randn(steps, 16, 8, generator=data)
y = x.sum(-1, keepdim=True).sin()


def record(event: str) -> None:
    if hl.rank() != 0:
        return
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    line = {"event": event, "round": diloco.current_step(), "members": diloco.members(), "hash": digest}
    with open(out / f"slot{slot}.jsonl", "a") as f:
        f.write(json.dumps({**line, "life": life, "pid": os.getpid()}) + "\n")


record("start" if diloco.healed_step == 0 else "healed")
for step in range(diloco.healed_step, steps):
    for name in ("KILL", "STOP"):
        if os.environ.get("ELASTIC_JOB_SIGNAL") == f"{slot}/{life}/{step}/{name}":
            os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
    opt.zero_grad()
    ((model(x[step]) - y[step]) ** 2).mean().backward()
    diloco.step()
    if diloco.synced_now:
        record("round")
    time.sleep(pause)
diloco.close()
if hl.rank() == 0:
    torch.save(model.state_dict(), out / f"final-slot{slot}.pt")
exit_process(0)
