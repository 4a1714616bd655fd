"""A plain Horovod training script: the starting point the other example changes.

    mpirun -np 2 python examples/plain_horovod.py --steps 20

Nothing here is hvd_lowcomm's except the example data helpers; lowcomm.py is this script
with the optimizer line switched to each low-communication method.
"""

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from common import accuracy, arguments, batches, resnet18

args = arguments(__doc__)
hvd.init()
device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cuda":  # a rank per GPU: the one it sees, or its local rank's
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
torch.manual_seed(0)
model = resnet18(args.width).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

for step, (x, y) in enumerate(batches(args, hvd.rank(), hvd.size())):
    x, y = x.to(device), y.to(device)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    if hvd.rank() == 0 and step % 5 == 0:
        print(f"step {step:>4}  loss {loss.item():.4f}", flush=True)

correct, count = accuracy(model, batches(args, hvd.rank(), hvd.size(), train=False))
correct, count = (int(v) for v in hvd.allreduce(torch.tensor([correct, count]), op=hvd.Sum))
if hvd.rank() == 0:
    print(f"horovod: test accuracy {100 * correct / count:.1f}% on {count} samples")
