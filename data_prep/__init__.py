"""Convert datasets once into hvd_lowcomm's HDF5 layout (see hvd_lowcomm.data for the layout).

    python -m data_prep digits        --out data/digits.h5
    python -m data_prep mnist5k       --out data/mnist5k.h5
    python -m data_prep cifar10       --root ~/datasets/cifar --out data/cifar10 --shards 8
    python -m data_prep emnist        --root ~/datasets --split letters --out data/letters.h5
    python -m data_prep imagefolder   ~/datasets/flowers --size 64 --out data/flowers.h5
    python -m data_prep synthetic     --out data/synth.h5 --samples 20000 --shape 3,32,32 --classes 10
    python -m data_prep npz arrays.npz --out data/mine.h5
    python -m data_prep verify data/cifar10
"""
from data_prep.sources import BUNDLED
from data_prep.writer import write_dataset

__all__ = ["BUNDLED", "write_dataset"]
