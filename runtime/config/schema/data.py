"""The ``data`` section: where samples come from and how each worker batches them (docs/data.md).

Its own module because it is the section a new data source touches (the name in
``DataConfig.source``'s ``Literal`` and what ``_local_data_problem`` checks of its folder), and the
only one that looks at the local file system before any worker starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from runtime.config.base import MAX_BATCH, MAX_CLASSES, MAX_SYNTHETIC, Strict, short
from runtime.config.values import LocalLocation, parse_http_url, parse_seed, parse_storage


class DataConfig(Strict):
    """Where samples come from and how each worker batches them (docs/data.md)."""

    source: Literal["synthetic", "cifar10", "imagefolder", "shards", "digits", "tokens", "text"] = Field(
        "synthetic", description="Images: synthetic, cifar10, imagefolder, shards, digits. Token sequences "
                                 "(model.name=gpt): tokens (synthetic, made on the device), text (bytes of Python's "
                                 "standard library sources, a real text every machine has).")
    path: str | None = Field(
        None, description="cifar10: folder of python batches; imagefolder: folder with train/<class>/* "
                          "(and val/<class>/*); shards: folder or s3://bucket/prefix with train/ and val/ "
                          "tar shards written by `python -m runtime data pack`.")
    image_size: int = Field(32, ge=8, le=1024, description="Square input size fed to the model.")
    num_classes: int = Field(10, ge=2, description="Classes for synthetic data (real sets know theirs).")
    num_samples: int = Field(2048, ge=1, description="Synthetic training samples.")
    val_samples: int = Field(256, ge=0, description="Synthetic validation samples.")
    batch_size: int = Field(32, ge=1, description="Per-worker batch per accumulation step (the loader's batch).")
    micro_batch: int | Literal["auto"] | None = Field(
        None, description="Samples per forward/backward on the device (docs/memory.md): None = the whole "
                          "batch_size, unguarded; a number = split each batch into micro-batches of it; auto = the "
                          "largest that fits, probed at start on every rank (all take the smallest). A number or auto "
                          "also guards the run: out of memory in a step halves it and redoes the step on every "
                          "rank, keeping the global batch (under FSDP, ranks agree before each of its collectives; "
                          "auto is refused with distributed.tp_size > 1).")
    @field_validator("batch_size")
    @classmethod
    def _batch_fits(cls, v: int) -> int:
        if v > MAX_BATCH:
            raise ValueError(f"{v} samples per worker in one micro-batch cannot fit in a device's memory (at most "
                             f"{MAX_BATCH}); raise train.grad_accum_steps or distributed.num_workers instead")
        return v

    @model_validator(mode="after")
    def _micro_within_batch(self) -> DataConfig:
        if isinstance(self.micro_batch, int) and not 1 <= self.micro_batch <= self.batch_size:
            raise ValueError(f"data.micro_batch={self.micro_batch} must be between 1 and "
                             f"data.batch_size={self.batch_size} (it splits each batch; raise batch_size for a "
                             "larger global batch)")
        return self

    @field_validator("num_classes")
    @classmethod
    def _classes_fit(cls, v: int) -> int:
        if v > MAX_CLASSES:
            raise ValueError(f"{v} classes is more than the classifier head is sized for (at most {MAX_CLASSES})")
        return v

    @field_validator("num_samples", "val_samples")
    @classmethod
    def _samples_fit(cls, v: int) -> int:
        if v > MAX_SYNTHETIC:
            raise ValueError(f"{v} synthetic samples: they are indexed in memory on every worker "
                             f"(at most {MAX_SYNTHETIC:,}); use a real data set for more")
        return v
    loader_workers: int | Literal["auto"] = Field(
        "auto", description="DataLoader worker processes; auto = 0 on CPU, 4 on GPU."
    )
    decode: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="Where JPEGs are decoded (imagefolder, shards): gpu = nvJPEG on the device, "
                            "loader workers only read bytes; auto = gpu when CUDA and torchvision's image "
                            "extension are available, else Pillow on the CPU.")
    crop_scale: tuple[float, float] = Field(
        (0.08, 1.0), description="Training RandomResizedCrop: range of the crop's share of the image area.")
    crop_ratio: tuple[float, float] = Field(
        (3 / 4, 4 / 3), description="Training RandomResizedCrop: range of the crop's aspect ratio (w/h).")
    hflip: bool = Field(True, description="Training: flip half of the images horizontally.")
    shuffle_buffer: int = Field(
        1000, ge=1, description="shards: about how many consecutive samples of the epoch's order are "
                                "shuffled together (a loader worker holds its share of them).")
    endpoint_url: str | None = Field(
        None, description="shards on an S3-compatible endpoint; default: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL.")
    seed: int = 0

    @field_validator("loader_workers")
    @classmethod
    def _non_negative(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 0:
            raise ValueError("must be >= 0 or 'auto'")
        return v

    @field_validator("crop_scale", "crop_ratio")
    @classmethod
    def _range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not 0 < v[0] <= v[1]:
            raise ValueError(f"expected 0 < low <= high, got {list(v)}")
        return v

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        return None if v is None else parse_http_url(v)

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int) -> int:
        return parse_seed(v)

    @model_validator(mode="after")
    def _path_needed(self) -> DataConfig:
        if self.source in ("cifar10", "imagefolder", "shards"):
            if not self.path:
                raise ValueError(f"data.path is required when data.source is {self.source!r}")
            try:
                where = parse_storage(self.path)
            except ValueError as e:
                raise ValueError(f"data.path {short(self.path)} {e}") from None
            if where.remote and self.source != "shards":
                raise ValueError(f"data.path must be a local folder for data.source={self.source!r} (only shards "
                                 f"are read from object storage), got {short(self.path)}")
            if isinstance(where, LocalLocation):
                try:
                    folder = where.path
                except ValueError as e:
                    raise ValueError(f"data.path {short(self.path)} {e}") from None
                if not folder.is_dir():
                    raise ValueError(f"data.path {short(self.path)} is not a directory (data.source={self.source!r})")
                problem = _local_data_problem(self.source, folder)
                if problem:
                    raise ValueError(f"data.path {short(self.path)}: {problem}")
        if self.crop_scale[1] > 1:
            raise ValueError(f"data.crop_scale: the upper bound is a share of the image, at most 1 "
                             f"(got {list(self.crop_scale)})")
        return self


def _local_data_problem(source: str, root: Path) -> str | None:
    """What a worker would find missing in a local data folder, checked before any worker starts."""
    if source == "cifar10":
        if (root / "cifar-10-batches-py").is_dir():
            root = root / "cifar-10-batches-py"
        # The loader reads every data_batch_* there is (a subset trains on less) and needs test_batch.
        missing = [f for f in ("data_batch_*", "test_batch") if not any(root.glob(f))]
        if missing:
            return (f"no CIFAR-10 python batches: {' and '.join(missing)} missing (expected data_batch_1..5 "
                    "and test_batch, as in cifar-10-python.tar.gz)")
    elif source == "imagefolder" and not any(e.is_dir() and not e.name.startswith(".") for e in os.scandir(root)):
        return ("has no class folders (expected train/<class>/<image> and optionally val/<class>/<image>, "
                "or <class>/<image>)")
    elif source == "shards" and not (root / "train").is_dir():
        return "no train/ folder of shards (expected train/000000.tar ..., written by `python -m runtime data pack`)"
    return None
