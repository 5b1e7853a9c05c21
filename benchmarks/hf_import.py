"""Host memory of importing a Hugging Face checkpoint onto a mesh: shardlm's slice-by-slice import against the
obvious way (load the whole safetensors file, then place it), measured in one run.

A random-weight GPT-2 (124M parameters by default, 498 MB of float32) is built with transformers and saved with
`save_pretrained`; then each way runs in a fresh process (or two, for 2 processes x 4 devices) of 8 simulated CPU
devices with FSDP over all of them, while a thread samples the process's anonymous resident memory (RssAnon, every
5 ms): what the import needs beyond what the devices end up holding. On a CPU host the devices' arrays are host
memory too, so "held" (this process's share of the model) is subtracted; the file's pages that the reads map in
are page cache (RssFile above the baseline), shared and reclaimable, and reported apart.

    python benchmarks/hf_import.py                  # gpt2 124M
    python benchmarks/hf_import.py --layers 24 --width 1024 --heads 16     # GPT-2 medium's shape
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def rss(kind: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(kind + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(directory: str, way: str, processes: int, pid: int, port: int) -> dict:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // processes}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    from shardlm import distributed

    if processes > 1:
        distributed.join(distributed.JoinOptions(f"127.0.0.1:{port}", processes, pid))
    import jax
    import numpy as np

    import shardlm.train.init_from  # noqa: F401 - every module loaded before the baseline
    import shardlm.load  # noqa: F401

    jax.numpy.zeros(1).block_until_ready()  # the runtime up before the baseline
    base_anon, base_file, peak = rss("RssAnon"), rss("RssFile"), {"anon": 0, "file": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak["anon"] = max(peak["anon"], rss("RssAnon"))
            peak["file"] = max(peak["file"], rss("RssFile"))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    if way == "shardlm":
        from shardlm.load import load_model

        m = load_model(f"hf:{directory}", overrides=["mesh.data=1", "mesh.fsdp=-1"])
        state = m.state
    else:  # the whole file in host memory, then placed with the same shardings
        from flax import nnx
        from safetensors.numpy import load_file

        from shardlm.config import load_config
        from shardlm.families import hf_format
        from shardlm.hf.config import read_hf_config
        from shardlm.hf.weights import Checkpoint, parameter_views
        from shardlm.mesh import mesh_from_config
        from shardlm.trees import path_str
        from shardlm.train.state import abstract_model, vocab_sizes

        cfg = load_config(None, [f"model=hf:{directory}", "mesh.data=1", "mesh.fsdp=-1"])
        mesh = mesh_from_config(cfg.mesh)
        whole = load_file(str(Path(directory) / "model.safetensors"))  # every tensor, read at once
        real, padded = vocab_sizes(cfg, cfg.model.vocab_size, 1)
        views = parameter_views(cfg.model, hf_format(cfg.model), real, padded, Checkpoint(Path(directory)),
                                read_hf_config(Path(directory)))
        for view in views.values():  # the views now read from the loaded dict, not the file
            v = view
            while not hasattr(v, "reader"):
                v = v.inner
            v.reader = lambda name, index: whole[name][index]
        _, abstract = abstract_model(cfg, mesh, real)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(abstract))
        arrays = [jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda i, v=views[path_str(p)],
                                               d=leaf.dtype: np.asarray(v[i], d)) for p, leaf in leaves]
        state = arrays
    jax.block_until_ready(jax.tree.leaves(state))
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    held = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards)
    out = {"way": way, "process": pid, "processes": processes, "seconds": seconds, "held": held,
           "peak_anon_above_base": peak["anon"] - base_anon, "peak_file": peak["file"] - base_file}
    if processes > 1:
        distributed.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        d, way, n, i, port = args.child
        print("RESULT " + json.dumps(child(d, way, int(n), int(i), int(port))), flush=True)
        return

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardlm.launch import free_port

    directory = tempfile.mkdtemp(prefix="shardlm-hf-import-")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads))
    model.save_pretrained(directory)
    size = (Path(directory) / "model.safetensors").stat().st_size
    n_params = sum(p.numel() for p in model.parameters())
    del model
    print(f"GPT-2 {n_params / 1e6:.1f}M parameters (random), model.safetensors {size / 2**20:,.0f} MiB; 8 simulated "
          f"CPU devices, FSDP 8 (each device holds 1/8)")
    print(f"{'import':<26} {'processes':>9} {'seconds':>8} {'held by the process':>20} "
          f"{'peak anon above base':>21} {'above held':>11} {'file pages':>11}")
    for way in ("shardlm", "whole file first"):
        for processes in (1, 2):
            port = free_port()
            procs = [subprocess.Popen([sys.executable, __file__, "--child", directory, way.split()[0], str(processes),
                                       str(i), str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                     for i in range(processes)]
            for p in procs:
                out, err = p.communicate()
                line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
                if p.returncode or line is None:
                    sys.exit(f"{way} x {processes} failed:\n{err[-3000:]}")
                r = json.loads(line[7:])
                mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
                who = f"{r['process'] + 1} of {processes}"
                print(f"{way:<26} {who:>9} {r['seconds']:>8.1f} {mib(r['held']):>20} "
                      f"{mib(r['peak_anon_above_base']):>21} {mib(r['peak_anon_above_base'] - r['held']):>11} "
                      f"{mib(r['peak_file']):>11}")


if __name__ == "__main__":
    main()
