"""`evtrain.datasets`: token files written and read back as windows, opened lazily per
process, never mapped; the streaming LM example's data built from them."""

from __future__ import annotations

import importlib.util
import os
import pickle
import tempfile
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from evtrain.datasets import TokenFile, token_dtype, write_tokens
from evtrain.spec import load_job
from evtrain.stages.job_data import job_data

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _open_paths() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return out


def test_samples_are_windows_that_tile_the_file(tmp_path: Path) -> None:
    path = tmp_path / "train.bin"
    assert write_tokens(path, range(1000)) == 1000
    assert path.stat().st_size == 2000  # uint16 by default, as nanoGPT writes them
    data = TokenFile(path, 10)
    # 999 targets fill 99 windows of 10; the last token of one window starts the next.
    assert len(data) == 99 and data.num_tokens == 1000
    first, last = data[0], data[98]
    assert first["input_ids"].tolist() == list(range(10))
    assert first["labels"].tolist() == list(range(1, 11))
    assert last["input_ids"].tolist() == list(range(980, 990))
    assert last["labels"].tolist() == list(range(981, 991))
    assert first["input_ids"].dtype == first["labels"].dtype == torch.int64
    assert torch.equal(data[-1]["labels"], last["labels"])
    assert torch.equal(data[np.int64(3)]["input_ids"], torch.arange(30, 40))
    with pytest.raises(IndexError, match="sample 99 out of range for 99 samples"):
        data[99]
    # Deterministic per index: a second read, or another instance, gives the same.
    assert torch.equal(TokenFile(path, 10)[42]["input_ids"], data[42]["input_ids"])


@pytest.mark.parametrize(
    ("dtype", "ids"),
    [
        (np.uint16, [0, 65535, 7]),
        (torch.uint16, [0, 65535, 7]),
        ("uint32", [0, 2**32 - 1, 5]),
        (torch.int32, [-(2**31), 2**31 - 1, 3]),
        (np.uint8, [255, 0, 1]),
    ],
)
def test_any_integer_dtype_round_trips(tmp_path: Path, dtype: object, ids: list[int]) -> None:
    path = tmp_path / "ids.bin"
    assert write_tokens(path, ids, dtype) == 3
    data = TokenFile(path, 2, dtype)
    assert data.dtype == token_dtype(dtype)
    sample = data[0]
    assert sample["input_ids"].tolist() == ids[:2] and sample["labels"].tolist() == ids[1:]


def test_chunks_of_any_kind_are_written_in_order(tmp_path: Path) -> None:
    path = tmp_path / "mixed.bin"
    chunks = [1, 2, [3, 4], np.arange(5, 8), torch.arange(8, 10), 10, np.int64(11)]
    assert write_tokens(path, chunks) == 11
    assert np.fromfile(path, dtype=np.uint16).tolist() == list(range(1, 12))


def test_bad_ids_leave_no_file_behind(tmp_path: Path) -> None:
    path = tmp_path / "bad.bin"

    def chunks() -> object:
        yield np.arange(100)
        yield [70000]

    with pytest.raises(ValueError, match=r"token id 70000 does not fit uint16 \(0\.\.65535\)"):
        write_tokens(path, chunks())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token id -1 does not fit"):
        write_tokens(path, [-1])
    with pytest.raises(ValueError, match="integers, got float64"):
        write_tokens(path, [np.ones(3)])
    with pytest.raises(ValueError, match="1-D"):
        write_tokens(path, [np.ones((2, 2), dtype=np.int64)])
    assert list(tmp_path.iterdir()) == []  # neither the file nor its partial


def test_mistakes_are_one_clear_line(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    write_tokens(path, range(11))
    with pytest.raises(FileNotFoundError, match="no token file at"):
        TokenFile(tmp_path / "missing.bin", 4)
    with pytest.raises(ValueError, match="seq_len must be an integer >= 1, got 0"):
        TokenFile(path, 0)
    with pytest.raises(ValueError, match="22 bytes is not a whole number of int32 tokens"):
        TokenFile(path, 2, np.int32)
    with pytest.raises(ValueError, match="11 tokens, fewer than one window of seq_len \\+ 1 = 12"):
        TokenFile(path, 11)
    with pytest.raises(ValueError, match="integer dtype, got float32"):
        TokenFile(path, 2, np.float32)
    with pytest.raises(ValueError, match=r"integer dtype, got torch\.float16"):
        TokenFile(path, 2, torch.float16)
    assert len(TokenFile(path, 10)) == 1


def test_the_file_is_opened_by_the_first_read_of_each_process_and_never_mapped(
    tmp_path: Path,
) -> None:
    path = tmp_path / "lazy.bin"
    write_tokens(path, range(5000))
    data = TokenFile(path, 16)
    assert len(data) == 312
    assert str(path) not in _open_paths()  # len() alone never opens it
    data[3]
    assert _open_paths().count(str(path)) == 1
    data[200]
    assert _open_paths().count(str(path)) == 1  # one descriptor, reused
    with open("/proc/self/maps") as fh:
        assert not [line for line in fh if line.rstrip().endswith(str(path))]

    # A pickled copy (a spawn or forkserver worker's) carries no descriptor.
    copy = pickle.loads(pickle.dumps(data))
    assert copy._fd is None
    assert torch.equal(copy[7]["labels"], data[7]["labels"])

    # A forked child opens its own descriptor rather than sharing its parent's.
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            ok = data[9]["input_ids"].tolist() == list(range(144, 160))
            ok = ok and data._fd_pid == os.getpid()
            os.write(write, b"ok" if ok else b"no")
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 2) == b"ok"
    os.close(read)
    os.waitpid(pid, 0)
    assert data._fd_pid == os.getpid()
    assert data[9]["input_ids"].tolist() == list(range(144, 160))


def test_the_streaming_example_writes_its_token_files_once_and_reads_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    job = load_job(EXAMPLES / "lm_stream.py")
    assert job.data_loader == {"num_workers": 2}
    assert (job.input_keys, job.target_keys) == ("input_ids", "labels")
    train, evaluation = job_data(job).train_dataset(), job_data(job).eval_dataset()
    assert isinstance(train, TokenFile) and isinstance(evaluation, TokenFile)
    assert train.path.parent.parent == tmp_path
    example = _example("lm_stream")
    text = example.TEXT
    cut = int(len(text) * example.TRAIN_FRACTION)
    assert train.num_tokens == cut and evaluation.num_tokens == len(text) - cut
    seq = example.SEQ_LEN
    assert example.decode(train[1]["input_ids"]) == text[seq : 2 * seq]
    assert example.decode(train[1]["labels"]) == text[seq + 1 : 2 * seq + 1]
    assert example.decode(evaluation[0]["input_ids"]) == text[cut : cut + seq]
    written = train.path.stat().st_mtime_ns
    again = job_data(load_job(EXAMPLES / "lm_stream.py")).train_dataset()
    assert again.path.stat().st_mtime_ns == written
    inputs, targets = job_data(job).example_batch(2)
    assert inputs.shape == targets.shape == (2, seq)
