"""Convert datasets once into hvd_lowcomm's HDF5 layout (see hvd_lowcomm.data for the layout).

    python -m data_prep digits    --out data/digits.h5
    python -m data_prep mnist5k   --out data/mnist5k.h5
    python -m data_prep synthetic --out data/synth.h5 --samples 20000 --features 784 --classes 10
    python -m data_prep npz arrays.npz --out data/mine.h5
    python -m data_prep verify data/digits.h5
"""
from data_prep.sources import BUNDLED, digits, mnist5k, npz, synthetic
from data_prep.writer import write_dataset

__all__ = ["BUNDLED", "digits", "mnist5k", "npz", "synthetic", "write_dataset"]
