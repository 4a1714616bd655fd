"""Horovod's examples/pytorch/pytorch_synthetic_benchmark.py, ported to hvd_lowcomm.

    mpirun -np 2 python examples/porting/horovod_synthetic.py --num-iters 3
    mpirun -np 2 python examples/porting/horovod_synthetic.py --optimizer powersgd

The port is one line, the import: hvd_lowcomm answers every call this script makes of Horovod
(init, rank, size, local_rank, local_size, Compression, Average, DistributedOptimizer,
broadcast_parameters, broadcast_optimizer_state) on either engine, so it also runs where Horovod
is not installed (HVD_LOWCOMM_ENGINE=torch). --optimizer switches the optimizer line to a
low-communication wrapper. A small conv net stands in for torchvision's models.
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F

import hvd_lowcomm as hvd  # port: was `import horovod.torch as hvd`

WRAPPERS = {"horovod": "DistributedOptimizer", "powersgd": "PowerSGDOptimizer", "dad": "DadOptimizer"}


def conv_net(width: int, classes: int = 10) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, width, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(width, width, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(width, classes),
    )


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace, hvd=hvd) -> torch.optim.Optimizer:
    """The script's optimizer lines; `hvd` is Horovod itself where the unported original runs."""
    lr_scaler = hvd.size() if not args.use_adasum else 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    wrapper = getattr(hvd, WRAPPERS[args.optimizer])
    extra = {"model": model} if args.optimizer == "dad" else {}
    optimizer = wrapper(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        **extra,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    return optimizer


def benchmark_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data, target) -> None:
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()


def log(s: str, nl: bool = True) -> None:
    if hvd.rank() != 0:
        return
    print(s, end="\n" if nl else "", flush=True)


def main(args: argparse.Namespace) -> None:
    hvd.init()
    if torch.cuda.is_available() and not args.no_cuda:
        torch.cuda.set_device(hvd.local_rank())
    device = "cuda" if torch.cuda.is_available() and not args.no_cuda else "cpu"
    model = conv_net(args.width).to(device)
    optimizer = make_optimizer(model, args)
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = (torch.LongTensor(args.batch_size).random_() % 10).to(device)

    log(f"Model: conv_net {args.width}, batch size {args.batch_size}, {hvd.size()} ranks, {args.optimizer}")
    timeit.timeit(lambda: benchmark_step(model, optimizer, data, target), number=args.num_warmup_batches)
    img_secs = []
    for x in range(args.num_iters):
        time = timeit.timeit(lambda: benchmark_step(model, optimizer, data, target), number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log(f"Iter #{x}: {img_sec:.1f} img/sec per rank")
        img_secs.append(img_sec)
    img_sec_mean, img_sec_conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per rank: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark")
    parser.add_argument("--fp16-allreduce", action="store_true", help="use fp16 compression during allreduce")
    parser.add_argument("--use-adasum", action="store_true", help="use adasum algorithm to do reduction")
    parser.add_argument("--optimizer", choices=sorted(WRAPPERS), default="horovod", help="the optimizer wrapper")
    parser.add_argument("--width", type=int, default=16, help="channels of the conv net")
    parser.add_argument("--image-size", type=int, default=32, help="input images' side")
    parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
    parser.add_argument("--num-warmup-batches", type=int, default=2, help="number of warm-up batches")
    parser.add_argument("--num-batches-per-iter", type=int, default=5, help="number of batches per benchmark iteration")
    parser.add_argument("--num-iters", type=int, default=5, help="number of benchmark iterations")
    parser.add_argument("--no-cuda", action="store_true", help="disables CUDA training")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(arguments())
