"""A `shardprep run` killed in the middle of a shard, then re-run: complete, valid outputs, no temp files."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import webdataset as wds

from conftest import CHECKOUT, write_config
from shardprep import synthetic
from shardprep.layout import Layout


def _shardprep(config: str, home: Path) -> subprocess.Popen:
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    return subprocess.Popen([sys.executable, "-m", "shardprep.cli", "--code-location", str(CHECKOUT), "run",
                             "--config", config, "--no-progress"], env=env, cwd=CHECKOUT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_killed_run_resumes_to_complete_outputs(tmp_path, tiny_clip_dir):
    site = tmp_path / "site"
    synthetic.make_demo_site(str(site), n_images=60, seed=2)
    base_url, stop = synthetic.serve_directory(str(site), slow_seconds=0.5)
    try:
        # every image answers after 0.5 s: a 20-row shard with 4 threads takes ~2.5 s to download
        src = tmp_path / "source"
        synthetic.make_source_parquets(str(src), base_url + "/slow", n_files=1, rows_per_file=60, n_images=60,
                                       broken_share=0.0)
        root = tmp_path / "out"
        config = write_config(tmp_path / "c.yaml", source=f"{src}/*.parquet", output_root=str(root),
                              samples_per_shard=20, image_size=32, thread_count=4, timeout=5,
                              allow_private_addresses=True, clip_model=f"hf_clip:{tiny_clip_dir}",
                              enable_nemo_text2img=False, enable_nemo_diffusion=False)
        layout = Layout(str(root))
        home = tmp_path / "dagster_home"
        proc = _shardprep(config, home)
        deadline = time.time() + 240
        while not Path(layout.shard_stats("00000")).exists():  # shard 00000 done: 00001 is now downloading
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "first shard never finished"
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not Path(layout.shard_stats("00001")).exists(), "killed too late to test a partial shard"
        assert not Path(layout.tar("00001")).exists()  # never a half-written final file

        proc = _shardprep(config, home)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
    finally:
        stop()

    for shard in ("00000", "00001", "00002"):
        table = pq.read_table(layout.shard_parquet(shard)).to_pandas()
        assert len(table) == 20 and set(table.status) == {"success"}
        assert len(list(wds.WebDataset(layout.tar(shard), shardshuffle=False))) == 20
        assert Path(layout.reordered_img(shard)).exists()
    leftovers = [p for p in root.rglob("*") if ".tmp-" in p.name]
    assert leftovers == []
