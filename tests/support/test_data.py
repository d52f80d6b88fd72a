"""Data: IDX reader, Fashion-MNIST layouts, checksummed download, synthetic set, loaders."""
import gzip
import hashlib
import io
import os
import struct
import urllib.error

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from manualdp.support import data
from manualdp.support.data import (
    DownloadError, download_fashion_mnist, file_md5, load_data, load_fashion_mnist, read_idx, synthetic_data,
)

# The IDX format, written here independently of the reader: big-endian throughout.
TYPE_CODES = {"u1": 0x08, "i1": 0x09, "i2": 0x0B, "i4": 0x0C, "f4": 0x0D, "f8": 0x0E}


def idx_bytes(array: np.ndarray) -> bytes:
    kind = array.dtype.kind + str(array.dtype.itemsize)
    header = struct.pack(">BBBB", 0, 0, TYPE_CODES[kind], array.ndim)
    header += b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write(path, payload: bytes, gz: bool) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(gzip.compress(payload) if gz else payload)
    return str(path)


def fake_fashion(root, layout="original", gz=True, n_train=6, n_test=4, seed=0):
    """Write the four files with random content; return the arrays written."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    arrays["train-images-idx3-ubyte"][0, 0, :2] = [0, 255]  # the extremes must map to 0 and 1
    folder = root if layout == "original" else os.path.join(root, "FashionMNIST", "raw")
    for stem, a in arrays.items():
        write(os.path.join(folder, stem + (".gz" if gz else "")), idx_bytes(a), gz)
    return arrays


shapes = st.lists(st.integers(0, 5), min_size=1, max_size=3)


@settings(deadline=None, max_examples=40)
@given(kind=st.sampled_from(sorted(TYPE_CODES)), shape=shapes, gz=st.booleans(), seed=st.integers(0, 2**16))
def test_read_idx_round_trip(tmp_path_factory, kind, shape, gz, seed):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(kind)
    if dtype.kind == "f":
        a = rng.standard_normal(shape).astype(dtype)
    else:
        info = np.iinfo(dtype)
        a = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    path = write(str(tmp_path_factory.mktemp("idx") / "a.idx"), idx_bytes(a), gz)
    t = read_idx(path)
    assert t.shape == a.shape
    assert t.numpy().dtype == dtype.newbyteorder("=")
    np.testing.assert_array_equal(t.numpy(), a)


def test_read_idx_gzip_detected_by_content_not_name(tmp_path):
    a = np.arange(6, dtype=np.uint8).reshape(2, 3)
    path = write(str(tmp_path / "plain-name"), idx_bytes(a), gz=True)
    np.testing.assert_array_equal(read_idx(path).numpy(), a)


GOOD = idx_bytes(np.arange(12, dtype=np.int16).reshape(3, 4))


@pytest.mark.parametrize("payload,gz,message", [
    (b"", False, "not an IDX file"),
    (b"\x01\x00" + GOOD[2:], False, "not an IDX file"),
    (GOOD[:2] + b"\x07" + GOOD[3:], False, "not an IDX file"),        # unknown type code
    (GOOD[:3] + b"\x00" + GOOD[4:], False, "not an IDX file"),        # zero dimensions
    (GOOD[:9], False, "truncated header"),
    (GOOD[:-1], False, "truncated"),
    (GOOD + b"\x00", False, "trailing data"),
    (GOOD[:-2], True, "truncated"),
])
def test_read_idx_rejects_corrupt_files(tmp_path, payload, gz, message):
    path = write(str(tmp_path / "bad.idx"), payload, gz)
    with pytest.raises(ValueError, match=message) as e:
        read_idx(path)
    assert path in str(e.value)


def test_read_idx_rejects_corrupt_gzip(tmp_path):
    packed = gzip.compress(GOOD)
    flipped = packed[:12] + bytes([packed[12] ^ 0xFF]) + packed[13:]
    for name, payload in (("cut.gz", packed[:-6]), ("flipped.gz", flipped)):
        path = tmp_path / name
        path.write_bytes(payload)
        with pytest.raises(ValueError, match=f"{name}.*gzip|{name}"):
            read_idx(str(path))


def test_read_idx_argument_errors(tmp_path):
    with pytest.raises(TypeError, match="path"):
        read_idx(3)
    with pytest.raises(FileNotFoundError):
        read_idx(str(tmp_path / "missing"))


@pytest.mark.parametrize("layout", ["original", "torchvision"])
@pytest.mark.parametrize("gz", [True, False])
def test_load_fashion_mnist_layouts(tmp_path, layout, gz):
    arrays = fake_fashion(str(tmp_path), layout, gz)
    X_train, y_train, X_test, y_test = load_fashion_mnist(tmp_path)
    assert X_train.shape == (6, 1, 28, 28) and X_test.shape == (4, 1, 28, 28)
    assert X_train.dtype == torch.float32 and y_train.dtype == torch.int64
    expected = torch.from_numpy(arrays["train-images-idx3-ubyte"]).float().unsqueeze(1) / 255
    torch.testing.assert_close(X_train, expected)
    assert X_train[0, 0, 0, 0] == 0 and X_train[0, 0, 0, 1] == 1
    assert y_test.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()


def test_load_fashion_mnist_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte.*FashionMNIST"):
        load_fashion_mnist(tmp_path)
    fake_fashion(str(tmp_path))
    labels = tmp_path / "train-labels-idx1-ubyte.gz"
    write(str(labels), idx_bytes(np.zeros(5, dtype=np.uint8)), gz=True)  # 5 labels for 6 images
    with pytest.raises(ValueError, match="train labels must be 6"):
        load_fashion_mnist(tmp_path)
    write(str(labels), idx_bytes(np.full(6, 10, dtype=np.uint8)), gz=True)
    with pytest.raises(ValueError, match="0..9"):
        load_fashion_mnist(tmp_path)


def test_file_md5(tmp_path):
    payload = os.urandom(3 << 19)  # spans several read blocks
    (tmp_path / "f").write_bytes(payload)
    assert file_md5(tmp_path / "f") == hashlib.md5(payload).hexdigest()


# ---------------------------------------------------------------- download, with a fake network

@pytest.fixture
def fake_server(monkeypatch, tmp_path):
    """Serve gzipped fake Fashion-MNIST files; the checksums table is patched to match them."""
    source = tmp_path / "source"
    arrays = fake_fashion(str(source))
    served = {name: (source / name).read_bytes() for name in data.FASHION_MNIST_FILES}
    for name, payload in served.items():
        monkeypatch.setitem(data.FASHION_MNIST_FILES, name, hashlib.md5(payload).hexdigest())
    requests = []

    def urlopen(url, timeout=None):
        requests.append(url)
        assert timeout is not None and timeout > 0  # never hang on a dead connection
        return io.BytesIO(served[url.rsplit("/", 1)[1]])

    monkeypatch.setattr(data.urllib.request, "urlopen", urlopen)
    return served, requests, arrays


def test_download_writes_verified_files(tmp_path, fake_server):
    served, requests, _ = fake_server
    root = tmp_path / "dl"
    assert download_fashion_mnist(root, mirrors=["http://mirror.invalid/"]) == str(root)
    assert sorted(os.listdir(root)) == sorted(served)  # no temporary files left
    for name, payload in served.items():
        assert (root / name).read_bytes() == payload
    assert len(requests) == 4
    download_fashion_mnist(root, mirrors=["http://mirror.invalid/"])
    assert len(requests) == 4  # files with the right checksum are not fetched again


def test_download_rejects_bad_checksum_and_keeps_old_file(tmp_path, fake_server, monkeypatch):
    name = "train-images-idx3-ubyte.gz"
    monkeypatch.setitem(data.FASHION_MNIST_FILES, name, "0" * 32)
    root = tmp_path / "dl"
    root.mkdir()
    (root / name).write_bytes(b"old")
    with pytest.raises(DownloadError, match="checksum mismatch.*expected 0{32}"):
        download_fashion_mnist(root, mirrors=["http://a.invalid/", "http://b.invalid/"])
    assert (root / name).read_bytes() == b"old"
    assert os.listdir(root) == [name]


def test_download_falls_back_to_next_mirror(tmp_path, fake_server, monkeypatch):
    served, requests, _ = fake_server
    serve = data.urllib.request.urlopen

    def flaky(url, timeout=None):
        if url.startswith("http://down.invalid/"):
            raise urllib.error.URLError("connection refused")
        return serve(url, timeout)

    monkeypatch.setattr(data.urllib.request, "urlopen", flaky)
    download_fashion_mnist(tmp_path / "dl", mirrors=["http://down.invalid/", "http://up.invalid/"])
    assert sorted(os.listdir(tmp_path / "dl")) == sorted(served)


def test_download_offline_error_is_clear(tmp_path, monkeypatch):
    def offline(url, timeout=None):
        raise urllib.error.URLError(OSError(-2, "Name or service not known"))

    monkeypatch.setattr(data.urllib.request, "urlopen", offline)
    with pytest.raises(DownloadError, match=r"could not download train-images.*\n.*Name or service not known") as e:
        download_fashion_mnist(tmp_path / "dl")
    assert data.FASHION_MNIST_MIRRORS[0] in str(e.value) and "network" in str(e.value)
    assert os.listdir(tmp_path / "dl") == []


def test_download_unreachable_host_fails_fast(tmp_path):
    # A closed local port: refused at once, and no packet leaves the machine.
    with pytest.raises(DownloadError, match="127.0.0.1"):
        download_fashion_mnist(tmp_path, mirrors=["http://127.0.0.1:9/"], timeout=0.5)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kwargs,arg", [
    ({"mirrors": []}, "mirrors"), ({"mirrors": "http://x/"}, "mirrors"),
    ({"timeout": 0}, "timeout"), ({"timeout": True}, "timeout"),
])
def test_download_argument_errors(tmp_path, kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        download_fashion_mnist(tmp_path / "never", **kwargs)
    assert not (tmp_path / "never").exists()


def test_load_data_fashion_mnist_downloads_when_asked(tmp_path, fake_server):
    _, requests, arrays = fake_server
    train_iter, test_iter = load_data("fashion-mnist", 2, data_dir=tmp_path / "fm", download=True, num_test=3)
    assert len(requests) == 4
    assert sum(len(y) for _, y in train_iter) == 6 and sum(len(y) for _, y in test_iter) == 3
    assert [y for _, y in test_iter][0].tolist() == arrays["t10k-labels-idx1-ubyte"][:2].tolist()
    with pytest.raises(ValueError, match="num_train=7 but Fashion-MNIST has only 6"):
        load_data("fashion-mnist", 2, data_dir=tmp_path / "fm", num_train=7)


# ---------------------------------------------------------------- synthetic data and loaders

def test_synthetic_is_deterministic_and_well_formed():
    X, y = synthetic_data(300, seed=3)
    X2, y2 = synthetic_data(300, seed=3)
    assert torch.equal(X, X2) and torch.equal(y, y2)
    assert X.shape == (300, 1, 28, 28) and X.dtype == torch.float32 and y.dtype == torch.int64
    assert X.min() >= 0 and X.max() <= 1 and set(y.tolist()) == set(range(10))
    assert not torch.equal(X, synthetic_data(300, seed=4)[0])
    assert not torch.equal(X, synthetic_data(300, seed=3, split="test")[0])


def test_synthetic_classes_are_shared_between_splits():
    # nearest class mean, fitted on train and scored on test, is far above chance (0.1)
    X, y = synthetic_data(2000, seed=1)
    Xt, yt = synthetic_data(500, seed=1, split="test")
    means = torch.stack([X[y == c].flatten(1).mean(0) for c in range(10)])
    predicted = torch.cdist(Xt.flatten(1), means).argmin(1)
    assert (predicted == yt).float().mean() > 0.5


@pytest.mark.parametrize("kwargs,error,arg", [
    ({"num_samples": -1}, ValueError, "num_samples"), ({"num_samples": 2.0}, ValueError, "num_samples"),
    ({"num_samples": 2, "seed": -1}, ValueError, "seed"), ({"num_samples": 2, "split": "val"}, ValueError, "split"),
])
def test_synthetic_argument_errors(kwargs, error, arg):
    with pytest.raises(error, match=arg):
        synthetic_data(**kwargs)


def test_load_data_synthetic_is_reproducible():
    def batches(seed):
        train_iter, test_iter = load_data("synthetic", 64, seed=seed, num_train=300, num_test=70)
        return [b for epoch in range(2) for b in train_iter], list(test_iter)

    train_a, test_a = batches(5)
    train_b, _ = batches(5)
    assert all(torch.equal(Xa, Xb) and torch.equal(ya, yb) for (Xa, ya), (Xb, yb) in zip(train_a, train_b))
    assert [len(y) for _, y in train_a] == [64] * 8  # 300 // 64 full batches per epoch, the rest dropped
    assert [len(y) for _, y in test_a] == [64, 6]  # the test set is read whole, in order
    assert not torch.equal(train_a[0][1], train_a[4][1])  # each epoch is shuffled anew
    assert not torch.equal(train_a[0][1], batches(6)[0][0][1])


@pytest.mark.parametrize("args,kwargs,error,arg", [
    (("mnist", 8), {}, ValueError, "name"),
    (("synthetic", 0), {}, ValueError, "batch_size"),
    (("synthetic", 8), {"seed": -2}, ValueError, "seed"),
    (("synthetic", 8), {"num_train": 0}, ValueError, "num_train"),
    (("synthetic", 8), {"num_test": 1.5}, ValueError, "num_test"),
    (("synthetic", 8), {"download": "yes"}, TypeError, "download"),
    (("synthetic", 64), {"num_train": 10}, ValueError, "batch_size=64"),
    (("fashion-mnist", 8), {"data_dir": 5}, TypeError, "data_dir"),
])
def test_load_data_argument_errors(args, kwargs, error, arg):
    with pytest.raises(error, match=arg):
        load_data(*args, **kwargs)
