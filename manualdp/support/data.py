"""Data: a synthetic image set that needs no download, and a Fashion-MNIST reader/downloader."""
from __future__ import annotations

import gzip
import hashlib
import http.client
import math
import os
import urllib.request
import zlib

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from ..validate import non_negative_int, positive_int, positive_number
from .files import atomic_write

__all__ = [
    "DATASETS", "DEFAULT_DATA_DIR", "FASHION_MNIST_FILES", "FASHION_MNIST_MIRRORS", "DownloadError",
    "synthetic_data", "read_idx", "find_fashion_mnist", "load_fashion_mnist", "file_md5",
    "download_fashion_mnist", "load_data",
]

DATASETS = ("synthetic", "fashion-mnist")
DEFAULT_DATA_DIR = os.path.join("~", ".cache", "manualdp", "fashion-mnist")
SYNTHETIC_SIZES = {"train": 10_000, "test": 2_000}  # default sizes per split

# How the synthetic images are made (see `synthetic_data`); tuned so that LeNet with SGD
# at lr 0.2 reaches about 0.9 test accuracy in two epochs, and saturates near 0.95.
SYNTHETIC_NOISE = 0.4    # standard deviation of the pixel noise; shapes are 0/1 before it
SYNTHETIC_MAX_MIX = 0.5  # at most this much of another class's shape is blended in
SYNTHETIC_SHIFT = 2      # samples are shifted by up to this many pixels each way

# The official files and their MD5 checksums (as torchvision lists them), and where to get them.
FASHION_MNIST_FILES = {
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
}
FASHION_MNIST_MIRRORS = (
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
)


class DownloadError(OSError):
    """A file could not be downloaded, or what arrived failed its checksum."""


# ---------------------------------------------------------------- synthetic data

def _smooth(a: np.ndarray, axis: int) -> np.ndarray:
    kernel = np.array([1.0, 2.0, 3.0, 2.0, 1.0]) / 9.0
    return np.apply_along_axis(np.convolve, axis, a, kernel, mode="valid")  # 4 shorter along `axis`


def _prototypes(seed: int) -> np.ndarray:
    """One 0/1 shape per class, (28 + 2 * shift) pixels square so a shifted 28x28 window fits."""
    rng = np.random.default_rng([seed, 0])
    side = 28 + 2 * SYNTHETIC_SHIFT
    # 7x7 random values blown up 4x and smoothed: blobs a few pixels wide, like strokes,
    # so that a shift of a pixel or two leaves a sample close to its class.
    protos = np.kron(rng.standard_normal((10, 7, 7)), np.ones((4, 4)))
    margin = (side + 4 - 28) // 2
    protos = np.pad(protos, ((0, 0), (margin, margin), (margin, margin)), mode="edge")
    protos = _smooth(_smooth(protos, 1), 2)
    protos = (protos - protos.mean(axis=(1, 2), keepdims=True)) / protos.std(axis=(1, 2), keepdims=True)
    return (protos > 0.5).astype(np.float64)  # bright shapes on a dark background, as in Fashion-MNIST


def synthetic_data(num_samples: int, *, seed: int = 0, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """`num_samples` images (Nx1x28x28, float32 in [0, 1]) and int64 labels of 10 learnable classes.

    Each class has a random shape fixed by `seed`. A sample is its class's shape blended
    with up to half of another class's, shifted by up to 2 pixels, plus Gaussian noise.
    The "train" and "test" splits share the shapes and draw different samples.
    Same arguments, bitwise the same data.
    """
    non_negative_int("num_samples", num_samples)
    non_negative_int("seed", seed)
    if split not in SYNTHETIC_SIZES:
        raise ValueError(f"split must be one of {sorted(SYNTHETIC_SIZES)}, got {split!r}")
    protos = _prototypes(seed)  # the same for both splits: they are what defines a class
    rng = np.random.default_rng([seed, 1 if split == "train" else 2])

    labels = rng.integers(0, 10, size=num_samples)
    others = (labels + rng.integers(1, 10, size=num_samples)) % 10  # never the sample's own class
    # A blend near one half makes a sample look as much like the other class as its own: like
    # shirts and T-shirts, some samples are ambiguous, so accuracy saturates below 1.
    mix = rng.uniform(0.0, SYNTHETIC_MAX_MIX, size=(num_samples, 1, 1))
    dy, dx = rng.integers(0, 2 * SYNTHETIC_SHIFT + 1, size=(2, num_samples))
    rows = (dy[:, None] + np.arange(28))[:, :, None]  # each sample's 28x28 window of its prototypes
    cols = (dx[:, None] + np.arange(28))[:, None, :]
    images = (1 - mix) * protos[labels[:, None, None], rows, cols] + mix * protos[others[:, None, None], rows, cols]
    images += SYNTHETIC_NOISE * rng.standard_normal(images.shape)
    images = np.clip(images, 0.0, 1.0).astype(np.float32)
    return torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))


# ---------------------------------------------------------------- IDX files (Fashion-MNIST)

# IDX type codes (third byte of the magic number) -> big-endian numpy dtype
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def _check_path(name: str, path) -> str:
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"{name} must be a non-empty str or os.PathLike, got {path!r}")
    return os.fspath(path)


def read_idx(path) -> torch.Tensor:
    """Read an IDX file (gzipped or plain) into a tensor of its shape and element type."""
    path = _check_path("path", path)
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":  # the gzip magic number: decide by content, not by file name
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise ValueError(f"{path}: corrupt or truncated gzip data ({e})") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES or raw[3] == 0:
        raise ValueError(f"{path}: not an IDX file (magic number {raw[:4].hex() or 'missing'})")
    dtype, ndim = np.dtype(_IDX_DTYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated header: {ndim} dimensions need {header} bytes, file has {len(raw)}")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = header + math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(
            f"{path}: size mismatch: shape {shape} of {dtype.itemsize}-byte elements needs "
            f"{expected} bytes, file has {len(raw)} ({'truncated' if len(raw) < expected else 'trailing data'})"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).astype(dtype.newbyteorder("="))
    return torch.from_numpy(data.reshape(shape))


def find_fashion_mnist(root) -> dict[str, str]:
    """Paths of the four Fashion-MNIST files under `root`, in the original or torchvision's layout."""
    root = os.path.expanduser(_check_path("root", root))
    found = {}
    for name in FASHION_MNIST_FILES:
        stem = name[: -len(".gz")]
        candidates = [os.path.join(d, f) for d in (root, os.path.join(root, "FashionMNIST", "raw"))
                      for f in (name, stem)]
        path = next((c for c in candidates if os.path.isfile(c)), None)
        if path is None:
            raise FileNotFoundError(
                f"Fashion-MNIST file {stem}[.gz] not found under {root!r} (looked in {root} and "
                f"{os.path.join(root, 'FashionMNIST', 'raw')}); download it with download_fashion_mnist(root) "
                f"or copy the four files from {FASHION_MNIST_MIRRORS[0]} there"
            )
        found[name] = path
    return found


def load_fashion_mnist(root) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (train_images, train_labels, test_images, test_labels): Nx1x28x28 floats in [0, 1], int64 labels."""
    paths = find_fashion_mnist(root)
    out = []
    for split in ("train", "t10k"):
        images = read_idx(paths[f"{split}-images-idx3-ubyte.gz"])
        labels = read_idx(paths[f"{split}-labels-idx1-ubyte.gz"])
        if images.dtype != torch.uint8 or images.dim() != 3 or images.shape[1:] != (28, 28):
            raise ValueError(f"{split} images must be uint8 Nx28x28, got {images.dtype} {tuple(images.shape)}")
        if labels.dtype != torch.uint8 or labels.dim() != 1 or len(labels) != len(images):
            raise ValueError(
                f"{split} labels must be {len(images)} uint8 values (one per image), "
                f"got {labels.dtype} {tuple(labels.shape)}"
            )
        if len(labels) and int(labels.max()) > 9:
            raise ValueError(f"{split} labels must be 0..9, found {int(labels.max())}")
        out += [images.unsqueeze(1).float().div_(255), labels.long()]
    return tuple(out)


# ---------------------------------------------------------------- download

def file_md5(path) -> str:
    """Hex MD5 digest of the file at `path`."""
    path = _check_path("path", path)
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_fashion_mnist(root, *, mirrors=FASHION_MNIST_MIRRORS, timeout: float = 10.0) -> str:
    """Download the four Fashion-MNIST files into `root`, verify their MD5, and return `root`.

    A file already there with the right checksum is kept; one with a wrong checksum is replaced.
    Each file is written to a temporary name and renamed only after its checksum matched.
    """
    root = os.path.expanduser(_check_path("root", root))
    if isinstance(mirrors, str) or not mirrors or not all(isinstance(m, str) and m for m in mirrors):
        raise ValueError(f"mirrors must be a non-empty list of URL prefixes, got {mirrors!r}")
    positive_number("timeout", timeout)
    os.makedirs(root, exist_ok=True)
    for name, md5 in FASHION_MNIST_FILES.items():
        path = os.path.join(root, name)
        if os.path.isfile(path) and file_md5(path) == md5:
            continue
        errors = []
        for mirror in mirrors:
            url = mirror.rstrip("/") + "/" + name
            try:
                _fetch(url, path, md5, timeout)
                break
            # URLError, HTTPError and socket timeouts are OSErrors; IncompleteRead is an HTTPException
            except (OSError, http.client.HTTPException, ValueError) as e:
                errors.append(f"{url}: {e}")
        else:
            raise DownloadError(
                f"could not download {name}; tried:\n  " + "\n  ".join(errors)
                + f"\nWithout network access, copy the four Fashion-MNIST .gz files into {root} by hand"
                + " or use the synthetic data set."
            )
    return root


def _fetch(url: str, path: str, md5: str, timeout: float) -> None:
    """Download `url` to `path` if its MD5 is `md5`; otherwise leave `path` untouched."""
    h = hashlib.md5()
    with atomic_write(path) as out, urllib.request.urlopen(url, timeout=timeout) as response:
        for block in iter(lambda: response.read(1 << 20), b""):
            h.update(block)
            out.write(block)
        if h.hexdigest() != md5:  # raised inside the block: `path` is left untouched
            raise ValueError(f"checksum mismatch: MD5 {h.hexdigest()}, expected {md5}")


# ---------------------------------------------------------------- data loaders

def load_data(
    name: str,
    batch_size: int,
    *,
    data_dir=None,
    seed: int = 0,
    num_train: int | None = None,
    num_test: int | None = None,
    download: bool = False,
) -> tuple[DataLoader, DataLoader]:
    """Return (train_iter, test_iter) for data set `name` ("synthetic" or "fashion-mnist").

    The training order is shuffled by a generator seeded from `seed`, so it is reproducible.
    Its last, short batch is dropped: a step on a handful of samples would be as large as a
    full one, and the batch could be smaller than the number of devices.
    `num_train` / `num_test` take the first examples (default: all of Fashion-MNIST, or
    10000 / 2000 synthetic ones); `data_dir` is where Fashion-MNIST lives (or goes, with `download`).
    """
    if name not in DATASETS:
        raise ValueError(f"name must be one of {list(DATASETS)}, got {name!r}")
    positive_int("batch_size", batch_size)
    non_negative_int("seed", seed)
    for arg, value in (("num_train", num_train), ("num_test", num_test)):
        if value is not None:
            positive_int(arg, value)
    if not isinstance(download, bool):
        raise TypeError(f"download must be a bool, got {download!r}")

    if name == "synthetic":
        X_train, y_train = synthetic_data(num_train or SYNTHETIC_SIZES["train"], seed=seed, split="train")
        X_test, y_test = synthetic_data(num_test or SYNTHETIC_SIZES["test"], seed=seed, split="test")
    else:
        root = DEFAULT_DATA_DIR if data_dir is None else _check_path("data_dir", data_dir)
        if download:
            try:
                find_fashion_mnist(root)
            except FileNotFoundError:
                download_fashion_mnist(root)
        X_train, y_train, X_test, y_test = load_fashion_mnist(root)
        for arg, value, available in (("num_train", num_train, len(X_train)), ("num_test", num_test, len(X_test))):
            if value is not None and value > available:
                raise ValueError(f"{arg}={value} but Fashion-MNIST has only {available} examples")
        X_train, y_train = X_train[:num_train], y_train[:num_train]
        X_test, y_test = X_test[:num_test], y_test[:num_test]
    if len(X_train) < batch_size:
        raise ValueError(f"batch_size={batch_size} is larger than the {len(X_train)} training examples")

    generator = torch.Generator().manual_seed(seed)
    train_iter = DataLoader(TensorDataset(X_train, y_train), batch_size, shuffle=True,
                            drop_last=True, generator=generator, num_workers=0)
    test_iter = DataLoader(TensorDataset(X_test, y_test), batch_size, shuffle=False, num_workers=0)
    return train_iter, test_iter
