"""A large data set is read lazily: a 1M-record Parquet file costs the SFT data pipeline about what a 1k one does.

Each size runs in a fresh process (its own RSS, its own datasets cache) through the trainer's pipeline:
`setup.build_datasets` (SFTDataset per file, the train/validation split) and `MicroBatchLoader` steps.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from ..conftest import REPO_ROOT

ALLOWED_GROWTH_MB = 100

PIPELINE = """
import json, resource, sys
from pathlib import Path
from aligner.data.loader import MicroBatchLoader
from aligner.data.sft import SFTDataset
from aligner.tokenizer import Tokenizer
from aligner.training.setup import DatasetEntry, build_datasets
from aligner.training.trainer import TrainerConfig

def rss_mb(field):
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024

path, tokenizer_dir = sys.argv[1], sys.argv[2]
tokenizer = Tokenizer(tokenizer_dir)
trainer_cfg = TrainerConfig(max_steps=3, global_batch_size=8, micro_batch_size=4)
train, validation = build_datasets(
    train=[DatasetEntry(path)], validation=[], split="98,2", seed=1, trainer_cfg=trainer_cfg,
    load_dataset=lambda entry: SFTDataset(entry.path, tokenizer, 32, use_template=False))
loader = MicroBatchLoader(train, global_batch_size=8, micro_batch_size=4, data_parallel_rank=0, data_parallel_size=1,
                          seed=1, shuffle=True, pad_id=tokenizer.pad_id, pad_to_multiple_of=1)
steps = list(loader.iterate(limit_samples=24))
print("RESULT " + json.dumps({"train": len(train), "validation": len(validation), "steps": len(steps),
                              "rss_mb": rss_mb("VmRSS"), "anon_mb": rss_mb("RssAnon"),
                              "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def write_sft_parquet(path, records: int):
    """{"input": "<i>+1=", "output": "<i+1>"} for i < records, written by pyarrow directly."""
    numbers = pa.array(range(records), pa.int64())
    pq.write_table(pa.table({"input": pc.binary_join_element_wise(pc.cast(numbers, pa.string()), "+1=", ""),
                             "output": pc.cast(pc.add(numbers, 1), pa.string())}), path)
    return path


def pipeline_memory(tmp_path, records: int, tokenizer_dir) -> dict:
    path = write_sft_parquet(tmp_path / f"sft_{records}.parquet", records)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
           "HF_DATASETS_CACHE": str(tmp_path / f"cache_{records}")}
    result = subprocess.run([sys.executable, "-c", PIPELINE, str(path), str(tokenizer_dir)], capture_output=True,
                            text=True, env=env, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.split("RESULT ", 1)[1])


@pytest.mark.slow
def test_a_million_record_parquet_file_costs_the_sft_pipeline_no_more_memory_than_a_thousand(
        tmp_path, arithmetic_tokenizer_dir):
    small = pipeline_memory(tmp_path, 1_000, arithmetic_tokenizer_dir)
    large = pipeline_memory(tmp_path, 1_000_000, arithmetic_tokenizer_dir)
    assert (small["train"], small["validation"], large["train"], large["validation"]) == (980, 20, 980_000, 20_000)
    assert small["steps"] == large["steps"] == 3
    growth = {key: large[key] - small[key] for key in ("rss_mb", "anon_mb", "peak_mb")}
    print(f"1k: {small}\n1M: {large}\ngrowth (MB): {growth}")
    assert growth["rss_mb"] < ALLOWED_GROWTH_MB and growth["peak_mb"] < ALLOWED_GROWTH_MB, growth
