"""PyTorch's DDP tutorial (ddp-tutorial-series/multigpu_torchrun.py), ported to hvd_lowcomm.

    mpirun -np 2 python examples/porting/ddp_tutorial.py --epochs 4 --save-every 2
    mpirun -np 2 python examples/porting/ddp_tutorial.py --sharded   # FSDP2 (the torch engine)

The tutorial's Trainer, its snapshot and its resume, with the lines marked `# port:` changed;
run it twice and the second run resumes from the snapshot. DistributedSampler,
destroy_process_group() and the rest of torch.distributed keep working: hvd_lowcomm.init()
starts torch.distributed's default process group over the job's ranks on either engine.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hvd_lowcomm


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        make_optimizer: Callable,  # port: built here, after sharding (FSDP2 replaces the parameters)
        save_every: int,
        snapshot_path: str,
        mesh=None,  # port: a mesh from hvd_lowcomm.device_mesh shards the model (FSDP2)
    ) -> None:
        self.model = model
        self.train_data = train_data
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.sharded = mesh is not None
        self.epochs_run = 0
        if self.sharded:
            hvd_lowcomm.shard_model(model, mesh)  # port: in DDP(model)'s place, before the optimizer
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        optimizer = make_optimizer(model.parameters())
        if not self.sharded:  # port: the optimizer is wrapped, not the model
            hvd_lowcomm.broadcast_parameters(model.state_dict(), root_rank=0)
            optimizer = hvd_lowcomm.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        self.optimizer = optimizer

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path, map_location="cpu")
        if self.sharded:  # port: every rank takes its shards of the full state dict
            set_model_state_dict(self.model, snapshot["MODEL_STATE"], options=StateDictOptions(full_state_dict=True))
        else:
            self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch: int) -> None:
        # port: a sharded model's full state dict is gathered on every rank (collective), kept on rank 0
        state = (
            get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if self.sharded
            else self.model.state_dict()
        )
        if hvd_lowcomm.rank() == 0:  # port: the tutorial's `self.gpu_id == 0`
            torch.save({"MODEL_STATE": state, "EPOCHS_RUN": epoch}, self.snapshot_path)
            print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs(seed: int = 0) -> tuple[Dataset, torch.nn.Module, Callable]:
    generator = torch.Generator().manual_seed(seed)
    train_set = TensorDataset(
        torch.randn(256, 20, generator=generator), torch.randint(0, 4, (256,), generator=generator)
    )
    torch.manual_seed(seed)  # the same start on every rank, which FSDP2's shards need (DDP broadcasts it)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    return train_set, model, lambda params: torch.optim.SGD(params, lr=1e-1)


def prepare_dataloader(dataset: Dataset, batch_size: int) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=torch.cuda.is_available(),  # port: the tutorial's True; pinning is for a GPU's copies
        shuffle=False,
        sampler=DistributedSampler(dataset),
    )


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str, sharded: bool) -> None:
    hvd_lowcomm.init(engine="torch" if sharded else "auto")  # port: in ddp_setup()'s place
    dataset, model, make_optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    mesh = hvd_lowcomm.device_mesh() if sharded else None
    trainer = Trainer(model, train_data, make_optimizer, save_every, snapshot_path, mesh)
    trainer.train(total_epochs)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("--epochs", type=int, default=4, help="Total epochs to train the model")
    parser.add_argument("--save-every", type=int, default=2, help="How often to save a snapshot")
    parser.add_argument("--batch-size", default=32, type=int, help="Input batch size on each device")
    parser.add_argument("--snapshot", default="snapshot.pt", help="Where the snapshot is kept")
    parser.add_argument("--sharded", action="store_true", help="FSDP2 in DDP's place (the torch engine)")
    args = parser.parse_args()
    main(args.save_every, args.epochs, args.batch_size, args.snapshot, args.sharded)
