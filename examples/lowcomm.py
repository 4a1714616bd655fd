"""plain_horovod.py switched to hvd_lowcomm's methods: the optimizer line changes (AB and SIL
add a few lines), the model, data and loop stay the user's.

    mpirun -np 2 python examples/lowcomm.py --method powersgd --steps 20

Every method reports the bytes this rank sent while training, from hvd_lowcomm's meter.
"""

import torch
import torch.nn.functional as F

import hvd_lowcomm as hl
from common import accuracy, arguments, batches, resnet18

# Every registered method but those with no line a ResNet user could write here.
NOT_HERE = {
    "edad": "recomputes hidden deltas through a chain of linear layers; a ResNet has convolutions",
    "mp": "the built-in trainer's pipeline across ranks (python -m hvd_lowcomm.train --method mp)",
}
METHODS = tuple(name for name in hl.method_names() if name not in NOT_HERE)
args = arguments(__doc__, METHODS)
# MPI + Horovod, instead of hvd.init(); binds a GPU per rank. FSDP2 runs on torch.distributed.
hl.init(engine="torch" if args.method == "fsdp" else "auto")
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)  # every rank builds the same initial model
model = resnet18(args.width).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
rank, size = hl.rank(), hl.size()

# -- the line that picks the method (plain Horovod: hvd.DistributedOptimizer(optimizer, ...)) --
if args.method == "ddp":
    optimizer = hl.DistributedOptimizer(optimizer, model.named_parameters())
elif args.method == "ddp-fp16":
    optimizer = hl.DistributedOptimizer(optimizer, model.named_parameters(), compression="fp16")
elif args.method == "powersgd":
    optimizer = hl.PowerSGDOptimizer(optimizer, model.named_parameters())
elif args.method == "dad":
    optimizer = hl.DadOptimizer(optimizer, model)
elif args.method == "rank-dad":
    optimizer = hl.DadOptimizer(optimizer, model, mode="rank")  # adaptive rank per layer
elif args.method == "ab":  # factorises the model; groups of ranks train A or B
    ab = hl.ABTraining(model, optimizer, total_steps=args.steps)
elif args.method == "diloco":  # groups train alone; an outer step joins them every H steps
    diloco = hl.DiLoCo(model, optimizer, total_steps=args.steps, sync_every=3)
elif args.method == "local":  # no exchange: each rank trains alone (the no-communication floor)
    pass
elif args.method == "fsdp":  # each rank holds a shard of the weights, gradients and moments
    hl.shard_model(model, hl.device_mesh())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # on the shards: build it after
elif args.method == "sil":  # this rank keeps one partition of the Sequential
    # A ResNet has no fully connected layers to cut among, and SIL's default cut stays out of
    # convolutions (docs/methods/sil.rst says why), so the cut is given: after stage 2 of 4.
    sil = hl.SIL(model, input_shape=(3, 32, 32), num_classes=10, cuts=[7])
    optimizer = torch.optim.AdamW(sil.module.parameters(), lr=args.lr)
    rank, size = sil.data_rank, sil.data_replicas  # partners in other partitions read the same samples
else:
    raise SystemExit(f"examples/lowcomm.py has no line for --method {args.method} yet: add its branch")

for step, (x, y) in enumerate(batches(args, rank, size)):
    x, y = x.to(device), y.to(device)
    if args.method == "sil":
        loss = sil.step(optimizer, x, y)  # this partition toward its synthetic labels
    elif args.method == "ab":
        with ab.step(x, y):  # phase switches before, exchange + optimizer step after
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        loss = loss.item()
    elif args.method == "diloco":
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        diloco.step()  # instead of optimizer.step()
        loss = loss.item()
    else:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        loss = loss.item()
    if hl.rank() == 0 and step % 5 == 0:
        print(f"step {step:>4}  loss {loss:.4f}", flush=True)

test = batches(args, rank, size, train=False)
if args.method == "sil":
    correct, count, _ = sil.evaluate(test)  # the joined network; counts on the last partition
elif args.method == "ab":
    correct, count = accuracy(ab.full_model(), test)  # the synced model as a plain network
elif args.method == "diloco":
    correct, count = accuracy(diloco.full_model(), test)  # after an outer step of what is pending
else:
    correct, count = accuracy(model, test)
with hl.meter.in_phase("eval"):  # not training traffic
    correct, count = hl.meter.allreduce_object_sum([correct, count], "example.accuracy")
if hl.rank() == 0:
    print(
        f"{args.method}: test accuracy {100 * correct / max(count, 1):.1f}% on {int(count)} samples; "
        f"sent {hl.meter.total('train') / 2**20:.2f} MiB for training (rank 0)"
    )
